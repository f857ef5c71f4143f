"""The runtime target's GEMM switch (dflash2/runtime/gemm.py): names, fallbacks, and decoding through it.

With ``set_gemm_backend("skinny")`` every projection of the runtime target goes through the Triton
skinny GEMM (here through Triton's interpreter: conftest sets TRITON_INTERPRET=1 without a GPU and
``kernels.on_cpu()`` sends CPU tensors to the kernels). In fp32 the kernel is IEEE fp32 with another
summation order than the CPU BLAS, so logits agree to fp32 rounding, not bit for bit, and the
decoded tokens are compared: AR and speculative decoding through the switch emit the default
backend's tokens. Both runs are inside ``on_cpu()``, so only the GEMMs differ.
"""

import os

import pytest
import torch
import torch.nn.functional as F
from conftest import spec_drafter

from dflash2.runtime import kernels, load_model
from dflash2.runtime.drafter import RuntimeDrafter
from dflash2.runtime.engine import generate_ar, generate_spec
from dflash2.runtime.gemm import BACKENDS, gemm_backend, gemm_in_use, linear, set_gemm_backend
from dflash2.runtime.kernels import skinny_gemm as sg

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
cpu_only = pytest.mark.skipif(not INTERPRETED, reason="CPU tensors need TRITON_INTERPRET=1 (set by conftest)")

TAPS = [0, 1]
PROMPTS = [[5, 17, 3, 44, 9, 2, 71], [8, 30, 12]]  # ragged
N_NEW = 6


@pytest.fixture
def backend():
    """Yields set_gemm_backend and restores the previous setting afterwards."""
    old = gemm_backend()
    yield set_gemm_backend
    set_gemm_backend(old)


@pytest.fixture
def gemm_calls(monkeypatch):
    """Counts the skinny kernel's launches (skinny_linear calls skinny_gemm only when it takes the input)."""
    calls = []
    real = sg.skinny_gemm

    def counted(x, *args, **kw):
        calls.append(x.shape[0])
        return real(x, *args, **kw)

    monkeypatch.setattr(sg, "skinny_gemm", counted)
    return calls


def test_names_round_trip_and_bad_names_are_one_line(backend):
    assert gemm_backend() == "cublas"  # the default: F.linear, no behaviour change
    for name, resolved in ((None, "cublas"), ("default", "cublas"), ("cublas", "cublas"), ("skinny", "skinny")):
        backend("skinny" if resolved == "cublas" else "cublas")  # from the other setting
        backend(name)
        assert gemm_backend() == resolved
        backend(gemm_backend())  # the resolved name round-trips
        assert gemm_backend() == resolved
    assert set(BACKENDS) == {"default", "cublas", "skinny"}
    for bad in ("cuBLAS", "triton", ""):
        with pytest.raises(ValueError) as e:
            backend(bad)
        assert str(e.value) == f"GEMM backend {bad!r} not known; use one of default, cublas, skinny"
    assert gemm_backend() == "skinny"  # a bad name changes nothing


def test_in_use_applies_the_fallbacks(backend):
    backend("skinny")
    assert gemm_in_use("cpu") == "cublas"  # CPU tensors outside the interpreter's on_cpu(): F.linear
    if INTERPRETED:
        with kernels.on_cpu():
            assert gemm_in_use("cpu") == "skinny"
            with kernels.kernels(False):
                assert gemm_in_use("cpu") == "cublas"
            backend("cublas")
            assert gemm_in_use("cpu") == "cublas"


@cpu_only
def test_linear_dispatches_by_backend_and_rows(backend, gemm_calls):
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(24, 40, generator=g), torch.randn(24, generator=g)
    x = torch.randn(3, 5, 40, generator=g)  # 15 rows
    big = torch.randn(129, 40, generator=g)  # more than MAX_M rows: prefill, F.linear
    with kernels.on_cpu():
        backend("cublas")
        assert torch.equal(linear(x, w, b), F.linear(x, w, b)) and gemm_calls == []
        backend("skinny")
        y = linear(x, w, b)
        assert gemm_calls == [15] and y.shape == (3, 5, 24)
        torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)  # fp32, another summation order
        assert torch.equal(linear(big, w, b), F.linear(big, w, b)) and gemm_calls == [15]
        wt = w.T.contiguous().T  # the same weight, strided along K: F.linear
        assert torch.equal(linear(x, wt, b), F.linear(x, wt, b)) and gemm_calls == [15]


@pytest.fixture(scope="module")
def qwen3(hf_targets):
    from dflash2.target import TargetModel

    hf, folder = hf_targets["qwen3"]
    return TargetModel(hf, target_layer_ids=TAPS), load_model(folder, target_layer_ids=TAPS)


@cpu_only
def test_forward_logits_agree_to_fp32_rounding(qwen3, backend, gemm_calls):
    _, model = qwen3
    tokens = torch.tensor([[5, 17, 3, 44], [8, 30, 12, 1]])
    out = {}
    with kernels.on_cpu():
        for name in ("cublas", "skinny"):
            backend(name)
            state = model.new_state(2, 16)
            out[name] = model(tokens, state).logits
    # every projection of both layers (q|k|v, o_proj, gate|up, down) and the LM head, 8 rows each
    assert gemm_calls == [8] * (4 * len(model.layers) + 1)
    # IEEE fp32 both ways, summed in another order: agreement to a few fp32 ulps of the activations
    torch.testing.assert_close(out["skinny"], out["cublas"], rtol=1e-5, atol=1e-5)


@cpu_only
def test_ar_and_spec_decode_emit_the_default_tokens(qwen3, backend, gemm_calls):
    target, model = qwen3
    drafter = RuntimeDrafter(spec_drafter(target, 4), model)
    runs = {}
    with kernels.on_cpu():
        for name in ("cublas", "skinny"):
            backend(name)
            del gemm_calls[:]
            ar = generate_ar(model, PROMPTS, N_NEW)
            spec = generate_spec(model, drafter, PROMPTS, N_NEW)
            runs[name] = (ar, spec.sequences, len(gemm_calls))
    assert runs["cublas"][2] == 0 and runs["skinny"][2] > 0  # the switch really sent the target's GEMMs
    assert runs["skinny"][0] == runs["cublas"][0]  # AR, token for token
    assert runs["skinny"][1] == runs["cublas"][1] == runs["cublas"][0]  # spec: lossless, and the same tokens
