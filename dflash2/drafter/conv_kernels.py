"""One side of the block-local conv (``local_conv.BlockLocalConv``) in training as two Triton kernels, forward
and backward, each with its plain-PyTorch twin (opt-in: ``drafter.conv_kernels``; docs/TRAINING.md).

What, for one side s, K taps, groups of gs channels, positions i of a sequence of T (blocks of B: p(i) = i mod B):

    forward   out[i, c]            = Σ_t w_t[i, c] · x[i − t, c] · [p(i) ≥ t]
              w_t[i, c]            = base[s, t, c] + δ[i, s, t, c // gs]
    backward  grad_x[j, c]         = Σ_t g[j + t, c] · w_t[j + t, c] · [p(j) + t < B, j + t < T]
              grad_δ[i, s, t, grp] = Σ_{c in grp} g[i, c] · x[i − t, c] · [p(i) ≥ t]      (the other side's: 0)
              grad_base[s, t, c]   = Σ_i g[i, c] · x[i − t, c] · [p(i) ≥ t]             (the other side's: 0)

Why: the module's torch code spends, per tap, a select of δ, a repeat_interleave to the channels, the kernel
add, a padded shift of x, the mask product, the product and the sum, each a pass over an (N, S, hidden)
tensor, and autograd about twice as many backward, with the repeat_interleave's backward a group sum that
torch runs as a slow strided reduction. At the Qwen3-8B recipe (S = 8192 block positions per row, hidden
4096, K = 2, 4 conv sides per layer, 5 layers) those were the elementwise and bf16 reduce kernels standing
beside the GEMMs in a training step's profile (docs/BENCHMARKS.md, stop 18). Here the forward reads x and δ
once and writes out once; the backward reads g, x and δ once and writes grad_x and grad_δ once, plus a small
fp32 (row programs, K, hidden) partial of grad_base summed by torch.

How: one program per (tile of BR positions, tile of BC channels), BC a multiple of gs so that a tile holds
whole groups (grad_δ's group sum stays inside the program, no atomics). The shifted reads x[i − t] and
g[j + t] are masked loads at shifted addresses (the tile's own rows, mostly from L1/L2). Arithmetic in fp32,
one rounding to the output's dtype at the store (to nearest; bf16 in integer ops, as the interpreter's own
cast truncates).

Numerics: the twin (``conv_side_ref``) is the module's own torch code, whose products and sums round to the
operands' dtype at every op; in fp32 the kernels match it to a few fp32 ulps (products summed in another
order), in bf16 they are closer to the exact values than it (one rounding, not one per op); grad_base is
summed in another order (per program, then over programs). Tests: tests/test_drafter_conv_kernels.py.

Shapes: x (..., T, d) with d = G · gs; δ (..., T, 2, K, G) (``BlockLocalConv.deltas``); base (2, K, d); T a
multiple of B, or a single block (T ≤ B). Output (..., T, d) in the dtype torch's promotion gives x, δ and
base cast to x's dtype (as the module's ``base.to(x.dtype) + δ``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from dflash2.runtime.kernels import jit, use_triton
from dflash2.runtime.kernels.triton_util import rounded_for

# The tile: 8 positions × 64 channels, 4 warps, the fastest forward + backward of a sweep over positions
# {8, 16, 32, 64} × channels {64, 128, 256} × warps {4, 8} on the H200 at the Qwen3-8B recipe's sides (16,384
# positions × 4096, group 16): fp32 x 1848 -> 1215 µs against the previous 32 × 128, bf16 1640 -> 1072 µs
# (docs/BENCHMARKS.md, stop 19)
BLOCK_ROWS = 8  # positions per program
BLOCK_CHANNELS = 64  # channels per program, or the group size when wider
MAX_BLOCK_CHANNELS = 128  # the widest group a tile may hold
WARPS = 4  # per program


# -------------------------------------------------------------------------------------------- twins
def conv_side_ref(x, delta, base, side: int, block_size: int, group_size: int) -> torch.Tensor:
    """The twin: ``BlockLocalConv.forward``'s torch code (its autograd gives the backward's twin)."""
    from dflash2.drafter.local_conv import block_conv_side_torch

    return block_conv_side_torch(x, delta, base, side, block_size, group_size)


def kernels_apply(x: torch.Tensor, delta: torch.Tensor, group_size: int) -> bool:
    """Whether the kernels can run this call: tensors where Triton runs (CUDA, or CPU ones under the
    interpreter in tests), fp32 / bf16 / fp16, δ of shape (*x.shape[:-1], 2, K, d / gs) (no broadcast
    rows), a power-of-two group size of at most MAX_BLOCK_CHANNELS channels. Otherwise the torch code runs."""
    gs = int(group_size)
    shapes = (
        delta.dim() == x.dim() + 2
        and delta.shape[:-3] == x.shape[:-1]  # one δ row per position (no broadcast: the kernels index it flat)
        and delta.shape[-3] == 2
        and delta.shape[-1] * gs == x.shape[-1]
    )
    dtypes = {x.dtype, delta.dtype} <= {torch.float32, torch.bfloat16, torch.float16}  # fp64 stays torch's
    return shapes and dtypes and delta.device == x.device and _runs_where(x, gs)


def _runs_where(x: torch.Tensor, group_size: int) -> bool:
    """The conditions that do not depend on the call's shapes: Triton runs on x's device, and the group size
    tiles (a power of two of at most MAX_BLOCK_CHANNELS channels)."""
    gs = int(group_size)
    return use_triton(x) and gs & (gs - 1) == 0 and gs <= MAX_BLOCK_CHANNELS


def conv_kernels_run(drafter, device) -> bool:
    """Whether ``drafter.conv_kernels`` would run the kernels for ``drafter`` on ``device`` (a report's flag):
    it has the conv, the kernels run there and its group size tiles (the drafter's own tensors always have
    the shapes the kernels take)."""
    from dflash2.drafter.local_conv import BlockLocalConv

    convs = [m for m in drafter.modules() if isinstance(m, BlockLocalConv)]
    probe = torch.empty(0, device=device)
    return bool(convs) and all(_runs_where(probe, m.group_size) for m in convs)


# ------------------------------------------------------------------------------------------ kernels
def _conv_forward_kernel(
    x_ptr, d_ptr, base_ptr, out_ptr, R, T, C, DS, side_off, base_off,
    B: tl.constexpr, K: tl.constexpr, G: tl.constexpr, GS: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
    OUT_BF16: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)  # (BR,) flat positions
    c = tl.program_id(1) * BC + tl.arange(0, BC)  # (BC,) channels
    in_r, in_c = r < R, c < C
    p = (r % T) % B  # position inside its block
    acc = tl.zeros([BR, BC], dtype=tl.float32)
    for t in tl.static_range(K):
        live = in_r & (p >= t)
        xs = tl.load(x_ptr + (r - t)[:, None] * C + c[None, :], mask=live[:, None] & in_c[None, :], other=0.0)
        b_t = tl.load(base_ptr + base_off + t * C + c, mask=in_c, other=0.0).to(tl.float32)
        d_t = tl.load(
            d_ptr + r[:, None] * DS + side_off + t * G + (c // GS)[None, :],
            mask=in_r[:, None] & in_c[None, :],
            other=0.0,
        ).to(tl.float32)
        acc += (b_t[None, :] + d_t) * xs.to(tl.float32)
    tl.store(
        out_ptr + r[:, None] * C + c[None, :], rounded_for(acc, out_ptr, OUT_BF16), mask=in_r[:, None] & in_c[None, :]
    )


def _conv_backward_kernel(
    g_ptr, x_ptr, d_ptr, base_ptr, gx_ptr, gd_ptr, gb_ptr, R, T, C, DS, side_off, base_off,
    B: tl.constexpr, K: tl.constexpr, G: tl.constexpr, GS: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
    GX_BF16: tl.constexpr, GD_BF16: tl.constexpr,
):  # fmt: skip
    pid_r = tl.program_id(0)
    r = pid_r.to(tl.int64) * BR + tl.arange(0, BR)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    in_r, in_c = r < R, c < C
    m = in_r[:, None] & in_c[None, :]
    i_t = r % T
    p = i_t % B
    g_here = tl.load(g_ptr + r[:, None] * C + c[None, :], mask=m, other=0.0).to(tl.float32)
    gx = tl.zeros([BR, BC], dtype=tl.float32)
    for t in tl.static_range(K):
        b_t = tl.load(base_ptr + base_off + t * C + c, mask=in_c, other=0.0).to(tl.float32)
        # grad_x: the output at j + t read x[j] through tap t (same block, same sequence)
        ahead = in_r & (p + t < B) & (i_t + t < T)
        m_a = ahead[:, None] & in_c[None, :]
        g_a = tl.load(g_ptr + (r + t)[:, None] * C + c[None, :], mask=m_a, other=0.0).to(tl.float32)
        d_a = tl.load(d_ptr + (r + t)[:, None] * DS + side_off + t * G + (c // GS)[None, :], mask=m_a, other=0.0)
        gx += g_a * (b_t[None, :] + d_a.to(tl.float32))
        # grad_δ and grad_base: g[i] · x[i − t] where tap t reached back
        live = in_r & (p >= t)
        xs = tl.load(x_ptr + (r - t)[:, None] * C + c[None, :], mask=live[:, None] & in_c[None, :], other=0.0)
        prod = g_here * xs.to(tl.float32)  # (BR, BC); 0 outside
        grp = tl.sum(tl.reshape(prod, [BR, BC // GS, GS]), axis=2)  # (BR, BC / GS): whole groups in the tile
        o_g = tl.program_id(1) * (BC // GS) + tl.arange(0, BC // GS)
        tl.store(
            gd_ptr + r[:, None] * DS + side_off + t * G + o_g[None, :],
            rounded_for(grp, gd_ptr, GD_BF16),
            mask=in_r[:, None] & (o_g < G)[None, :],
        )
        tl.store(gb_ptr + (pid_r.to(tl.int64) * K + t) * C + c, tl.sum(prod, axis=0), mask=in_c)
    tl.store(gx_ptr + r[:, None] * C + c[None, :], rounded_for(gx, gx_ptr, GX_BF16), mask=m)


def _tiles(C: int, group_size: int) -> int:
    return max(min(BLOCK_CHANNELS, triton.next_power_of_2(C)), int(group_size))


class _ConvSide(torch.autograd.Function):
    """Inputs x (..., T, d), δ (..., T, 2, K, G), base (2, K, d), side, B, gs. Output (..., T, d)."""

    @staticmethod
    def forward(ctx, x, delta, base, side, block_size, group_size):
        T, C = x.shape[-2], x.shape[-1]
        K, G = delta.shape[-2], delta.shape[-1]
        out_dtype = torch.promote_types(x.dtype, delta.dtype)
        xc, dc = x.contiguous(), delta.contiguous()
        base_x = base.to(x.dtype)  # the module's base.to(x.dtype): the same rounding of the static kernel
        R = xc.numel() // C
        out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
        BC = _tiles(C, group_size)
        grid = (triton.cdiv(R, BLOCK_ROWS), triton.cdiv(C, BC))
        jit(_conv_forward_kernel)[grid](
            xc, dc, base_x, out, R, T, C, 2 * K * G, side * K * G, side * K * C,
            B=block_size, K=K, G=G, GS=group_size, BR=BLOCK_ROWS, BC=BC, OUT_BF16=out_dtype == torch.bfloat16,
            num_warps=WARPS,
        )  # fmt: skip
        ctx.save_for_backward(xc, dc, base_x)
        ctx.conf = (side, block_size, group_size, base.dtype, base.shape)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        xc, dc, base_x = ctx.saved_tensors
        side, block_size, group_size, base_dtype, base_shape = ctx.conf
        T, C = xc.shape[-2], xc.shape[-1]
        K, G = dc.shape[-2], dc.shape[-1]
        R = xc.numel() // C
        gc = grad.contiguous()
        BC = _tiles(C, group_size)
        grid = (triton.cdiv(R, BLOCK_ROWS), triton.cdiv(C, BC))
        grad_x = torch.empty_like(xc)
        grad_d = torch.zeros_like(dc)  # the other side's half stays 0
        # (R / BLOCK_ROWS, K, d) fp32, summed below: 64 MB per side at the recipe's 16,384 × 4096 with 8-row tiles,
        # transient (its write and the sum were inside the sweep's timing that chose the tile)
        partial = torch.empty(grid[0], K, C, dtype=torch.float32, device=xc.device)
        jit(_conv_backward_kernel)[grid](
            gc, xc, dc, base_x, grad_x, grad_d, partial, R, T, C, 2 * K * G, side * K * G, side * K * C,
            B=block_size, K=K, G=G, GS=group_size, BR=BLOCK_ROWS, BC=BC,
            GX_BF16=grad_x.dtype == torch.bfloat16, GD_BF16=grad_d.dtype == torch.bfloat16, num_warps=WARPS,
        )  # fmt: skip
        grad_base = torch.zeros(base_shape, dtype=torch.float32, device=xc.device)
        grad_base[side] = partial.sum(0)
        return grad_x, grad_d, grad_base.to(base_dtype), None, None, None


def conv_side(x, delta, base, side: int, block_size: int, group_size: int) -> torch.Tensor:
    """One side of the conv through the kernels (call only where :func:`kernels_apply` is true)."""
    return _ConvSide.apply(x, delta, base, int(side), int(block_size), int(group_size))
