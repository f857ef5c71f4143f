"""One side of the DFlash2 block-local conv of one block in one launch (twin: the runtime drafter's eager ops).

The eager side (``draft_math.conv_kernels_of`` + ``draft_math.conv_apply``) is an add for the per-position
kernels, a zero pad of the input, one product over a strided window of it and K-1 adds: four launches
per side for K = 2, eight per conv'd sublayer. Here the kernel add, the shifted reads (the pad), the
per-tap products and their sum are one program per (token, channel tile). For token i of a block
(T ≤ B tokens from the block's first position), channel c of group g = c // gs, taps t = 0 .. K-1:

    W_t   = round(round(base[s, K-1-t, c]) + δ[i, s, K-1-t, g])    (conv_kernels_of: base cast to x's dtype)
    term_t = round(x[i-t, c] · W_t),  x[j < 0] = 0                (conv_apply's product over the padded window)
    out   = round(…round(term_0 + term_1) … + term_{K-1})         (conv_apply's sum, tap 0 first)

round() is to x's dtype; every operation is the eager one on the same operands in the same order
(the padding's zero is multiplied too, so signed zeros and their sums come out as there), and the
kernel is compiled without FMA contraction (``enable_fp_fusion=False``: round(out + x·W) must not
become one fused rounding in fp32). No reduction: the kernel is exact against its twin wherever the
fp32 -> x dtype cast rounds to nearest (compiled Triton; Triton's interpreter truncates bf16 casts).

The runtime drafter launches this for the pre side only: a post side's output is read only by the next
norm, whose launch computes it (kernels/conv_norm.py, with the same per-row code, ``_conv_side_row``).

Shapes: N rows, T block tokens, d = G·gs channels in G groups of gs, K taps; x (N, T, d); delta
(N, T, 2·K·G), the kernel projection's output in ``ConvWeights``' layout (side, K-1-t, g); base
(2, K, G, gs) ``ConvWeights.base`` (taps reversed). Returns (N, T, d) in x's dtype.
"""

import torch
import triton
import triton.language as tl

from dflash2.runtime.draft_math import conv_apply, conv_kernels_of
from dflash2.runtime.kernels import jit, use_triton
from dflash2.runtime.kernels.norm import triton_next_pow2

_MAX_BLOCK = 1024  # channels per program: wider rows take several programs


def local_conv_ref(x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, side: int) -> torch.Tensor:
    """The eager twin: the side's kernels (one add), then the padded window's product and the sum of its taps."""
    return conv_apply(x, conv_kernels_of(delta, base, side))


@triton.jit
def _conv_side_row(
    x_ptr, delta_ptr, base_ptr, m, i, c, cm, D, G, GS, SIDE: tl.constexpr, K: tl.constexpr, BLOCK: tl.constexpr
):
    """Side SIDE at token m (n·T + i, position i of its block), channels c (BLOCK,) masked by cm: the output's
    fp32 values, each already rounded to x's dtype in the eager ops' order (module docstring); 0 where ~cm.

    Shared by ``_local_conv_kernel`` and the post-conv + add + norm kernel (kernels/conv_norm.py), so that the
    fused post-conv is the same code as the unfused one."""
    dt = x_ptr.dtype.element_ty
    out = tl.zeros([BLOCK], dtype=tl.float32)
    for t in tl.static_range(K):
        j = K - 1 - t  # the tap's index in the reversed layout
        b = tl.load(base_ptr + (SIDE * K + j) * D + c, mask=cm, other=0.0).to(dt).to(tl.float32)
        dl = tl.load(delta_ptr + m * (2 * K * G) + (SIDE * K + j) * G + c // GS, mask=cm, other=0.0)
        w = (b + dl.to(tl.float32)).to(dt).to(tl.float32)  # the kernel add, rounded as the eager add
        inside = cm & (tl.zeros([BLOCK], dtype=tl.int64) + i >= t)  # x[i - t] is in the block, else the padding's 0
        xs = tl.load(x_ptr + (m - t) * D + c, mask=inside, other=0.0).to(tl.float32)
        term = (xs * w).to(dt).to(tl.float32)
        if t == 0:  # noqa: SIM108 (constexpr): tap 0 starts the sum
            out = term
        else:
            out = (out + term).to(dt).to(tl.float32)
    return out


def _local_conv_kernel(
    x_ptr,
    delta_ptr,
    base_ptr,
    out_ptr,
    T,
    D,
    G,
    GS,
    SIDE: tl.constexpr,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # program (token m = n·T + i, channel tile); x, delta, out contiguous, out in x's dtype; base (2, K, G·gs)
    m = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cm = c < D
    out = _conv_side_row(x_ptr, delta_ptr, base_ptr, m, m % T, c, cm, D, G, GS, SIDE, K, BLOCK)
    tl.store(out_ptr + m * D + c, out.to(out_ptr.dtype.element_ty), mask=cm)


def local_conv(x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, side: int) -> torch.Tensor:
    """Side ``side`` (0 pre, 1 post) of the block-local conv on x (N, T, d), one block from its first position.

    delta (N, T, 2·K·G) = F.linear(normed input, ConvWeights.projection), in x's dtype; base (2, K, G, gs)
    ``ConvWeights.base`` (any float dtype: cast to x's as the twin casts it). Returns (N, T, d) in x's
    dtype. The Triton kernel on CUDA (and under the interpreter in ``on_cpu()``), else the twin."""
    N, T, D = x.shape
    K, G, GS = base.shape[1:]
    fits = (
        G * GS == D
        and base.shape[0] == 2
        and tuple(delta.shape) == (N, T, 2 * K * G)
        and delta.dtype == x.dtype
        and side in (0, 1)
    )
    if not use_triton(x) or not fits:
        return local_conv_ref(x, delta, base, side)
    x, delta, base = x.contiguous(), delta.contiguous(), base.contiguous()
    out = torch.empty_like(x)
    block = min(max(triton_next_pow2(D), 16), _MAX_BLOCK)
    jit(_local_conv_kernel)[(N * T, -(-D // block))](
        x,
        delta,
        base,
        out,
        T,
        D,
        G,
        GS,
        SIDE=side,
        K=K,
        BLOCK=block,
        num_warps=max(1, min(8, block // 256)),
        enable_fp_fusion=False,  # round(out + round(x·W)) as the eager ops round it, no fused multiply-add
    )
    return out
