"""The runtime drafter's fused kernels (add_rms_norm_fp32w, draft_qk_rope_write) against their twins, and a
draft step through them against the eager step.

On the CPU they run through Triton's interpreter (``kernels.on_cpu()``; conftest sets TRITON_INTERPRET=1
without a GPU). Tolerances: the kernels round at the twins' points, and the one reduction (a row's or
head's sum of squares) sums in Triton's order, so rstd may differ in its last fp32 bit. fp32 outputs:
a few fp32 ulps (rtol = atol = 1e-5, as test_runtime_kernels.py; values are O(1), products of ≤ 3
rounded terms). bf16: where that last bit flips a rounding, one bf16 ulp (2⁻⁸ relative) on a GPU; under
the interpreter the fp32 -> bf16 cast does not round to nearest (test_runtime_kernels.py), so a few
ulps there. The residual sum h (one fp32 add, rounded once) is exact but for that cast; V, a copy,
is exact. The whole step: the fused path drafts the same tokens as the eager path (fp32) and
writes the same caches (the kernel tests poison what must stay unwritten).
"""

import os

import pytest
import torch

from dflash2.runtime import kernels
from dflash2.runtime.draft_math import rope_tables
from dflash2.runtime.kernels.draft_rope import draft_qk_rope_write, draft_qk_rope_write_ref
from dflash2.runtime.kernels.norm import add_rms_norm_fp32w, add_rms_norm_fp32w_ref

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture
def interpret():
    if os.environ.get("TRITON_INTERPRET") != "1":
        yield  # a GPU machine: the CPU half of each test is skipped below, the GPU half runs for real
        return
    with kernels.on_cpu():
        yield


def _devices():
    cpu = ["cpu"] if os.environ.get("TRITON_INTERPRET") == "1" else []
    return cpu + (["cuda"] if torch.cuda.is_available() else [])


def _assert_close(a, b, dtype, device):
    if dtype == torch.float32:
        tol = dict(rtol=1e-5, atol=1e-5)
    elif device == "cpu":  # the interpreter's bf16 cast truncates
        tol = dict(rtol=0.02, atol=0.07)
    else:
        tol = dict(rtol=0.008, atol=0.008)  # one bf16 ulp
    torch.testing.assert_close(a.float(), b.float(), **tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("D", [37, 768])
def test_add_rms_norm_fp32w(interpret, dtype, residual, D):
    for device in _devices():
        g = torch.Generator().manual_seed(0)
        x = torch.randn(3, 5, D, generator=g).to(device, dtype)
        r = torch.randn(3, 5, D, generator=g).to(device, dtype) if residual else None
        w = torch.randn(D, generator=g).to(device)  # fp32, as DraftWeights holds it
        h, y = add_rms_norm_fp32w(x, r, w, 1e-6)
        h_ref, y_ref = add_rms_norm_fp32w_ref(x, r, w, 1e-6)
        assert h.dtype == y.dtype == dtype and y.shape == x.shape
        if dtype == torch.float32 or device == "cuda":
            assert torch.equal(h, h_ref)  # one fp32 add, rounded once: exact
        else:
            _assert_close(h, h_ref, dtype, device)  # the interpreter's bf16 cast truncates
        _assert_close(y, y_ref, dtype, device)


def _rope_case(device, dtype, N, T, H, L, Hkv, hd, S, seed):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(N, T, (H + 2 * L * Hkv) * hd, generator=g).to(device, dtype)
    norm32 = (1 + 0.3 * torch.randn(H + L * Hkv, hd, generator=g)).to(device)
    lengths = torch.randint(0, S - T + 1, (N,), generator=g).to(device)
    positions = lengths[:, None] + torch.arange(T, device=device)
    freqs = 10000.0 ** (-torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    sign = torch.ones(hd)
    sign[: hd // 2] = -1
    cos, sin = rope_tables(positions, torch.cat([freqs, freqs]).to(device), sign.to(device), dtype)
    return qkv, norm32, cos, sin, positions


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", ["draft_step", "append_all_layers"])
def test_draft_qk_rope_write(interpret, dtype, variant):
    """A draft step's layer (H query heads, one cache slot as (N, Hkv, S, hd)) and the context append of all
    layers (no q, L slots); odd sizes: 3 query heads, hd 24 (a masked block of 32), 5 tokens."""
    N, T, Hkv, hd, S, Lc = 2, 5, 2, 24, 11, 3
    H, L = (3, 1) if variant == "draft_step" else (0, Lc)
    for device in _devices():
        qkv, norm32, cos, sin, positions = _rope_case(device, dtype, N, T, H, L, Hkv, hd, S, seed=2)
        caches = torch.full((2, Lc, N, Hkv, S, hd), float("nan"), dtype=dtype, device=device)  # poison
        ref = caches.clone()

        inputs = (qkv, norm32, cos, sin, positions)
        q, q_ref = (
            fn(*inputs, *((c[0, 1], c[1, 1]) if H else (c[0], c[1])), num_heads=H, eps=1e-6)  # slot 1, or every slot
            for fn, c in ((draft_qk_rope_write, caches), (draft_qk_rope_write_ref, ref))
        )
        if H:
            assert q.shape == (N, H, T, hd) and q.dtype == dtype
            _assert_close(q, q_ref, dtype, device)
        else:
            assert q is None and q_ref is None
        slots = [1] if H else list(range(Lc))
        for n in range(N):  # exactly the block's positions of each row were written, nothing else
            cols = positions[n].cpu()
            others = torch.tensor([s for s in range(S) if s not in cols.tolist()])
            for kv in (0, 1):
                got, want = caches[kv, slots, n][:, :, cols], ref[kv, slots, n][:, :, cols]
                if kv == 1:
                    assert torch.equal(got, want)  # V: a copy
                else:
                    _assert_close(got, want, dtype, device)
                assert caches[kv, slots, n][:, :, others].isnan().all()
        if H:
            assert caches[:, [0, 2]].isnan().all()  # other slots untouched
