"""The SwiGLU activation of a fused gate|up projection (twin: the eager HF arithmetic).

    y = round(round(silu(g)) · u)      gu = [g | u] (..., 2I) -> y (..., I)

Rounded where the eager ``F.silu(gate) * up`` rounds (silu in fp32, back to the dtype,
then the product), so bf16 results match the eager ones.
"""

import torch
import torch.nn.functional as F
import triton.language as tl

from dflash2.runtime.kernels import jit, use_triton

BLOCK = 1024


def silu_mul_ref(gu: torch.Tensor) -> torch.Tensor:
    g, u = gu.chunk(2, dim=-1)
    return F.silu(g) * u


def _silu_mul_kernel(gu_ptr, y_ptr, I, BLOCK: tl.constexpr):  # noqa: E741 (I: intermediate size)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < I
    g = tl.load(gu_ptr + row * 2 * I + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * 2 * I + I + cols, mask=m, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(y_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_ptr + row * I + cols, (s * u).to(y_ptr.dtype.element_ty), mask=m)


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """gu (..., 2I) = [gate | up] -> silu(gate) · up (..., I); the Triton kernel on CUDA, else the twin."""
    if not use_triton(gu):
        return silu_mul_ref(gu)
    I2 = gu.shape[-1]
    I = I2 // 2  # noqa: E741 (the intermediate size)
    x = gu.reshape(-1, I2).contiguous()
    y = torch.empty(x.shape[0], I, dtype=gu.dtype, device=gu.device)
    jit(_silu_mul_kernel)[(x.shape[0], -(-I // BLOCK))](x, y, I, BLOCK=BLOCK, num_warps=4)
    return y.view(*gu.shape[:-1], I)
