"""The runtime drafter's weights in the layouts its step reads, prepared once from a ``DFlashDrafter``.

A draft step and a context append each read every drafter layer, and what they read was laid
out for training: three projections of the same input per attention, a K and a V projection per
layer for the same fused context, norm weights in the model dtype that every call casts to fp32,
conv taps in the order the kernel projection emits them. Prepared here instead (copies, made
when a :class:`~dflash2.runtime.drafter.RuntimeDrafter` is built: change the module's weights
afterwards and build a new one):

* q_proj | k_proj | v_proj of a layer as one (H·hd + 2·Hkv·hd, d) weight: one GEMM for the block;
* k_proj and v_proj of every layer as one (2·L·Hkv·hd, d) weight: one GEMM for the context K and
  V of all layers (K of layer 0..L-1, then V of layer 0..L-1);
* fp32 norm weights, and q_norm / k_norm stacked per head ((H + Hkv, hd): q and k of a layer in
  one norm) and k_norm stacked per layer ((L·Hkv, hd): the context K of all layers in one norm);
* the local conv's kernel projection and base kernel with the taps reversed (draft_math.py);
* RoPE's inverse frequencies (twice: the angles in rotate-half layout) and the rotate_half sign.

A GEMM of concatenated weights computes each output column as the separate GEMM does (same row
of weights, same input); on the CPU the results are identical bit for bit (tests), on a GPU the
BLAS library may pick another kernel for another output width (as for the target's fused q|k|v).

Shapes: d hidden, L drafter layers, H / Hkv heads, hd head_dim, K conv taps, G conv groups of gs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash2.drafter.model import DFlashDrafter


@dataclass
class ConvWeights:
    """A BlockLocalConv with its taps reversed: projection (2·K·G, d) rows in (side, K-1-t, g) order,
    base (2, K, G, gs) base_kernel[side, K-1-t] split into groups."""

    projection: torch.Tensor
    base: torch.Tensor

    @classmethod
    def of(cls, conv) -> ConvWeights | None:
        if conv is None:
            return None
        K, G = conv.kernel_size, conv.groups
        rows = torch.arange(2 * K * G, device=conv.base_kernel.device).view(2, K, G).flip(1).reshape(-1)
        w = conv.kernel_projection.weight.detach()
        base = conv.base_kernel.detach().flip(1).reshape(2, K, G, conv.group_size)
        return cls(w[rows].contiguous(), base.contiguous())


@dataclass
class LayerWeights:
    """One drafter layer: qkv (H·hd + 2·Hkv·hd, d); qk_norm (H + Hkv, hd) fp32; input_norm / post_norm
    (d,) fp32; the two local convs (None for v1 drafters); gate_up (2·I, d): the MLP's gate and up
    projections stacked, one GEMM whose halves feed the fused SwiGLU (kernels/act.py). Like qkv, a
    copy beside the module's own weights: at a Qwen3-8B-wide 5-layer drafter about 1 GB more in bf16."""

    qkv: torch.Tensor
    qk_norm: torch.Tensor
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    attention_conv: ConvWeights | None
    mlp_conv: ConvWeights | None
    gate_up: torch.Tensor


@dataclass
class DraftWeights:
    """Everything a runtime draft step and context append read besides the drafter's own modules.

    layers: per layer; context_kv (2·L·Hkv·hd, d); context_k_norm (L·Hkv, hd) fp32; hidden_norm /
    final_norm (d,) fp32; rope_freqs (hd,) fp32: RoPE's inverse frequencies twice ([f, f]); rope_sign (hd,)
    fp32: −1 on the first half, +1 on the second (draft_math.rope_tables); eps: the norms' epsilon.
    """

    layers: list[LayerWeights]
    context_kv: torch.Tensor
    context_k_norm: torch.Tensor
    hidden_norm: torch.Tensor
    final_norm: torch.Tensor
    rope_freqs: torch.Tensor
    rope_sign: torch.Tensor
    eps: float

    @classmethod
    def of(cls, drafter: DFlashDrafter) -> DraftWeights:
        cfg = drafter.config
        w = drafter.fc.weight
        hd = cfg.head_dim

        def f32(norm) -> torch.Tensor:
            return norm.weight.detach().float()

        layers = []
        for layer in drafter.layers:
            a = layer.self_attn
            qkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach()
            qk_norm = torch.cat([f32(a.q_norm).expand(a.h, hd), f32(a.k_norm).expand(a.hkv, hd)])
            layers.append(
                LayerWeights(
                    qkv,
                    qk_norm,
                    f32(layer.input_layernorm),
                    f32(layer.post_attention_layernorm),
                    ConvWeights.of(layer.attention_conv),
                    ConvWeights.of(layer.mlp_conv),
                    torch.cat([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight]).detach(),
                )
            )
        attns = [layer.self_attn for layer in drafter.layers]
        context_kv = torch.cat([a.k_proj.weight for a in attns] + [a.v_proj.weight for a in attns]).detach()
        context_k_norm = torch.cat([f32(a.k_norm).expand(a.hkv, hd) for a in attns])
        # rope_cos_sin's inverse frequencies, computed as it computes them, twice: [f, f] (rotate-half layout)
        inv_freq = cfg.rope_theta ** (-torch.arange(0, hd, 2, device=w.device, dtype=torch.float32) / hd)
        sign = torch.ones(hd, device=w.device)
        sign[: hd // 2] = -1
        eps = {m.eps for m in drafter.modules() if hasattr(m, "eps") and hasattr(m, "weight")}
        if len(eps) != 1:
            raise ValueError(f"the drafter's norms use several eps values {sorted(eps)}; the runtime expects one")
        freqs = torch.cat([inv_freq, inv_freq])
        return cls(layers, context_kv, context_k_norm, f32(drafter.hidden_norm), f32(drafter.norm), freqs, sign, *eps)
