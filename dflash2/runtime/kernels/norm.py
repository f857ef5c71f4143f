"""Residual add + RMSNorm in one pass (twin: the eager HF arithmetic).

    h = x + residual            (rounded to x's dtype, as the eager add)      [only with residual]
    y = w · round(h / rms(h))   offset=False (Qwen3, Llama: HF's weight * hidden.to(dtype))
    y = round(h / rms(h) · (1 + w))   offset=True (Qwen3.5: zero-centred weight, one rounding)
    y = round((h / rms(h)) · w32)     add_rms_norm_fp32w (the drafter's RMSNorm: fp32 weight, one rounding)

rms is computed in fp32. Shapes: x, residual (..., D); weight (D,); returns (h, y), both
(..., D) in x's dtype (h is x itself when there is no residual).

The kernel's sum of squares runs in Triton's reduction order, the twin's in the library's: rms
may differ in its last fp32 bit, so y to fp32 rounding (fp32) or, where that flips a rounding,
one unit in the last place (bf16). h is exact (one fp32 add, rounded as the eager add rounds).
add_rms_norm_fp32w's launches are compiled without FMA contraction, as the fused post-conv + add + norm
(kernels/conv_norm.py, which shares this kernel's row code) must be: the drafter's norm then rounds the same
whichever of the two launches it (with contraction the sum of squares and ms + eps become FMAs).
"""

import torch
import triton
import triton.language as tl

from dflash2.runtime.draft_math import rms_norm as _draft_rms_norm
from dflash2.runtime.kernels import jit, use_triton

# the kernel's rounding modes (constexpr MODE)
_HF, _OFFSET, _FP32W = 0, 1, 2


def add_rms_norm_ref(x, residual, weight, eps: float, offset: bool):
    """The eager twin (exactly the ops of ``layers.RMSNorm`` after an eager residual add)."""
    h = x if residual is None else x + residual
    h32 = h.float()
    y = h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return h, (y * (1.0 + weight.float())).to(h.dtype)
    return h, weight * y.to(h.dtype)


@triton.jit
def _residual_add(x, r, h_ptr, offs, m):
    """h = round(x + r) to h's dtype (the eager add's one rounding), stored at offs; returns it. x, r: any float
    dtype (r may be fp32 holding values already rounded to h's dtype: the fused post-conv's output)."""
    h = (x.to(tl.float32) + r.to(tl.float32)).to(h_ptr.dtype.element_ty)
    tl.store(h_ptr + offs, h, mask=m)
    return h


@triton.jit
def _rms_norm_row(x, w_ptr, y_ptr, offs, cols, m, D, inv_d, eps, MODE: tl.constexpr):
    """y = RMSNorm(x) in rounding mode MODE of the row x (BLOCK,) (0 where ~m), stored at offs. Shared by
    ``_add_rms_norm_kernel`` and the fused post-conv + add + norm (kernels/conv_norm.py): one reduction code."""
    xf = x.to(tl.float32)
    if MODE == 2:  # noqa: SIM108 (constexpr): torch.mean on CUDA scales the sum by the fp32 1/D
        ms = tl.sum(xf * xf, axis=0) * inv_d
    else:
        ms = tl.sum(xf * xf, axis=0) / D
    rstd = tl.rsqrt(ms + eps)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    if MODE == 1:  # offset: (1 + w) in fp32, one rounding
        y = xf * rstd * (1.0 + w)
    elif MODE == 2:  # fp32 weight: (h·rstd)·w in fp32, one rounding (draft_math.rms_norm)
        y = (xf * rstd) * w
    else:  # HF: round, then the weight's product
        y = w * (xf * rstd).to(y_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=m)


def _add_rms_norm_kernel(
    x_ptr,
    r_ptr,
    w_ptr,
    h_ptr,
    y_ptr,
    D,
    inv_d,
    eps,
    HAS_RES: tl.constexpr,
    MODE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # one program per row; rows are contiguous (the launcher reshapes to (M, D))
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < D
    x = tl.load(x_ptr + row * D + cols, mask=m, other=0.0)
    if HAS_RES:
        r = tl.load(r_ptr + row * D + cols, mask=m, other=0.0)
        x = _residual_add(x, r, h_ptr, row * D + cols, m)
    _rms_norm_row(x, w_ptr, y_ptr, row * D + cols, cols, m, D, inv_d, eps, MODE)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, offset: bool):
    """(h, y) = (x + residual, RMSNorm(x + residual)); the Triton kernel on CUDA, else the twin."""
    if not use_triton(x) or weight.dtype != x.dtype:
        return add_rms_norm_ref(x, residual, weight, eps, offset)
    return _launch(x, residual, weight, eps, _OFFSET if offset else _HF)


def add_rms_norm_fp32w_ref(x, residual, weight32, eps: float):
    """The drafter's eager twin: ``h = x + residual``, then ``draft_math.rms_norm(h, weight32, eps)``."""
    h = x if residual is None else x + residual
    return h, _draft_rms_norm(h, weight32, eps)


def add_rms_norm_fp32w(x: torch.Tensor, residual: torch.Tensor | None, weight32: torch.Tensor, eps: float):
    """(h, y) = (x + residual, the drafter's RMSNorm of it): y = round((h·rstd)·w32), weight32 (D,) fp32.

    The runtime drafter's norms (``dflash2.drafter.model.RMSNorm``: fp32 statistics and product, one
    rounding to x's dtype). The Triton kernel on CUDA (and under the interpreter in ``on_cpu()``), else
    the twin — exactly the eager ops, so the CPU stays bit for bit with the drafter modules."""
    same = residual is None or (residual.dtype == x.dtype and residual.shape == x.shape)
    if not use_triton(x) or not same or weight32.dtype != torch.float32 or weight32.dim() != 1:
        return add_rms_norm_fp32w_ref(x, residual, weight32, eps)
    return _launch(x, residual, weight32, eps, _FP32W)


def _launch(x, residual, weight, eps: float, mode: int):
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
        x2,
        r2,
        weight,
        h,
        y,
        D,
        1.0 / D,
        eps,
        HAS_RES=residual is not None,
        MODE=mode,
        BLOCK=block,
        num_warps=_warps(block),
        # the drafter's norms (MODE 2) without FMA contraction, as the eager ops and as the fused post-conv
        # + norm (kernels/conv_norm.py, whose conv needs it off): the same compiled sum of squares and rstd
        # in both, so a norm's result does not depend on which of the two launched it
        **({"enable_fp_fusion": False} if mode == _FP32W else {}),
    )
    return (x if residual is None else h.view(x.shape)), y.view(x.shape)


def triton_next_pow2(n: int) -> int:
    return 1 << (max(int(n), 1) - 1).bit_length()


def _warps(block: int) -> int:
    """Warps for a one-row program of ``block`` elements: ~8 elements per thread, 1..16 warps."""
    return max(1, min(16, block // 256))
