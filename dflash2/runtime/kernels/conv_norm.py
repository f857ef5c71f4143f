"""A DFlash2 sublayer's post-conv, the residual add after it and the next RMSNorm in one launch (twin: the eager ops).

Why: in the runtime drafter a conv'd sublayer ends in its post-conv (``local_conv`` side 1), whose output only
the next norm reads (``add_rms_norm_fp32w(h, out)``: the deferred residual add, then the norm). Two launches
of ~1-2 µs each inside a CUDA graph, for work that fits one: the H200 profile of the small pair's draft phase
(docs/BENCHMARKS.md, stop 16) had 12 ``_local_conv_kernel`` launches and 7 ``_add_rms_norm_kernel`` ones
among its 61 kernels. Here one program per token row computes the row's post-conv (it reads rows i, i-1, ...,
i-K+1 of the sublayer's output z, all of the same block), adds it to the residual stream and normalises the
sum: 6 launches fewer per draft step for 3 drafter layers (2 sublayers each), the post-conv of the last one
going into the final norm.

Exactness: every value is computed by the same Triton code as the unfused pair, ``_conv_side_row`` of
kernels/local_conv.py (side 1), then ``_residual_add`` and ``_rms_norm_row`` of kernels/norm.py (the drafter's
mode, fp32 weight, one rounding), with the same row block and warps as ``add_rms_norm_fp32w``'s launch (so the
same sum-of-squares order), and both launches are compiled without FMA contraction (``enable_fp_fusion=False``:
the conv's round(out + x·W) needs it; the norm launch then matches). So the results are the unfused kernels'
bit for bit, and differ from the twin only where those do: a norm's rstd in its last fp32 bit (reduction
order, rsqrt), and under Triton's interpreter the bf16 casts, which truncate there.

Shapes: N rows, T block tokens (one block from its first position), d = G·gs channels, K conv taps; x, z
(N, T, d) in one dtype; delta (N, T, 2·K·G) in it (``ConvWeights``' layout); base (2, K, G, gs)
``ConvWeights.base``; weight32 (d,) fp32. Returns (h, y), both (N, T, d) in x's dtype.
"""

import torch
import triton.language as tl

from dflash2.runtime.draft_math import conv_apply, conv_kernels_of
from dflash2.runtime.draft_math import rms_norm as _draft_rms_norm
from dflash2.runtime.kernels import jit, use_triton
from dflash2.runtime.kernels.local_conv import _conv_side_row, local_conv
from dflash2.runtime.kernels.norm import _residual_add, _rms_norm_row, _warps, add_rms_norm_fp32w, triton_next_pow2


def conv_add_rms_norm_fp32w_ref(x, z, delta, base, weight32, eps: float):
    """The eager twin, today's unfused ops: the post-conv ``conv_apply(z, conv_kernels_of(delta, base, 1))``
    (local_conv's twin), then ``h = x + out`` and ``draft_math.rms_norm(h, weight32, eps)`` (add_rms_norm_fp32w's)."""
    h = x + conv_apply(z, conv_kernels_of(delta, base, 1))
    return h, _draft_rms_norm(h, weight32, eps)


def _conv_add_rms_norm_kernel(
    x_ptr,
    z_ptr,
    delta_ptr,
    base_ptr,
    w_ptr,
    h_ptr,
    y_ptr,
    T,
    D,
    G,
    GS,
    inv_d,
    eps,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # one program per token row m = n·T + i, the whole row (BLOCK ≥ D: the norm reduces over it); all contiguous
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < D
    out = _conv_side_row(z_ptr, delta_ptr, base_ptr, row, row % T, cols, m, D, G, GS, 1, K, BLOCK)  # post-conv
    x = tl.load(x_ptr + row * D + cols, mask=m, other=0.0)
    x = _residual_add(x, out, h_ptr, row * D + cols, m)
    _rms_norm_row(x, w_ptr, y_ptr, row * D + cols, cols, m, D, inv_d, eps, 2)  # MODE 2: norm._FP32W


def conv_add_rms_norm_fp32w(x, z, delta, base, weight32, eps: float):
    """(h, y) = (x + local_conv(z, delta, base, 1), the drafter's RMSNorm of h), one launch on CUDA.

    x (N, T, d): the residual stream so far; z (N, T, d): the sublayer's output before its post-conv, one block
    from its first position; delta (N, T, 2·K·G) the conv's kernel projection of the sublayer's normed input;
    base (2, K, G, gs) ``ConvWeights.base``; weight32 (d,) fp32. Returns (h, y) (N, T, d) in x's dtype, the
    values of ``add_rms_norm_fp32w(x, local_conv(z, delta, base, 1), weight32, eps)``. The Triton kernel on
    CUDA (and under the interpreter in ``on_cpu()``), else the twin; shapes the kernel does not take run that
    unfused pair."""
    if not use_triton(x):
        return conv_add_rms_norm_fp32w_ref(x, z, delta, base, weight32, eps)
    fits = x.dim() == 3 and base.dim() == 4 and base.shape[0] == 2
    if fits:
        N, T, D = x.shape
        K, G, GS = base.shape[1:]
        fits = (
            G * GS == D
            and z.shape == x.shape
            and z.dtype == x.dtype
            and tuple(delta.shape) == (N, T, 2 * K * G)
            and delta.dtype == x.dtype
            and weight32.dtype == torch.float32
            and tuple(weight32.shape) == (D,)
        )
    if not fits:
        return add_rms_norm_fp32w(x, local_conv(z, delta, base, 1), weight32, eps)
    x, z, delta, base = x.contiguous(), z.contiguous(), delta.contiguous(), base.contiguous()
    h, y = torch.empty_like(x), torch.empty_like(x)
    block = max(triton_next_pow2(D), 16)  # add_rms_norm_fp32w's row block and warps: its reduction order
    jit(_conv_add_rms_norm_kernel)[(N * T,)](
        x,
        z,
        delta,
        base,
        weight32,
        h,
        y,
        T,
        D,
        G,
        GS,
        1.0 / D,
        eps,
        K=K,
        BLOCK=block,
        num_warps=_warps(block),
        enable_fp_fusion=False,  # the conv's round(out + round(x·W)) unfused, and the norm as its own launch's
    )
    return h, y
