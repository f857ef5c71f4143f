"""The drafter's RMSNorm in training as two Triton kernels, forward and backward (opt-in: ``drafter.norm_kernels``;
docs/TRAINING.md). The twin is ``rms_norm.rms_norm_reference`` (the module's arithmetic as tensor ops).

What, for rows x (R, d) of any float dtype, weight w (d,), everything in fp32:

    forward    r_i = 1 / sqrt(mean_c x_ic² + eps)        y_ic = x_ic · r_i        out_ic = round(y_ic · w_c)
    backward   a_ic = g_ic · w_c                          s_i = Σ_c a_ic · x_ic
               grad_x_ic = a_ic · r_i − x_ic · r_i³ · s_i / d                      (rounded to x's dtype)
               grad_w_c  = Σ_i g_ic · x_ic · r_i                                    (rounded to w's dtype)

Why: ``rms_norm.rms_norm`` already computes the module's values and gradients bit for bit in fewer torch ops,
but each op is still a pass over a (rows, d) tensor: at the Qwen3-8B recipe (5 layers, hidden 4096, 16,384
block positions, plus the per-head q/k norms) the norms' backward was ~39 ms of multiplies, sums and adds in a
408 ms step and their forward ~13 ms (docs/BENCHMARKS.md, stop 19). Here the forward reads x once and writes
out and r; the backward reads g, x and r once and writes grad_x, and a small (programs, d) fp32 partial of
grad_w that torch sums: ~20 bytes per fp32 element instead of ~96.

How: a program holds a (BR rows × BD ≥ d columns) tile, whole rows, so each row's sum stays inside it. The
backward's programs each walk every P-th row tile (P ≈ a few per SM), summing grad_w over their rows in
registers, so its partial has P rows, not one per row tile.

Numerics: not bit for bit with the twin (sums in another order; r through IEEE sqrt and division where torch
uses rsqrt): fp32 to a few ulps; in bf16 the output and grad_x are rounded once (to nearest even, in integer
ops for bf16: the interpreter's cast truncates). Tests: tests/test_drafter_norm_kernels.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from dflash2.runtime.kernels import jit, use_triton
from dflash2.runtime.kernels.triton_util import rounded_for

TILE_ELEMENTS = 4096  # a program's (rows × padded d) tile
MAX_D = 16384  # one row per program at most this wide (its tile in registers)
PROGRAMS_PER_SM = 4  # the backward's programs (each sums grad_w over its rows)
_DTYPES = {torch.float32, torch.bfloat16, torch.float16}


def kernels_apply(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernels can run this call: Triton runs on x's device (CUDA, or CPU tensors under the
    interpreter in tests), fp32 / bf16 / fp16 x and weight on one device, weight (d,) with d = x's last dim
    of at most MAX_D, at least one row. Otherwise the torch code runs."""
    return (
        x.dtype in _DTYPES
        and weight.dtype in _DTYPES
        and weight.dim() == 1
        and x.dim() >= 1
        and x.shape[-1] == weight.shape[0]
        and 0 < weight.shape[0] <= MAX_D
        and x.numel() > 0
        and weight.device == x.device
        and use_triton(x)
    )


def norm_kernels_run(drafter, device) -> bool:
    """Whether ``drafter.norm_kernels`` would run the kernels for ``drafter``'s norms on ``device`` (a report's
    flag): Triton runs there (the drafter's norms always have the shapes the kernels take)."""
    probe = torch.empty(1, device=device)
    return kernels_apply(probe, probe)


# ------------------------------------------------------------------------------------------ kernels
def _rms_forward_kernel(
    x_ptr, w_ptr, out_ptr, r_ptr, R, D, eps,
    BR: tl.constexpr, BD: tl.constexpr, OUT_BF16: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BD)
    in_r, in_c = rows < R, cols < D
    m = in_r[:, None] & in_c[None, :]
    x = tl.load(x_ptr + rows[:, None] * D + cols[None, :], mask=m, other=0.0).to(tl.float32)
    r = tl.math.div_rn(1.0, tl.sqrt_rn(tl.sum(x * x, axis=1) / D + eps))  # (BR,): IEEE, as exact as fp32 goes
    w = tl.load(w_ptr + cols, mask=in_c, other=0.0).to(tl.float32)
    out = (x * r[:, None]) * w[None, :]
    tl.store(out_ptr + rows[:, None] * D + cols[None, :], rounded_for(out, out_ptr, OUT_BF16), mask=m)
    tl.store(r_ptr + rows, r, mask=in_r)


def _rms_backward_kernel(
    g_ptr, x_ptr, w_ptr, r_ptr, gx_ptr, gw_ptr, R, D, tiles,
    BR: tl.constexpr, BD: tl.constexpr, GX_BF16: tl.constexpr, NEED_GX: tl.constexpr, NEED_GW: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    cols = tl.arange(0, BD)
    in_c = cols < D
    w = tl.load(w_ptr + cols, mask=in_c, other=0.0).to(tl.float32)
    gw = tl.zeros([BR, BD], dtype=tl.float32)
    for tile in range(pid, tiles, tl.num_programs(0)):
        rows = tl.arange(0, BR).to(tl.int64) + tile * BR  # int64 offsets; tile · BR ≤ R fits int32
        in_r = rows < R
        m = in_r[:, None] & in_c[None, :]
        offs = rows[:, None] * D + cols[None, :]
        g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
        r = tl.load(r_ptr + rows, mask=in_r, other=0.0)
        if NEED_GX:
            a = g * w[None, :]
            s = tl.sum(a * x, axis=1)  # (BR,)
            gx = a * r[:, None] - x * (r * r * r * s / D)[:, None]
            tl.store(gx_ptr + offs, rounded_for(gx, gx_ptr, GX_BF16), mask=m)
        if NEED_GW:
            gw += g * (x * r[:, None])  # masked rows and columns hold zeros
    if NEED_GW:
        tl.store(gw_ptr + pid.to(tl.int64) * D + cols, tl.sum(gw, axis=0), mask=in_c)


def _tiles(D: int) -> tuple[int, int, int]:
    """(BR, BD, warps) for rows of d = D: tiles of max(TILE_ELEMENTS, BD) elements, 8 warps (16 from BD = 8192
    on), so that a thread holds ≤ 16-32 fp32 values of each (rows × BD) tensor of the backward."""
    BD = triton.next_power_of_2(D)
    BR = max(1, TILE_ELEMENTS // BD)
    return BR, BD, 16 if BD >= 8192 else 8


def _backward_programs(tiles: int, device: torch.device) -> int:
    if device.type == "cuda":
        per = torch.cuda.get_device_properties(device).multi_processor_count * PROGRAMS_PER_SM
    else:  # the interpreter (tests): a few programs, so that each walks several tiles
        per = 4
    return max(1, min(tiles, per))


class _RMSNormKernels(torch.autograd.Function):
    """Inputs x (..., d), weight (d,), eps. Output (..., d) in x's dtype."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        D = x.shape[-1]
        xc, weight = x.contiguous(), weight.contiguous()  # the kernels index both with unit strides
        R = xc.numel() // D
        out = torch.empty_like(xc)
        r = torch.empty(R, dtype=torch.float32, device=x.device)
        BR, BD, warps = _tiles(D)
        jit(_rms_forward_kernel)[(triton.cdiv(R, BR),)](
            xc, weight, out, r, R, D, float(eps), BR=BR, BD=BD, OUT_BF16=out.dtype == torch.bfloat16, num_warps=warps
        )
        ctx.save_for_backward(xc, weight, r)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        xc, weight, r = ctx.saved_tensors
        D = xc.shape[-1]
        R = xc.numel() // D
        BR, BD, warps = _tiles(D)
        tiles = triton.cdiv(R, BR)
        P = _backward_programs(tiles, xc.device)
        need_gx, need_gw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        gx = torch.empty_like(xc) if need_gx else xc  # (never written without NEED_GX)
        partial = torch.empty(P if need_gw else 1, D, dtype=torch.float32, device=xc.device)
        jit(_rms_backward_kernel)[(P,)](
            grad.contiguous(), xc, weight, r, gx, partial, R, D, tiles,
            BR=BR, BD=BD, GX_BF16=gx.dtype == torch.bfloat16, NEED_GX=need_gx, NEED_GW=need_gw, num_warps=warps,
        )  # fmt: skip
        grad_w = partial.sum(0).to(weight.dtype) if need_gw else None
        return (gx if need_gx else None), grad_w, None


def rms_norm_kernels(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``rms_norm_reference(x, weight, eps)`` through the kernels (call only where :func:`kernels_apply` is true)."""
    return _RMSNormKernels.apply(x, weight, float(eps))
