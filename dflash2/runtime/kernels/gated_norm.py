"""The Gated DeltaNet output norm in one pass (twin: the eager HF arithmetic, Qwen3.5 / Qwen3-Next RMSNormGated).

    y = round(round(w · round(x / rms(x))) · silu(z))

rms and silu(z) are computed in fp32; the three roundings to x's dtype are where the eager code
rounds: the normalised x back to the dtype, the weight's product in the dtype (the weight has x's
dtype), then the product with the fp32 silu(z) once at the end. For fp32 they are no-ops.

Shapes: x, z (..., G, D) (the GDN layer's o and gate: (N, T, H, d_v)); weight (D,); returns y
(..., G, D) contiguous, in x's dtype. One program per (row, head): the leading dims are flattened
into rows, each tensor keeps its own row and head strides (z is a column slice of the fused input
projection, not contiguous), so nothing is copied first.

The kernel's sum of squares runs in Triton's reduction order (scaled by the fp32 1/D as torch.mean
on CUDA), the twin's in the library's: rms may differ in its last fp32 bit. silu uses Triton's exp
where the twin uses the library's expf (on the GPU both fp32, within a few ulps). So fp32 outputs agree
to a few ulps and bf16 ones exactly but where a last-bit difference flips one of the roundings: one
unit in the last place.
"""

import torch
import torch.nn.functional as F
import triton.language as tl

from dflash2.runtime.kernels import jit, use_triton
from dflash2.runtime.kernels.norm import _warps, triton_next_pow2


def gated_rms_norm_ref(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The eager twin (exactly the ops of HF's RMSNormGated): fp32 norm, round, · w, · silu(fp32 z), round."""
    x32 = x.float()
    y = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (y * F.silu(z.float())).to(x.dtype)


def _gated_rms_norm_kernel(
    x_ptr,
    z_ptr,
    w_ptr,
    y_ptr,
    G,
    D,
    sx_r,
    sx_g,
    sz_r,
    sz_g,
    inv_d,
    eps,
    BLOCK: tl.constexpr,
):
    # program (row, head); x, z: rows of G heads of D contiguous elements; y contiguous (R, G, D)
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < D
    dt = y_ptr.dtype.element_ty
    xf = tl.load(x_ptr + row * sx_r + head * sx_g + cols, mask=m, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) * inv_d + eps)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    n = (xf * rstd).to(dt).to(tl.float32)  # x / rms(x), rounded back to the dtype
    y = (w * n).to(dt).to(tl.float32)  # the weight's product in the dtype
    g = tl.load(z_ptr + row * sz_r + head * sz_g + cols, mask=m, other=0.0).to(tl.float32)
    s = g / (1.0 + tl.exp(-g))  # silu in fp32
    tl.store(y_ptr + (row * G + head) * D + cols, (y * s).to(dt), mask=m)


def _rows(t: torch.Tensor, G: int, D: int) -> torch.Tensor:
    """t (..., G, D) as (R, G, D), a view where the strides allow; the last dim contiguous."""
    t3 = t.reshape(-1, G, D)
    return t3 if t3.stride(-1) == 1 else t3.contiguous()


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(x) · w · silu(z) over the last dim: x, z (..., G, D), weight (D,) -> (..., G, D) in x's dtype.

    The Triton kernel on CUDA (and under the interpreter in ``on_cpu()``), else the twin, which is the
    eager code: the CPU stays bit for bit. Mixed dtypes (a weight or gate not in x's dtype) and x with
    fewer than two dims take the twin."""
    if (
        not use_triton(x)
        or weight.dtype != x.dtype
        or z.dtype != x.dtype
        or z.shape != x.shape
        or x.dim() < 2
        or weight.dim() != 1
    ):
        return gated_rms_norm_ref(x, z, weight, eps)
    G, D = x.shape[-2], x.shape[-1]
    x3, z3 = _rows(x, G, D), _rows(z, G, D)
    R = x3.shape[0]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y
    block = max(triton_next_pow2(D), 16)
    jit(_gated_rms_norm_kernel)[(R, G)](
        x3,
        z3,
        weight,
        y,
        G,
        D,
        x3.stride(0),
        x3.stride(1),
        z3.stride(0),
        z3.stride(1),
        1.0 / D,
        eps,
        BLOCK=block,
        num_warps=_warps(block),
    )
    return y
