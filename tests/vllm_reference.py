"""An independent re-implementation of one draft step of vLLM's ``qwen3_dflash2`` drafter (tests only).

Written from reading vLLM's ``qwen3_dflash.py`` / ``qwen3_dflash2.py`` (2026) and its attention
backends, sharing no code with ``dflash2.drafter``: it reads a drafter folder's
``config.json`` and ``model.safetensors`` the way vLLM's loader does and follows vLLM's
layout and order of operations, so that tests can check that dflash2 drafts exactly what a
served DFlash2 drafter drafts. What it mirrors:

* context: ``hidden_norm(fc(taps))``, then per layer k = k_norm(k_proj(c)) with neox RoPE at
  the context positions, v = v_proj(c) (vLLM's ``precompute_and_store_context_kv``);
* the block: ``[anchor, mask × (B − 1)]`` with B = 1 + ``num_speculative_tokens``, embedded
  with the target's embedding times ``dflash_config.input_embedding_scale``, at positions
  anchor_pos + i;
* a layer: vLLM's fused residual (``norm(h, residual)`` adds, then normalises); the grouped
  conv works on (T, groups, group_size) views, taps read position i − t only when
  (i mod B) ≥ t, ``prepare`` (side 0 on the normed input) / ``finish`` (side 1 on the
  sub-layer output) with δ from the normed input;
* attention: non-causal; a sliding layer (``layer_types``, window from ``sliding_window``
  as HF's config exposes it) sees key positions k with |q − k| < window (vLLM's symmetric
  non-causal window, KV index = position); plain softmax(q·kᵀ/√hd);
* candidates (``compute_candidates``): raw LM-head logits → top-k (sorted) → × output
  multiplier → softcap; edge scores for every (predecessor, candidate) pair, the anchor
  as predecessor at step 0 (``_score_edges``); the T=0 walk takes the argmax along the row
  of the previous pick.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """x (T, heads, hd), pos (T,): rotate-half pairs (i, i + hd/2)."""
    hd = x.shape[-1]
    inv = theta ** (-torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    ang = pos.float()[:, None] * inv  # (T, hd/2)
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]
    a, b = x[..., : hd // 2], x[..., hd // 2 :]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


class VllmStyleDFlash2:
    """One drafter folder + the target's embedding / LM head weights (V, d), fp32."""

    def __init__(self, folder: Path, embed: torch.Tensor, lm_head: torch.Tensor, num_speculative_tokens: int):
        self.cfg = cfg = json.loads((Path(folder) / "config.json").read_text())
        self.w = {k: v.float() for k, v in load_file(str(Path(folder) / "model.safetensors")).items()}
        self.embed, self.lm_head = embed.float(), lm_head.float()
        dc = cfg["dflash_config"]
        self.B = 1 + num_speculative_tokens
        self.mask_id, self.top_k = int(dc["mask_token_id"]), int(dc["selector_top_k"])
        self.taps, self.group = int(dc["conv_kernel_size"]), int(dc["conv_group_size"])
        self.emb_scale = float(dc.get("input_embedding_scale", 1.0))
        self.mult = float(dc.get("output_multiplier", 1.0))
        cap = float(dc.get("final_logit_softcapping") or 0.0)
        self.cap = cap if cap > 0 else None
        assert cfg.get("is_causal") is False, "this reference implements the non-causal layers only"
        # HF's Qwen3Config keeps sliding_window only with use_sliding_window
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
        kinds = cfg.get("layer_types") or ["full_attention"] * cfg["num_hidden_layers"]
        self.windows = [window if k == "sliding_attention" else None for k in kinds]
        self.eps, self.hd = float(cfg["rms_norm_eps"]), int(cfg["head_dim"])
        self.heads, self.kv_heads = int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"])
        self.theta = float(cfg["rope_parameters"]["rope_theta"])

    # ------------------------------------------------------------------ pieces
    def _conv(self, x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        """x (T, d), delta (T, taps, G), base (taps, d)."""
        T, d = x.shape
        G = d // self.group
        blocks = x.view(T, G, self.group)
        coeff = base.view(1, self.taps, G, self.group) + delta[..., None]  # (T, taps, G, gs)
        out = coeff[:, 0] * blocks
        in_block = torch.arange(T) % self.B
        for t in range(1, self.taps):
            shifted = torch.cat([torch.zeros(t, G, self.group), blocks[:-t]])
            out = out + coeff[:, t] * shifted * (in_block >= t).float()[:, None, None]
        return out.reshape(T, d)

    def _conv_prepare(self, prefix: str, x: torch.Tensor):
        proj = x @ self.w[prefix + "kernel_projection.weight"].T
        delta = proj.view(x.shape[0], 2, self.taps, -1)
        return self._conv(x, delta[:, 0], self.w[prefix + "base_kernel"][0]), delta[:, 1]

    def _conv_finish(self, prefix: str, y: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return self._conv(y, delta, self.w[prefix + "base_kernel"][1])

    def context(self, taps: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """taps (L, K·d_t), positions (L,) -> per layer (K (L, kvh, hd), V (L, kvh, hd))."""
        c = _rms(taps.float() @ self.w["fc.weight"].T, self.w["hidden_norm.weight"], self.eps)
        out = []
        for n in range(len(self.windows)):
            p = f"layers.{n}.self_attn."
            k = (c @ self.w[p + "k_proj.weight"].T).view(-1, self.kv_heads, self.hd)
            k = _rope(_rms(k, self.w[p + "k_norm.weight"], self.eps), positions, self.theta)
            out.append((k, (c @ self.w[p + "v_proj.weight"].T).view(-1, self.kv_heads, self.hd)))
        return out

    def _attention(self, n: int, x: torch.Tensor, pos: torch.Tensor, ctx, ctx_pos: torch.Tensor) -> torch.Tensor:
        p = f"layers.{n}.self_attn."
        T = x.shape[0]
        q = _rope(
            _rms(
                (x @ self.w[p + "q_proj.weight"].T).view(T, self.heads, self.hd), self.w[p + "q_norm.weight"], self.eps
            ),
            pos,
            self.theta,
        )
        k = _rope(
            _rms(
                (x @ self.w[p + "k_proj.weight"].T).view(T, self.kv_heads, self.hd),
                self.w[p + "k_norm.weight"],
                self.eps,
            ),
            pos,
            self.theta,
        )
        v = (x @ self.w[p + "v_proj.weight"].T).view(T, self.kv_heads, self.hd)
        keys, values = torch.cat([ctx[0], k]), torch.cat([ctx[1], v])
        key_pos = torch.cat([ctx_pos, pos])
        visible = torch.ones(T, len(key_pos), dtype=torch.bool)
        if self.windows[n] is not None:
            visible = (pos[:, None] - key_pos[None, :]).abs() < self.windows[n]
        rep = self.heads // self.kv_heads
        keys, values = keys.repeat_interleave(rep, dim=1), values.repeat_interleave(rep, dim=1)
        scores = torch.einsum("thd,khd->htk", q, keys) / self.hd**0.5
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        out = torch.einsum("htk,khd->thd", probs, values).reshape(T, -1)
        return out @ self.w[p + "o_proj.weight"].T

    def _mlp(self, n: int, x: torch.Tensor) -> torch.Tensor:
        p = f"layers.{n}.mlp."
        gate, up = x @ self.w[p + "gate_proj.weight"].T, x @ self.w[p + "up_proj.weight"].T
        return (torch.nn.functional.silu(gate) * up) @ self.w[p + "down_proj.weight"].T

    # ------------------------------------------------------------------ one step
    def block_hidden(self, ctx, ctx_pos: torch.Tensor, anchor_id: int, anchor_pos: int) -> torch.Tensor:
        """Hidden states (B, d) after the final norm for the block anchored at anchor_pos."""
        ids = torch.full((self.B,), self.mask_id)
        ids[0] = anchor_id
        pos = anchor_pos + torch.arange(self.B)
        hidden, residual = self.embed[ids] * self.emb_scale, None
        for n in range(len(self.windows)):
            p = f"layers.{n}."
            residual = hidden if residual is None else hidden + residual
            x = _rms(residual, self.w[p + "input_layernorm.weight"], self.eps)
            x, delta = self._conv_prepare(p + "attention_conv.", x)
            x = self._conv_finish(p + "attention_conv.", self._attention(n, x, pos, ctx[n], ctx_pos), delta)
            residual = x + residual
            x = _rms(residual, self.w[p + "post_attention_layernorm.weight"], self.eps)
            x, delta = self._conv_prepare(p + "mlp_conv.", x)
            hidden = self._conv_finish(p + "mlp_conv.", self._mlp(n, x), delta)
        return _rms(hidden + residual, self.w["norm.weight"], self.eps)

    def walk(self, hidden: torch.Tensor, anchor_id: int) -> list[int]:
        """T=0 selector walk over the drafted positions of ``hidden`` (B, d) -> B − 1 token ids."""
        h = hidden[1:]
        values, ids = torch.topk(h @ self.lm_head.T, self.top_k, dim=-1)  # (P, k), sorted
        values = values * self.mult
        if self.cap is not None:
            values = torch.tanh(values / self.cap) * self.cap
        hh = h @ self.w["candidate_selector.hidden_projection.weight"].T  # (P, r)
        pred_ids = torch.cat([torch.full((1, self.top_k), anchor_id), ids[:-1]])  # (P, k) predecessor rows
        pred = self.w["candidate_selector.predecessor_codebook"][pred_ids]  # (P, k, r)
        succ = self.w["candidate_selector.successor_codebook"][ids]  # (P, k, r)
        scores = values[:, None, :] + torch.einsum("lpr,lcr->lpc", pred * hh[:, None], succ)  # (P, k, k)
        prev, path = 0, []  # step 0: every predecessor row is the anchor
        for step in range(h.shape[0]):
            prev = int(scores[step, prev].argmax())
            path.append(int(ids[step, prev]))
        return path

    def draft(self, taps: torch.Tensor, anchor_id: int, anchor_pos: int) -> tuple[list[int], torch.Tensor]:
        """taps (L, K·d_t) of context positions 0..L-1 (L = anchor_pos) -> (drafts, hidden (B, d))."""
        ctx_pos = torch.arange(taps.shape[0])
        hidden = self.block_hidden(self.context(taps, ctx_pos), ctx_pos, anchor_id, anchor_pos)
        return self.walk(hidden, anchor_id), hidden
