"""dflash2/runtime/kernels/interpreter_nested_calls.py: a jit helper called inside an interpreted launch skips
re-patching triton.language, the kernel's results do not change, and outside a launch nothing is skipped
(CPU only: it is the interpreter that is patched)."""

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter

from dflash2.runtime.kernels import interpreter_nested_calls as nested
from dflash2.runtime.kernels.triton_util import interpreting

pytestmark = pytest.mark.skipif(not interpreting(), reason="patches Triton's interpreter (TRITON_INTERPRET=1)")


@triton.jit
def _scaled_exp(x, s):
    """A helper that uses tl builtins, tl.math and tensor operators (all patched by the launch)."""
    return tl.exp(x) * s + tl.math.sqrt(tl.abs(x))


@triton.jit
def _kernel(x, out, N: tl.constexpr):
    o = tl.arange(0, N)
    v = tl.load(x + o)
    tl.store(out + o, _scaled_exp(_scaled_exp(v, 0.5), 2.0))


def _run(n=16):
    x = torch.linspace(-2.0, 1.0, n)
    out = torch.empty(n)
    _kernel[(1,)](x, out, N=n)
    return x, out


def test_nested_calls_skip_the_walk_and_give_the_same_values(monkeypatch):
    assert nested.skip_repatching_nested_calls()
    assert nested.skip_repatching_nested_calls()  # idempotent: still one wrapper
    assert getattr(interpreter._patch_lang, "__wrapped__", None) is not None
    assert not getattr(interpreter._patch_lang.__wrapped__, nested._PATCHED, False)

    x, fast = _run()
    y = torch.exp(x) * 0.5 + torch.sqrt(x.abs())
    torch.testing.assert_close(fast, torch.exp(y) * 2.0 + torch.sqrt(y.abs()))

    walks = []
    original = interpreter._patch_lang.__wrapped__

    def counting(fn):
        walks.append(fn.__name__)
        return original(fn)

    # the same wrapper over a counting original: only full patches are counted
    monkeypatch.setattr(interpreter, "_patch_lang", nested.skipping_patch_lang(counting, interpreter._LangPatchScope))
    _, again = _run()
    assert torch.equal(again, fast)
    assert walks == ["_kernel"]  # the launch patched once; both helper calls found it patched

    # without the skip every helper call walks the modules again: same values
    walks.clear()
    monkeypatch.setattr(interpreter, "_patch_lang", counting)
    _, plain = _run()
    assert torch.equal(plain, fast)
    assert walks == ["_kernel", "_scaled_exp", "_scaled_exp"]


def test_outside_a_launch_nothing_counts_as_patched():
    assert not nested._already_patched(_scaled_exp.fn)
    assert tl.core.is_builtin(tl.load)  # the last launch restored the language
