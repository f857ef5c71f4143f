"""Qwen3 (dense) in the runtime: pre-norm decoder, GQA attention with q/k RMSNorm, SwiGLU MLP.

    h = embed(tokens)                                   # (N, T, d)
    for each layer:
        h = h + attn(rms(h))                            # q/k: per-head RMSNorm, then RoPE
        h = h + mlp(rms(h))                             # tapped: h after the layer
    logits = lm_head(rms(h))                            # (N, T, V)

Each residual add is fused into the norm that follows it (layers return (h, delta)); after a
tapped layer that norm also stores the sum into the layer's taps slice (base._tap).

Llama (llama.py) is this decoder without the q/k norms; it reuses the class.
"""

from __future__ import annotations

import torch
from torch import nn

from dflash2.runtime.cache import DecodeState
from dflash2.runtime.models.base import ModelOutput, RuntimeCausalLM
from dflash2.runtime.models.layers import MLP, Attention, RMSNorm, Rotary, rope_inv_freq
from dflash2.runtime.models.loading import KeyMap

QWEN3_KEYS = KeyMap(
    (
        ("embed.weight", "model.embed_tokens.weight"),
        ("layers.{i}.attn_norm.weight", "model.layers.{i}.input_layernorm.weight"),
        ("layers.{i}.attn.{rest}", "model.layers.{i}.self_attn.{rest}"),  # q/k/v/o_proj, q_norm, k_norm
        ("layers.{i}.mlp_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
        ("layers.{i}.mlp.{rest}", "model.layers.{i}.mlp.{rest}"),  # gate/up/down_proj
        ("norm.weight", "model.norm.weight"),
        ("lm_head.weight", "lm_head.weight"),
    )
)


def _check_supported(cfg) -> None:
    act = getattr(cfg, "hidden_act", "silu")
    if act != "silu":
        raise NotImplementedError(f"hidden_act {act!r}: the runtime's MLP is SwiGLU (silu)")
    kinds = set(getattr(cfg, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"}:
        raise NotImplementedError(f"layer types {sorted(kinds)}: sliding-window attention is not supported yet")


class DenseBlock(nn.Module):
    """One pre-norm decoder layer: attention + MLP, each with a residual."""

    def __init__(self, cfg, head_dim: int, qk_norm: bool, attn_bias: bool, mlp_bias: bool):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.attn_norm = RMSNorm(cfg.hidden_size, eps)
        self.attn = Attention(
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            head_dim,
            bias=attn_bias,
            qk_norm=qk_norm,
            norm_eps=eps,
        )
        self.mlp_norm = RMSNorm(cfg.hidden_size, eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, bias=mlp_bias)

    def forward(
        self, h, delta, rope, state: DecodeState, slot: int, meta, h_out=None, on_h_out=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, delta) (N, T, d) -> (h', delta'): the layer's output is h' + delta' (the add is fused into the next
        norm). h_out: optional (N, T, d) view (the previous layer's tap slice, rows K·d apart) the first norm
        writes h + delta into, then used as the residual stream; on_h_out: called once it is written."""
        h, x = self.attn_norm.add_forward(h, delta, out=h_out)  # h = h + delta (delta None on the first layer)
        if on_h_out is not None:
            on_h_out()
        h, x = self.mlp_norm.add_forward(h, self.attn(x, rope, state.kv, slot, meta))
        return h, self.mlp(x)


class Qwen3(RuntimeCausalLM):
    """Qwen3 target. ``forward(tokens (N, T), state)`` -> logits (N, T, V) and taps (N, T, K·d)."""

    KEY_MAP = QWEN3_KEYS
    QK_NORM = True

    def __init__(self, cfg):
        super().__init__(cfg)
        _check_supported(cfg)
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        attn_bias = bool(getattr(cfg, "attention_bias", False))
        mlp_bias = bool(getattr(cfg, "mlp_bias", False))
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DenseBlock(cfg, self.head_dim, self.QK_NORM, attn_bias, mlp_bias) for _ in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = Rotary(*rope_inv_freq(cfg, self.head_dim))

    def forward(
        self,
        tokens: torch.Tensor,
        state: DecodeState,
        *,
        taps_out: torch.Tensor | None = None,
        logits_index: torch.Tensor | None = None,
        kv_len: int | None = None,
        taps: bool = True,
        on_taps=None,
    ) -> ModelOutput:
        """tokens (N, T) at positions state.lengths + 0..T-1; writes K/V there, commits nothing.

        taps_out: optional (N, T, K·d) buffer the taps are written into; logits_index: optional
        (N,) long, one position per row whose logits alone are computed (e.g. each row's last
        prompt token at prefill); kv_len: see :meth:`DecodeState.step_meta`; taps=False: no taps at all
        (output ``taps`` None), e.g. a plain AR step, which must not pay for the drafter's features.
        on_taps: optional callable, given the taps (N, T, K·d) once every tapped layer's output is written:
        right after the first norm of the layer after the last tapped one (that norm writes the last slice),
        before that layer's mixer; after the final norm, before the LM head, when the last layer is tapped
        (never called without taps).
        """
        N, T = tokens.shape
        meta = state.step_meta(T, kv_len)
        h, delta = self.embed(tokens), None  # (N, T, d); a layer's output is h + delta
        rope = self.rotary(meta.positions, h.dtype, state.rope)  # cos, sin (N, 1, T, D)
        taps = self._tap_buffer(N, T, taps_out, h) if taps else None
        # a tapped layer's output is stored into its taps slice by the norm that adds it, the next layer's first
        # (or the final norm): tap_out / tap_done carry the slice and the on_taps trigger to it (base._tap)
        tap_out = tap_done = None
        for i, layer in enumerate(self.layers):
            h, delta = layer(h, delta, rope, state, i, meta, h_out=tap_out, on_h_out=tap_done)
            tap_out, tap_done = self._tap(taps, i, h, delta, on_taps)
        return ModelOutput(self._logits(h, delta, logits_index, h_out=tap_out, on_h_out=tap_done), taps)
