"""Gated attention's output, y · sigmoid(gate), in the layout o_proj reads (twin: the eager ops).

Qwen3.5 / Qwen3-Next attention multiplies each head's output by the sigmoid of a per-head gate that
q_proj emits beside q. Eagerly that is four launches per attention layer: the attention output
(N, H, T, D) transposed into (N, T, H·D) (a copy once T > 1), the gate — a strided slice of the
fused q|gate|k|v projection — copied to be reshaped, its sigmoid, the product. Here it is one:

    out[n, t, h·D + d] = round(y[n, h, t, d] · round(sigmoid(gate[n, t, h, d])))

rounded where the eager ``y * torch.sigmoid(gate)`` rounds (the sigmoid in fp32, back to the dtype,
then the product). No reduction, but Triton's exp and division are not torch's: in fp32 the two
differ by a few ulps, and in bf16 only where a sigmoid straddles a rounding boundary (one ulp).
Shapes: y (N, H, T, D), gate (N, T, H, D), any strides → (N, T, H·D) contiguous, y's dtype.
"""

from __future__ import annotations

import torch
import triton.language as tl

from dflash2.runtime.kernels import jit, use_triton

BLOCK = 256  # (head, dim) lanes per program: a Qwen3.5-9B row (16 heads × 256) is 16 programs per token


def output_gate_ref(y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The eager twin: y (N, H, T, D) · sigmoid(gate (N, T, H, D)) -> (N, T, H·D)."""
    N, H, T, D = y.shape
    return y.transpose(1, 2).reshape(N, T, H * D) * torch.sigmoid(gate.reshape(N, T, H * D))


def _output_gate_kernel(
    y_ptr,
    g_ptr,
    out_ptr,
    T,
    H,
    D,
    y_sn,
    y_sh,
    y_st,
    y_sd,
    g_sn,
    g_st,
    g_sh,
    g_sd,
    BLOCK_C: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)  # n·T + t
    n, t = tok // T, tok % T
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    m = c < H * D
    h, d = c // D, c % D
    y = tl.load(y_ptr + n * y_sn + h * y_sh + t * y_st + d * y_sd, mask=m, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + n * g_sn + t * g_st + h * g_sh + d * g_sd, mask=m, other=0.0).to(tl.float32)
    s = (1.0 / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + tok * H * D + c, (y * s).to(out_ptr.dtype.element_ty), mask=m)


def output_gate(y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """(N, T, H·D) = y (N, H, T, D) · sigmoid(gate (N, T, H, D)); the Triton kernel on CUDA (and in
    ``on_cpu()``), else the twin."""
    N, H, T, D = y.shape
    if gate.shape != (N, T, H, D) or gate.dtype != y.dtype:
        raise ValueError(
            f"gate must be (N, T, H, D) = {(N, T, H, D)} in {y.dtype}; got {tuple(gate.shape)} {gate.dtype}"
        )
    if not use_triton(y):
        return output_gate_ref(y, gate)
    out = torch.empty(N, T, H * D, dtype=y.dtype, device=y.device)
    if out.numel() == 0:
        return out
    jit(_output_gate_kernel)[(N * T, -(-(H * D) // BLOCK))](
        y, gate, out, T, H, D, *y.stride(), *gate.stride(), BLOCK_C=BLOCK, num_warps=2
    )
    return out
