"""dflash2/runtime/kernels/interpreter_reduce.py: the interpreter's user-combine reductions, slice-wise,
give the per-element loop's values bit for bit (CPU only: it is the interpreter that is patched)."""

import pytest
import torch
import triton
import triton.language as tl

from dflash2.runtime.kernels.gdn_verify.kernel import _dot_rows
from dflash2.runtime.kernels.interpreter_reduce import vectorize_interpreter_reductions
from dflash2.runtime.kernels.triton_util import interpreting

pytestmark = pytest.mark.skipif(not interpreting(), reason="patches Triton's interpreter (TRITON_INTERPRET=1)")


@triton.jit
def _max_and_count(ax, ay, bx, by):
    """A tuple combine that is not one of Triton's own: the larger value, and a count of combines."""
    return tl.maximum(ax, bx), ay + by


@triton.jit
def _reductions(h, w, dots, maxes, counts, kept, BK: tl.constexpr, BV: tl.constexpr):
    """The GDN recurrence's fma sums of a (BK, BV) tile, a tuple reduction over axis 1, and one with keep_dims."""
    r, c = tl.arange(0, BK), tl.arange(0, BV)
    tile = tl.load(h + r[:, None] * BV + c[None, :])
    tl.store(dots + c, _dot_rows(tile, tl.load(w + r), True))
    m, n = tl.reduce((tile, tl.full(tile.shape, 1, tl.int32)), 1, _max_and_count)
    tl.store(maxes + r, m)
    tl.store(counts + r, n)
    k = tl.reduce(tile, 0, _halve_and_add, keep_dims=True)
    tl.store(kept + c[None, :], k)


@triton.jit
def _halve_and_add(a, b):
    """An order-sensitive combine (a left fold halves the earlier rows), so a change of order would show."""
    return a * 0.5 + b


def _run(BK=16, BV=8, seed=3):
    g = torch.Generator().manual_seed(seed)
    h, w = torch.randn(BK, BV, generator=g), torch.randn(BK, generator=g)
    out = dict(dots=torch.empty(BV), maxes=torch.empty(BK), counts=torch.empty(BK, dtype=torch.int32))
    out["kept"] = torch.empty(1, BV)
    _reductions[(1,)](h, w, out["dots"], out["maxes"], out["counts"], out["kept"], BK=BK, BV=BV)
    return h, w, out


def test_slice_wise_reductions_equal_the_per_element_loop(monkeypatch):
    from triton.runtime.interpreter import ReduceOps

    assert vectorize_interpreter_reductions() and vectorize_interpreter_reductions()  # idempotent
    sliced = ReduceOps.generic_reduce
    h, w, fast = _run()
    monkeypatch.setattr(ReduceOps, "generic_reduce", sliced.__wrapped__)
    _, _, slow = _run()
    for name in fast:
        assert torch.equal(fast[name], slow[name]), name
    # and the values are what the combines say: counts of the row length, the row maxima, the chains
    assert torch.equal(fast["counts"], torch.full((16,), 8, dtype=torch.int32))
    assert torch.equal(fast["maxes"], h.max(1).values)
    chain = h[0].clone()
    for row in h[1:]:
        chain = chain * 0.5 + row
    assert torch.equal(fast["kept"][0], chain)
    torch.testing.assert_close(fast["dots"], (h * w[:, None]).sum(0), rtol=1e-5, atol=1e-5)
