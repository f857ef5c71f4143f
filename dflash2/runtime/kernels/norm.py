"""Residual add + RMSNorm in one pass (twin: the eager HF arithmetic).

    h = x + residual            (rounded to x's dtype, as the eager add)      [only with residual]
    y = w · round(h / rms(h))   offset=False (Qwen3, Llama: HF's weight * hidden.to(dtype))
    y = round(h / rms(h) · (1 + w))   offset=True (Qwen3.5: zero-centred weight, one rounding)

rms is computed in fp32. Shapes: x, residual (..., D); weight (D,); returns (h, y), both
(..., D) in x's dtype (h is x itself when there is no residual).
"""

import torch
import triton.language as tl

from dflash2.runtime.kernels import jit, use_triton


def add_rms_norm_ref(x, residual, weight, eps: float, offset: bool):
    """The eager twin (exactly the ops of ``layers.RMSNorm`` after an eager residual add)."""
    h = x if residual is None else x + residual
    h32 = h.float()
    y = h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return h, (y * (1.0 + weight.float())).to(h.dtype)
    return h, weight * y.to(h.dtype)


def _add_rms_norm_kernel(
    x_ptr,
    r_ptr,
    w_ptr,
    h_ptr,
    y_ptr,
    D,
    eps,
    HAS_RES: tl.constexpr,
    OFFSET: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # one program per row; rows are contiguous (the launcher reshapes to (M, D))
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < D
    x = tl.load(x_ptr + row * D + cols, mask=m, other=0.0)
    if HAS_RES:
        r = tl.load(r_ptr + row * D + cols, mask=m, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(h_ptr.dtype.element_ty)  # the eager add's rounding
        tl.store(h_ptr + row * D + cols, x, mask=m)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / D + eps)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    if OFFSET:  # noqa: SIM108 (a constexpr branch: only one side is compiled)
        y = xf * rstd * (1.0 + w)
    else:
        y = w * (xf * rstd).to(y_ptr.dtype.element_ty).to(tl.float32)  # round, then the weight's product
    tl.store(y_ptr + row * D + cols, y.to(y_ptr.dtype.element_ty), mask=m)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, offset: bool):
    """(h, y) = (x + residual, RMSNorm(x + residual)); the Triton kernel on CUDA, else the twin."""
    if not use_triton(x) or weight.dtype != x.dtype:
        return add_rms_norm_ref(x, residual, weight, eps, offset)
    D = x.shape[-1]
    x2 = x.reshape(-1, D).contiguous()
    M = x2.shape[0]
    y = torch.empty_like(x2)
    if residual is None:
        h, r2 = x2, x2
    else:
        r2 = residual.reshape(-1, D).contiguous()
        h = torch.empty_like(x2)
    block = max(triton_next_pow2(D), 16)
    jit(_add_rms_norm_kernel)[(M,)](
        x2, r2, weight, h, y, D, eps, HAS_RES=residual is not None, OFFSET=offset, BLOCK=block, num_warps=_warps(block)
    )
    return (x if residual is None else h.view(x.shape)), y.view(x.shape)


def triton_next_pow2(n: int) -> int:
    return 1 << (max(int(n), 1) - 1).bit_length()


def _warps(block: int) -> int:
    """Warps for a one-row program of ``block`` elements: ~8 elements per thread, 1..16 warps."""
    return max(1, min(16, block // 256))
