"""Residual add + RMSNorm in one pass (twin: the eager HF arithmetic).

    h = x + residual            (rounded to x's dtype, as the eager add)      [only with residual]
    y = w · round(h / rms(h))   offset=False (Qwen3, Llama: HF's weight * hidden.to(dtype))
    y = round(h / rms(h) · (1 + w))   offset=True (Qwen3.5: zero-centred weight, one rounding)
    y = round((h / rms(h)) · w32)     add_rms_norm_fp32w (the drafter's RMSNorm: fp32 weight, one rounding)

rms is computed in fp32. Shapes: x, residual (..., D); weight (D,); returns (h, y), both
(..., D) in x's dtype (h is x itself when there is no residual). x, residual and h may be strided views
(unit last stride, any row stride: e.g. a layer's (N, T, d) slice of the target's (N, T, K·d) taps buffer,
rows K·d apart): the kernel reads and writes them in place, no contiguous copy. ``add_rms_norm``'s
``h_out`` (the target's taps, base.py): h is written there, so a tapped layer's output needs no add of its own.

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


def _check_h_out(x: torch.Tensor, residual: torch.Tensor | None, h_out: torch.Tensor | None) -> None:
    """h_out (x's shape, dtype and device, unit last stride) receives h = x + residual: a residual is needed."""
    if h_out is None:
        return
    if residual is None:
        raise ValueError("add_rms_norm: h_out is given without a residual (h would be x itself, nothing to write)")
    if h_out.shape != x.shape:
        raise ValueError(f"add_rms_norm: h_out has shape {tuple(h_out.shape)}, x {tuple(x.shape)}: they must match")
    if h_out.dtype != x.dtype or h_out.device != x.device:
        raise ValueError(
            f"add_rms_norm: h_out is {h_out.dtype} on {h_out.device}, x {x.dtype} on {x.device}: they must match"
        )
    if x.shape[-1] > 1 and h_out.stride(-1) != 1:
        raise ValueError(f"add_rms_norm: h_out's last stride is {h_out.stride(-1)}: it must be 1 (rows of D elements)")


def add_rms_norm_ref(x, residual, weight, eps: float, offset: bool, *, h_out=None):
    """The eager twin (exactly the ops of ``layers.RMSNorm`` after an eager residual add); h_out as in
    :func:`add_rms_norm` (the add is ``torch.add(x, residual, out=h_out)``: the same op, rounded the same)."""
    _check_h_out(x, residual, h_out)
    if h_out is not None:
        h = torch.add(x, residual, out=h_out)
    elif residual is None:
        h = x
    else:
        h = x + residual
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
    stride_x,
    stride_r,
    stride_h,
    inv_d,
    eps,
    HAS_RES: tl.constexpr,
    MODE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # one program per row of the launcher's (M, D) views; x, r and h rows stride_* elements apart (unit column
    # stride: a taps slice is rows K·d apart), y contiguous (rows D apart)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < D
    x = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0)
    if HAS_RES:
        r = tl.load(r_ptr + row * stride_r + cols, mask=m, other=0.0)
        x = _residual_add(x, r, h_ptr, row * stride_h + cols, m)
    _rms_norm_row(x, w_ptr, y_ptr, row * D + cols, cols, m, D, inv_d, eps, MODE)


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    offset: bool,
    *,
    h_out: torch.Tensor | None = None,
):
    """(h, y) = (x + residual, RMSNorm(x + residual)); the Triton kernel on CUDA, else the twin.

    x, residual (..., D), any strides with a unit last one (read in place); weight (D,). h_out: optional
    (..., D) tensor of x's shape and dtype with a unit last stride (e.g. a layer's (N, T, d) slice of the
    target's (N, T, K·d) taps, rows K·d apart) that receives h, which is then h_out itself; needs a residual.
    Why: the target's tapped layer outputs are written by the norm that adds them anyway (models/base.py),
    not by an add launch of their own. Raises ValueError on an h_out that does not fit."""
    _check_h_out(x, residual, h_out)
    if not use_triton(x) or weight.dtype != x.dtype:
        return add_rms_norm_ref(x, residual, weight, eps, offset, h_out=h_out)
    return _launch(x, residual, weight, eps, _OFFSET if offset else _HF, h_out)


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


def _rows(t: torch.Tensor) -> torch.Tensor | None:
    """t (..., D) as (M, D) rows one stride apart with unit column stride, without a copy; None where its
    strides do not allow that (e.g. a slice of a slice: rows of a row block not evenly spaced)."""
    D = t.shape[-1]
    if D > 1 and t.stride(-1) != 1:
        return None
    try:
        rows = t.view(-1, D)
    except RuntimeError:
        return None
    return rows if D == 1 or rows.stride(-1) == 1 else None


def _launch(x, residual, weight, eps: float, mode: int, h_out=None):
    D = x.shape[-1]
    x2 = _rows(x)
    if x2 is None:
        x2 = x.reshape(-1, D).contiguous()
    M = x2.shape[0]
    y = torch.empty(M, D, dtype=x.dtype, device=x.device)
    h_copy = None  # an h_out that is not (M, D) rows one stride apart: h goes through a temporary, then a copy
    if residual is None:
        h, r2 = x2, x2
    else:
        r2 = _rows(residual)
        if r2 is None:
            r2 = residual.reshape(-1, D).contiguous()
        h = None if h_out is None else _rows(h_out)
        if h is None:
            h = torch.empty(M, D, dtype=x.dtype, device=x.device)
            h_copy = h_out
    block = max(triton_next_pow2(D), 16)
    jit(_add_rms_norm_kernel)[(M,)](
        x2,
        r2,
        weight,
        h,
        y,
        D,
        x2.stride(0),
        r2.stride(0),
        h.stride(0),
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
    if residual is None:
        return x, y.view(x.shape)
    if h_out is None:
        return h.view(x.shape), y.view(x.shape)
    if h_copy is not None:
        h_copy.copy_(h.view(x.shape))
    return h_out, y.view(x.shape)


def triton_next_pow2(n: int) -> int:
    return 1 << (max(int(n), 1) - 1).bit_length()


def _warps(block: int) -> int:
    """Warps for a one-row program of ``block`` elements: ~8 elements per thread, 1..16 warps."""
    return max(1, min(16, block // 256))
