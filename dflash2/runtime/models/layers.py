"""Layers shared by the runtime's target families: RMSNorm, RoPE, the SwiGLU MLP and softmax attention.

Each family file (qwen3.py, llama.py, qwen3_5.py) assembles its decoder from these
and owns its forward. The dtype handling copies the HF modeling code on purpose
(normalise in fp32, round back where HF rounds back) so that bf16 runs match HF's
bf16 numerics as closely as fp32 runs match its fp32 ones. The element-wise groups
(residual add + norm, q/k norm + RoPE + cache write, SwiGLU, the GDN output norm) go through
``dflash2.runtime.kernels``: fused Triton kernels on CUDA, their eager twins elsewhere;
``fuse()`` concatenates q|k|v and gate|up weights so each is one GEMV. Every projection goes
through ``gemm.linear`` (``F.linear``, or the skinny GEMM under ``set_gemm_backend("skinny")``).

Shapes: N rows, T tokens in the step, d hidden, H query heads, Hkv key/value heads,
G = H / Hkv, D head_dim, S cache positions attended (see cache.py), R rotary dims.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash2.runtime.cache import KVCache, StepMeta
from dflash2.runtime.gemm import linear
from dflash2.runtime.kernels.act import silu_mul
from dflash2.runtime.kernels.gated_norm import gated_rms_norm
from dflash2.runtime.kernels.norm import add_rms_norm
from dflash2.runtime.kernels.output_gate import output_gate
from dflash2.runtime.kernels.rope import qk_norm_rope_write, split_qkv
from dflash2.text_model import rope_theta


def fuse_linears(name: str, owner: nn.Module, *linears: nn.Linear) -> None:
    """Concatenate the weights (and biases) of linears over their output dim into one tensor.

    Registered on ``owner`` as non-persistent buffers ``{name}_weight`` / ``{name}_bias`` (the
    state dict keeps the HF names); each Linear's parameters become views of the fused tensor, so
    memory holds one copy. Why: one GEMV reading q|k|v (or gate|up) instead of two or three launches.
    Call after the model is on its final device and dtype (``.to`` afterwards copies, still correct).
    """
    weight = torch.cat([lin.weight.detach() for lin in linears], dim=0)
    has_bias = [lin.bias is not None for lin in linears]
    bias = torch.cat([lin.bias.detach() for lin in linears], dim=0) if all(has_bias) else None
    if any(has_bias) and bias is None:
        raise ValueError(f"{name}: cannot fuse linears where only some have a bias")
    start = 0
    for lin in linears:
        n = lin.weight.shape[0]
        lin.weight = nn.Parameter(weight[start : start + n], requires_grad=False)
        if bias is not None:
            lin.bias = nn.Parameter(bias[start : start + n], requires_grad=False)
        start += n
    owner.register_buffer(f"{name}_weight", weight, persistent=False)
    owner.register_buffer(f"{name}_bias", bias, persistent=False)


def project(lin: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``lin(x)`` through the GEMM switch (gemm.py)."""
    return linear(x, lin.weight, lin.bias)


class RMSNorm(nn.Module):
    """x / rms(x) · w over the last dim.

    offset=False (Llama, Qwen3): weight starts at 1; as in HF, normalise in fp32,
    round to x's dtype, then multiply by w. offset=True (Qwen3.5, Qwen3-Next): the
    weight is stored zero-centred and the scale is (1 + w), applied in fp32 before
    the single rounding back.
    """

    def __init__(self, dim: int, eps: float, offset: bool = False):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return add_rms_norm(x, None, self.weight, self.eps, self.offset)[1]

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, norm(h)) with h = x + residual (x itself when residual is None): the residual add fused in.

        x, residual (..., d); out: optional (..., d) view with a unit last stride (a tapped layer's slice of the
        target's taps, base.py) that receives h, returned as h; needs a residual (``kernels.norm.add_rms_norm``)."""
        return add_rms_norm(x, residual, self.weight, self.eps, self.offset, h_out=out)


class GatedRMSNorm(nn.Module):
    """RMSNorm(x) · w · silu(gate): the output norm of a Gated DeltaNet head (x, gate: (..., dv))."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x, gate (..., H, dv) -> (..., H, dv): one fused launch on CUDA, the eager HF ops elsewhere."""
        return gated_rms_norm(x, gate, self.weight, self.eps)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) · up(x)), d -> I -> d."""

    def __init__(self, dim: int, hidden: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)
        self.register_buffer("gate_up_weight", None, persistent=False)  # set by fuse()
        self.register_buffer("gate_up_bias", None, persistent=False)

    def fuse(self) -> None:
        fuse_linears("gate_up", self, self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is None:
            h = F.silu(project(self.gate_proj, x)) * project(self.up_proj, x)
        else:
            h = silu_mul(linear(x, self.gate_up_weight, self.gate_up_bias))
        return project(self.down_proj, h)


# ----------------------------------------------------------------------------- RoPE
def rope_inv_freq(text_config, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (R/2,) fp32 on the CPU and the cos/sin scale, from an HF text config.

    R = head_dim · partial_rotary_factor (Qwen3.5 rotates a quarter of each head).
    'default' RoPE is computed here; scaled variants whose frequencies do not depend
    on the sequence length (linear, llama3, yarn) come from transformers' own
    init functions, so that long-context checkpoints load with the exact frequencies.
    Dynamic variants (dynamic NTK, longrope) change with the length and are refused.
    """
    params = dict(getattr(text_config, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = rope_theta(text_config)  # rope_parameters (transformers 5) or rope_theta; absent: one-line error
    partial = float(params.get("partial_rotary_factor", getattr(text_config, "partial_rotary_factor", 1.0)))
    rot = int(head_dim * partial)
    if rope_type == "default":
        # CPU on purpose: models are built on the meta device and moved afterwards (loading.py).
        inv = 1.0 / (theta ** (torch.arange(0, rot, 2, dtype=torch.float32, device="cpu") / rot))
        return inv, 1.0
    if rope_type in ("linear", "llama3", "yarn"):
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        with torch.device("cpu"):  # its tensors are made without a device: keep them off the meta device
            inv, scale = ROPE_INIT_FUNCTIONS[rope_type](text_config, device="cpu")
        return inv.float().cpu(), float(scale)
    raise NotImplementedError(f"RoPE type {rope_type!r} is not supported by the runtime (default/linear/llama3/yarn)")


class Rotary(nn.Module):
    """cos/sin tables at the step's absolute positions, computed once per forward for all layers."""

    def __init__(self, inv_freq: torch.Tensor, scale: float = 1.0):
        super().__init__()
        self.inv_freq = inv_freq.float()  # (R/2,) fp32; a plain attribute, not a buffer: see _apply
        self.scale = scale

    def _apply(self, fn, recurse=True):
        # model.to(device) moves inv_freq; model.to(bf16) must not round it (RoPE angles of long
        # positions would drift), so only the device of fn's result is taken.
        probe = fn(torch.empty(0, device=self.inv_freq.device))
        self.inv_freq = self.inv_freq.to(probe.device)
        return super()._apply(fn, recurse)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype, table: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (N, T) long -> cos, sin (N, 1, T, R) in ``dtype`` (rotate-half layout).

        table: :meth:`table`'s rows for positions 0..L-1 (positions must be < L): the rows are gathered
        instead of computed, two launches instead of about eight (a decode step's whole RoPE cost)."""
        if table is not None and table[0].dtype == dtype:  # another dtype: computed, as without a table
            cos, sin = table
            return cos[positions][:, None], sin[positions][:, None]
        freqs = positions[..., None].float() * self.inv_freq  # (N, T, R/2) fp32
        emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # (N, 1, T, R)
        return (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)

    def table(self, max_len: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (max_len, R) in ``dtype``: :meth:`forward` at positions 0..max_len-1, made once per decode
        state. Each row is the same element-wise float ops on the same operands as a step's own
        computation, so a gathered row equals the computed one bit for bit (tests/test_runtime_models.py)."""
        cos, sin = self.forward(torch.arange(max_len, device=device)[None], dtype)
        return cos[0, 0], sin[0, 0]


# ----------------------------------------------------------------------------- attention
class Attention(nn.Module):
    """Causal softmax attention over the static KV cache (GQA without K/V copies).

    qk_norm: RMSNorm on each q/k head before RoPE (Qwen3, Qwen3.5); norm_offset picks
    the (1 + w) convention. output_gate (Qwen3.5): q_proj also emits a per-head gate,
    laid out [q_h | gate_h] per head, and the attention output is multiplied by
    sigmoid(gate) before o_proj.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        bias: bool = False,
        qk_norm: bool = False,
        norm_eps: float = 1e-6,
        norm_offset: bool = False,
        output_gate: bool = False,
    ):
        super().__init__()
        self.h, self.hkv, self.hd, self.output_gate = num_heads, num_kv_heads, head_dim, output_gate
        self.q_proj = nn.Linear(dim, num_heads * head_dim * (2 if output_gate else 1), bias=bias)
        self.k_proj = nn.Linear(dim, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, dim, bias=bias)
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, norm_eps, norm_offset)
            self.k_norm = RMSNorm(head_dim, norm_eps, norm_offset)
        else:
            self.q_norm = self.k_norm = None
        self.norm_eps, self.norm_offset = norm_eps, norm_offset
        self.register_buffer("qkv_weight", None, persistent=False)  # set by fuse()
        self.register_buffer("qkv_bias", None, persistent=False)

    def fuse(self) -> None:
        fuse_linears("qkv", self, self.q_proj, self.k_proj, self.v_proj)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv: KVCache,
        slot: int,
        meta: StepMeta,
    ) -> torch.Tensor:
        """x (N, T, d) -> (N, T, d); writes this step's K/V into cache slot ``slot`` at meta.positions."""
        N, T, _ = x.shape
        if self.qkv_weight is not None:
            qkv = linear(x, self.qkv_weight, self.qkv_bias)  # (N, T, W): [q (+gate) | k | v]
        else:
            qkv = torch.cat([project(self.q_proj, x), project(self.k_proj, x), project(self.v_proj, x)], dim=-1)
        cos, sin = rope
        q = qk_norm_rope_write(  # (N, H, T, D); k, v land in the cache
            qkv,
            None if self.q_norm is None else self.q_norm.weight,
            None if self.k_norm is None else self.k_norm.weight,
            cos,
            sin,
            meta.positions,
            kv.k[slot],
            kv.v[slot],
            num_heads=self.h,
            num_kv_heads=self.hkv,
            head_dim=self.hd,
            gated=self.output_gate,
            eps=self.norm_eps,
            offset=self.norm_offset,
        )
        if self.output_gate:  # transpose, sigmoid gate and product in one launch on CUDA
            y = kv.attend(slot, q, meta)  # (N, H, T, D)
            y = output_gate(y, split_qkv(qkv, self.h, self.hkv, self.hd, True)[1])  # gate (N, T, H, D), a view
        else:  # (N, T, H, D) written by the attention kernel itself: no transposing copy
            y = kv.attend(slot, q, meta, token_major=True).reshape(N, T, self.h * self.hd)
        return project(self.o_proj, y)
