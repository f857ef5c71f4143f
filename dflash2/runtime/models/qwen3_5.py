"""Qwen3.5 hybrid (dense text model) in the runtime: Gated DeltaNet + gated attention, 3:1.

    h = embed(tokens)                                        # (N, T, d)
    for each layer (config.layer_types):
        h = h + mixer(rms(h))     # 'linear_attention': GatedDeltaNet; 'full_attention': gated attention
        h = h + mlp(rms(h))       # tapped: h after the layer
    logits = lm_head(rms(h))

Differences from Qwen3 (qwen3.py), all taken from the HF config / checkpoint:
* every RMSNorm outside the GDN output norm stores a zero-centred weight: scale (1 + w);
* attention: q_proj emits [q_h | gate_h] per head, output · sigmoid(gate) before o_proj;
  RoPE on the first ``partial_rotary_factor`` · D dims of each head only (default 1/4);
  text-only positions make Qwen3.5's multimodal RoPE sections all equal, i.e. plain RoPE;
* GDN layers (gdn_state.py for the state math, its ``mode`` for the kernels): in_proj_qkv -> depthwise causal conv
  (kernel K) + SiLU -> q, k (L2-normed), v; decay g and write strength β from
  in_proj_a / in_proj_b; output RMSNorm gated by silu(in_proj_z), then out_proj.

Composite (vision-language) Qwen3.5 checkpoints load too: their text weights sit
under ``model.language_model.`` (read as ``model.``, loading.py) and the config's
``text_config`` holds these fields. Qwen3-Next (MoE MLP, fused in_proj_qkvz / in_proj_ba)
is not covered by this file.
"""

from __future__ import annotations

import torch
from torch import nn

from dflash2.runtime.cache import DecodeState
from dflash2.runtime.gdn_state import GDNState
from dflash2.runtime.gemm import linear
from dflash2.runtime.models.base import ATTENTION, GDN, ModelOutput, RuntimeCausalLM
from dflash2.runtime.models.layers import (
    MLP,
    Attention,
    GatedRMSNorm,
    RMSNorm,
    Rotary,
    fuse_linears,
    project,
    rope_inv_freq,
)
from dflash2.runtime.models.loading import KeyMap

QWEN3_5_KEYS = KeyMap(
    (
        ("embed.weight", "model.embed_tokens.weight"),
        ("layers.{i}.norm1.weight", "model.layers.{i}.input_layernorm.weight"),
        ("layers.{i}.attn.{rest}", "model.layers.{i}.self_attn.{rest}"),  # q(+gate)/k/v/o_proj, q_norm, k_norm
        ("layers.{i}.gdn.conv_weight", "model.layers.{i}.linear_attn.conv1d.weight"),  # (C, 1, K)
        ("layers.{i}.gdn.{rest}", "model.layers.{i}.linear_attn.{rest}"),  # in_proj_*, A_log, dt_bias, norm, out_proj
        ("layers.{i}.norm2.weight", "model.layers.{i}.post_attention_layernorm.weight"),
        ("layers.{i}.mlp.{rest}", "model.layers.{i}.mlp.{rest}"),
        ("norm.weight", "model.norm.weight"),
        ("lm_head.weight", "lm_head.weight"),
    )
)


class GatedDeltaNet(nn.Module):
    """The GDN token mixer: projections and output norm here, conv + recurrence in :class:`GDNState`.

    Hk key heads of d_k, H value heads of d_v (each key head serves H/Hk value heads),
    C = 2·Hk·d_k + H·d_v conv channels.
    """

    def __init__(self, cfg):
        super().__init__()
        d = cfg.hidden_size
        self.hk, self.h = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.conv_dim = 2 * self.hk * self.dk + self.h * self.dv
        self.in_proj_qkv = nn.Linear(d, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(d, self.h * self.dv, bias=False)
        self.in_proj_b = nn.Linear(d, self.h, bias=False)
        self.in_proj_a = nn.Linear(d, self.h, bias=False)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, 1, cfg.linear_conv_kernel_dim))
        self.A_log = nn.Parameter(torch.empty(self.h))
        self.dt_bias = nn.Parameter(torch.empty(self.h))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.h * self.dv, d, bias=False)
        self.register_buffer("in_proj_weight", None, persistent=False)  # set by fuse()
        self.register_buffer("in_proj_bias", None, persistent=False)

    def fuse(self) -> None:
        fuse_linears("in_proj", self, self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)

    def forward(self, x: torch.Tensor, gdn: GDNState, slot: int) -> torch.Tensor:
        """x (N, T, d) -> (N, T, d); verifies from the untouched state (commit folds tokens later)."""
        N, T, _ = x.shape
        if self.in_proj_weight is not None:  # one GEMV for all four projections
            proj = linear(x, self.in_proj_weight)
            qkv, z, b, a = proj.split([self.conv_dim, self.h * self.dv, self.h, self.h], dim=-1)
        else:
            lins = (self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)
            qkv, z, b, a = (project(lin, x) for lin in lins)
        # qkv (N, T, C) is logged pre-conv for the conv-window commit
        z = z.reshape(N, T, self.h, self.dv)
        # decay g and write strength β come from a, b (N, T, H) inside verify (fused in the kernel)
        o = gdn.verify(slot, qkv, self.conv_weight, a, b, self.A_log, self.dt_bias)  # (N, T, H, dv)
        return project(self.out_proj, self.norm(o, z).reshape(N, T, self.h * self.dv))


class HybridBlock(nn.Module):
    """One pre-norm layer: GDN or gated attention, then the SwiGLU MLP."""

    def __init__(self, cfg, kind: str, head_dim: int):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.kind = kind
        self.norm1 = RMSNorm(cfg.hidden_size, eps, offset=True)
        if kind == GDN:
            self.gdn = GatedDeltaNet(cfg)
        else:
            self.attn = Attention(
                cfg.hidden_size,
                cfg.num_attention_heads,
                cfg.num_key_value_heads,
                head_dim,
                bias=bool(getattr(cfg, "attention_bias", False)),
                qk_norm=True,
                norm_eps=eps,
                norm_offset=True,
                output_gate=True,
            )
        self.norm2 = RMSNorm(cfg.hidden_size, eps, offset=True)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(
        self, h, delta, rope, state: DecodeState, slot: int, meta, h_out=None, on_h_out=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, delta) (N, T, d) -> (h', delta'): the layer's output is h' + delta' (the add is fused into the next
        norm). h_out, on_h_out: as in :meth:`dflash2.runtime.models.qwen3.DenseBlock.forward` (the first norm
        writes h + delta into the previous layer's tap slice h_out, then on_h_out() runs)."""
        h, x = self.norm1.add_forward(h, delta, out=h_out)
        if on_h_out is not None:
            on_h_out()
        mixed = self.gdn(x, state.gdn, slot) if self.kind == GDN else self.attn(x, rope, state.kv, slot, meta)
        h, x = self.norm2.add_forward(h, mixed)
        return h, self.mlp(x)


class Qwen3_5(RuntimeCausalLM):
    """Qwen3.5 hybrid target. ``forward(tokens (N, T), state)`` -> logits (N, T, V), taps (N, T, K·d)."""

    KEY_MAP = QWEN3_5_KEYS

    def __init__(self, cfg):
        super().__init__(cfg)
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise NotImplementedError(f"hidden_act {cfg.hidden_act!r}: the runtime's GDN/MLP assume silu")
        kinds = list(cfg.layer_types)
        if set(kinds) - {ATTENTION, GDN}:
            raise NotImplementedError(f"layer types {sorted(set(kinds))}: expected full_attention/linear_attention")
        self.layer_types = kinds
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.gdn_dims = dict(
            conv_dim=2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim
            + cfg.linear_num_value_heads * cfg.linear_value_head_dim,
            conv_kernel=cfg.linear_conv_kernel_dim,
            num_k_heads=cfg.linear_num_key_heads,
            num_v_heads=cfg.linear_num_value_heads,
            head_k_dim=cfg.linear_key_head_dim,
            head_v_dim=cfg.linear_value_head_dim,
        )
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(HybridBlock(cfg, kind, self.head_dim) for kind in kinds)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset=True)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = Rotary(*rope_inv_freq(cfg, self.head_dim))  # R = partial_rotary_factor · D
        self._slots = self.slots()

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
        """tokens (N, T) at positions state.lengths + 0..T-1; nothing is committed (see ``state.commit``).

        Arguments as in :meth:`dflash2.runtime.models.qwen3.Qwen3.forward`.
        """
        N, T = tokens.shape
        meta = state.step_meta(T, kv_len)
        h, delta = self.embed(tokens), None  # (N, T, d); a layer's output is h + delta
        rope = self.rotary(meta.positions, h.dtype, state.rope)  # cos, sin (N, 1, T, R)
        taps = self._tap_buffer(N, T, taps_out, h) if taps else None
        # tapped outputs stored by the next norm, on_taps after it: as in Qwen3.forward (base._tap)
        tap_out = tap_done = None
        for i, layer in enumerate(self.layers):
            h, delta = layer(h, delta, rope, state, self._slots[i], meta, h_out=tap_out, on_h_out=tap_done)
            tap_out, tap_done = self._tap(taps, i, h, delta, on_taps)
        return ModelOutput(self._logits(h, delta, logits_index, h_out=tap_out, on_h_out=tap_done), taps)
