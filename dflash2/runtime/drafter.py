"""The DFlash / DFlash2 drafter in the runtime: its weights, a static context cache (docs/ARCHITECTURE.md §2.7).

Same weights and the same math as :class:`dflash2.drafter.DFlashDrafter`, bit for bit, with
the reference ``ContextCache`` replaced by :class:`DraftContext` and the layers' arithmetic
arranged for a decode step, which at batch 1 costs what its number of kernels costs
(``python -m dflash2.runtime.phase_ops``):

* context K/V of every drafter layer live in a preallocated :class:`KVCache`
  (L_d, N, Hkv, S_max, hd); row r's context occupies positions 0 .. lengths[r]-1
  and ``lengths`` stays on the device (no host sync, no reallocation);
* the target's verify forward writes its taps straight into ``DraftContext.taps``
  (N, B, K·d) (``taps_out=``, no hooks); :meth:`RuntimeDrafter.append` fuses the
  first n[r] of them (fc + hidden_norm), projects K/V of all layers in one GEMM, normalises
  and rotates the K of all layers together and writes them at positions lengths[r] ..
  (per row, one scatter for K and one for V), then advances lengths by n;
* a draft step writes the block's own K/V into the same cache at positions
  lengths .. lengths+B-1 (past the context: the next append overwrites them) and
  attends over the first kv_len positions, every row its context and its whole block
  (bidirectional; the Triton decode kernel's 'block' rule, the dense mask only where SDPA
  runs), so no context K/V is ever copied or concatenated and GQA folds query groups
  instead of repeating K/V (cache.py); per layer, q|k|v is one GEMM, q and k are normalised
  and rotated together, and the local conv is two products (draft_math.py, draft_weights.py);
* on CUDA (kernels on: ``dflash2.runtime.kernels``) every norm is one Triton launch with the
  residual add before it folded in (``add_rms_norm_fp32w``: a sublayer returns its two terms,
  the next norm adds them), and a layer's q/k norm + RoPE + block K/V write is one launch, as is
  the context append's K norm + RoPE + K/V write of every layer (``draft_qk_rope_write``), and the
  pre side of a local conv (its kernel add, shifted products and their sum: ``local_conv``); a
  conv'd sublayer's post side is left pending (:class:`PostConv`) and run by the launch of the norm
  that adds it (``conv_add_rms_norm_fp32w``, the next sublayer's or the final norm: one launch fewer
  per sublayer, 6 per draft of a 3-layer drafter); their twins, run on the CPU, are the eager ops,
  so the CPU stays bit for bit with the modules, and the kernels differ from them only in a norm's
  reduction order (last fp32 bit of rstd);
* the drafter's modules are read for their weights once (:class:`DraftWeights`; the MLP's gate and
  up stacked into one GEMM feeding the fused SwiGLU) and called as they are for the MLP's down
  projection, fc, output projection and selector codebooks.

A block ``[anchor, MASK × (B-1)]`` at positions lengths .. lengths+B-1 gives B-1 drafts
(positions 1 .. B-1 through the target's LM head): argmax or the selector's greedy
path at T=0; at T>0 a draw from the warped full-vocabulary q (dense), the
selector's sampled path (sparse q over its k candidates) or, with
``argmax_drafts=True``, the T=0 drafts as a point mass (sampling.py, selector_path.py).

Shapes: N rows, B block, P = B-1, d hidden, Hkv / H heads, hd head_dim, K·d taps, V vocab.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import NamedTuple

import torch
import torch.nn.functional as F

from dflash2.decoding.sampling import SamplingParams, warp_probs
from dflash2.drafter.from_target import check_drafter_matches_target
from dflash2.drafter.io import load_drafter
from dflash2.drafter.model import DFlashDrafter
from dflash2.errors import DFlash2Error
from dflash2.runtime.cache import KVCache, StepMeta
from dflash2.runtime.draft_math import rope_rows, rope_tables
from dflash2.runtime.draft_weights import DraftWeights
from dflash2.runtime.kernels.act import silu_mul
from dflash2.runtime.kernels.conv_norm import conv_add_rms_norm_fp32w
from dflash2.runtime.kernels.draft_rope import draft_qk_rope_write
from dflash2.runtime.kernels.local_conv import local_conv
from dflash2.runtime.kernels.norm import add_rms_norm_fp32w
from dflash2.runtime.sampling import Proposal, sample
from dflash2.runtime.selector_path import selector_greedy_path, selector_sample_sparse


class PostConv(NamedTuple):
    """A conv'd sublayer's output whose post-conv (``local_conv`` side 1) is left to the next norm's launch.

    z (N, B, d): the sublayer's output before it; delta (N, B, 2·K·G): both conv sides' dynamic taps; base
    (2, K, G, gs) ``ConvWeights.base``. ``RuntimeDrafter._add_norm`` resolves it: x + local_conv(z, delta,
    base, 1), added and normalised in one launch (``conv_add_rms_norm_fp32w``)."""

    z: torch.Tensor
    delta: torch.Tensor
    base: torch.Tensor


class DraftContext:
    """Per-generation drafter state: context lengths, context K/V and the taps buffer.

    lengths: (N,) long on the device, context positions per row (= the target's committed length).
    kv:      KVCache (L_d, N, Hkv, S_max, hd) of context K/V (and, transiently, the block's).
    taps:    (N, B, K·d) where the target's verify forward writes its taps (``taps_out``).
    rope:    cos, sin± (S_max, 1, hd) of every cache position (draft_math.rope_rows), or None (computed per
             call); kept here so that graphs captured on this context read them.
    """

    def __init__(self, lengths: torch.Tensor, kv: KVCache, taps: torch.Tensor, rope=None):
        self.lengths, self.kv, self.taps, self.rope = lengths, kv, taps, rope
        self._offsets = torch.arange(kv.max_len, device=lengths.device)  # made once: positions are one add

    def positions(self, T: int) -> torch.Tensor:
        """(N, T) long: lengths + 0 .. T-1, the positions of a block (or of appended taps) per row."""
        return self.lengths[:, None] + self._offsets[:T]

    def meta(self, T: int, kv_len: int | None = None, attend: bool = True, window: int | None = None) -> StepMeta:
        """Positions lengths + 0..T-1 per row, their write index and (attend) the draft mask.

        Mask (N, 1, 1, S), broadcast over heads and queries: key s is visible iff s < lengths + T,
        the row's context and the whole block (bidirectional inside the block, §2.5); built only if
        SDPA runs (the Triton decode kernel reads the 'block' rule from the positions). With
        ``window`` (sliding_attention layers, §2.4) also |position − s| < window (cache index =
        position), per query: (N, 1, G·T, S) in the folded-GQA row order g·T + t.
        """
        device = self.lengths.device
        positions = self.positions(T)  # (N, T)
        hkv, D = self.kv.k.shape[2], self.kv.k.shape[-1]
        write_index = positions[:, None, :, None].expand(-1, hkv, -1, D)  # (N, Hkv, T, D)
        if not attend:
            return StepMeta(positions, write_index, None, 0)
        kv_len = self.kv.max_len if kv_len is None else kv_len
        lengths, groups = self.lengths, self.kv.groups

        def mask() -> torch.Tensor:
            keys = torch.arange(kv_len, device=device)
            return (keys[None, :] < (lengths + T)[:, None])[:, None, None, :]  # (N, 1, 1, S)

        if window is None:  # keys ≤ positions[n, T-1] for every query: the decode kernel's 'block' rule
            return StepMeta(positions, write_index, mask, kv_len, "block")
        keys = torch.arange(kv_len, device=device)
        inside = (positions[:, :, None] - keys).abs() < window  # (N, T, S)
        return StepMeta(positions, write_index, (mask() & inside[:, None]).repeat(1, 1, groups, 1), kv_len)


class RuntimeDrafter:
    """A DFlash / DFlash2 drafter driven by the runtime (weights of ``dflash2.drafter``, static context).

    drafter: a :class:`DFlashDrafter` or the folder of one (``save_drafter`` / export / z-lab layout,
    loaded on the target's device). target: the runtime target (``dflash2.runtime.load_model``),
    tapping the drafter's ``target_layer_ids``; its embedding and LM head are the drafter's.
    dtype: cast the drafter (a folder's stored dtype, or the module's, when None).
    """

    def __init__(self, drafter: DFlashDrafter | str | os.PathLike, target, *, dtype: torch.dtype | None = None):
        device = target.embed.weight.device
        if isinstance(drafter, (str, os.PathLike)):
            drafter = load_drafter(drafter, device=device, dtype=dtype)
        elif not isinstance(drafter, DFlashDrafter):
            raise DFlash2Error(f"drafter must be a DFlashDrafter or its folder, got {type(drafter).__name__}")
        elif dtype is not None:
            drafter = drafter.to(dtype)
        cfg = drafter.config
        shape = SimpleNamespace(
            vocab_size=target.vocab_size, hidden_size=target.hidden_size, num_layers=target.num_layers, tokenizer=None
        )
        check_drafter_matches_target(cfg, shape)  # vocab / width / depth
        if list(target.target_layer_ids) != list(cfg.target_layer_ids):
            raise DFlash2Error(
                f"the drafter reads target layers {cfg.target_layer_ids} but the runtime target taps "
                f"{target.target_layer_ids}; load it with load_model(..., target_layer_ids={cfg.target_layer_ids})"
            )
        weight = drafter.fc.weight
        if weight.device != device:
            raise DFlash2Error(f"the drafter is on {weight.device} and the target on {device}; move one of them")
        self.drafter = drafter.eval().requires_grad_(False)
        self.target = target
        self.config = cfg
        self.block_size = cfg.block_size
        self.dtype = weight.dtype
        self.weights = DraftWeights.of(self.drafter)  # read once: build a new RuntimeDrafter after changing them
        self._masks = torch.full((1, cfg.block_size - 1), cfg.mask_token_id, dtype=torch.long, device=device)

    # ------------------------------------------------------------------ state
    def new_context(self, batch_size: int, max_len: int) -> DraftContext:
        """Empty context for ``batch_size`` rows of up to ``max_len`` positions (prompt + new tokens + a block)."""
        cfg = self.config
        w = self.drafter.fc.weight
        kv = KVCache(
            cfg.num_hidden_layers,
            batch_size,
            cfg.num_key_value_heads,
            max_len,
            cfg.head_dim,
            groups=cfg.num_attention_heads // cfg.num_key_value_heads,
            dtype=self.dtype,
            device=w.device,
        )
        tap_dtype = self.target.embed.weight.dtype  # written by the target's forward, in its dtype
        taps = torch.zeros(batch_size, self.block_size, w.shape[1], dtype=tap_dtype, device=w.device)
        lengths = torch.zeros(batch_size, dtype=torch.long, device=w.device)
        rope = rope_rows(max_len, self.weights.rope_freqs, self.weights.rope_sign, self.dtype)
        return DraftContext(lengths, kv, taps, rope)

    def _rope(self, ctx: DraftContext, positions: torch.Tensor, dtype: torch.dtype):
        """cos, sin± (N, T, 1, hd) at positions (N, T): the context's rows, else computed (draft_math.rope_tables)."""
        if ctx.rope is not None and ctx.rope[0].dtype == dtype:
            return ctx.rope[0][positions], ctx.rope[1][positions]
        return rope_tables(positions, self.weights.rope_freqs, self.weights.rope_sign, dtype)

    @torch.no_grad()
    def write_context(self, ctx: DraftContext, taps: torch.Tensor) -> None:
        """The context K/V of target features taps (N, T, K·d) at positions lengths + 0..T-1; lengths unchanged.

        What the row keeps is decided later (``ctx.lengths += n``): the K/V past a row's length are never read
        and are overwritten later, so this needs no acceptance and can run as soon as the taps exist (the
        engine runs it beside the verify's last target layers). Same values as ``ContextCache.append``:
        c = hidden_norm(fc(taps)), then per layer K = RoPE(k_norm(k_proj(c))), V = v_proj(c) — all layers
        in one GEMM, one norm, one RoPE.
        """
        T, w = taps.shape[1], self.weights
        c = add_rms_norm_fp32w(self.drafter.fc(taps.to(self.dtype)), None, w.hidden_norm, w.eps)[1]  # fuse_context
        positions = ctx.positions(T)
        cos, sin = self._rope(ctx, positions, c.dtype)  # (N, T, 1, hd)
        kv = F.linear(c, w.context_kv)  # (N, T, 2·L·Hkv·hd): [K | V] of every layer
        # K normed and rotated, K and V written at positions, every layer in one call (no q: num_heads=0)
        draft_qk_rope_write(kv, w.context_k_norm, cos, sin, positions, ctx.kv.k, ctx.kv.v, num_heads=0, eps=w.eps)

    @torch.no_grad()
    def append(self, ctx: DraftContext, taps: torch.Tensor, n: torch.Tensor) -> None:
        """Add target features of new verified positions: taps (N, T, K·d) at positions lengths + 0..T-1;
        row r keeps the first n[r] (N,) long. :meth:`write_context`, then the lengths advance."""
        self.write_context(ctx, taps)
        ctx.lengths += n

    # ------------------------------------------------------------------ draft
    def _attention(self, i: int, x, cos, sin, kv: KVCache, meta: StepMeta) -> torch.Tensor:
        """Layer i's attention (``dflash2.drafter.model.Attention``) over the static cache. x (N, B, d) -> (N, B, d)."""
        attn = self.drafter.layers[i].self_attn
        N, T, _ = x.shape
        H, hd = attn.h, attn.hd
        qkv = F.linear(x, self.weights.layers[i].qkv)  # (N, T, (H + 2·Hkv)·hd)
        # q and k normed (their own weights per head) and rotated, k and v written at lengths .. lengths+B-1,
        # after the context (block K/V: the same projections as the context's): one launch on CUDA
        q = draft_qk_rope_write(
            qkv,
            self.weights.layers[i].qk_norm,
            cos,
            sin,
            meta.positions,
            kv.k[i],
            kv.v[i],
            num_heads=H,
            eps=self.weights.eps,
        )  # (N, H, B, hd)
        y = kv.attend(i, q, meta, token_major=True)  # (N, B, H, hd): o_proj's layout, no transposing copy
        return attn.o_proj(y.reshape(N, T, H * hd))

    def _add_norm(self, h: torch.Tensor, out: torch.Tensor | PostConv | None, weight32: torch.Tensor):
        """(h + out, RMSNorm(h + out)): the residual stream's two terms added and normalised in one launch.

        h (N, B, d); out: None (h is the whole stream), a tensor (N, B, d), or a :class:`PostConv`, whose conv
        the same launch runs (``conv_add_rms_norm_fp32w``: the post-conv is never a launch of its own)."""
        if isinstance(out, PostConv):
            return conv_add_rms_norm_fp32w(h, *out, weight32, self.weights.eps)
        return add_rms_norm_fp32w(h, out, weight32, self.weights.eps)

    def _sublayer(self, h: torch.Tensor, out: torch.Tensor | PostConv | None, norm: torch.Tensor, conv, fn):
        """``DecoderLayer._sublayer`` with its residual add deferred: (h, out) -> (h + out, its sublayer's out).

        The sublayer's result h + post-conv(fn(pre-conv(norm(h)))) (no conv for v1) is returned as the pair
        (h, out) of its two terms, so that the add happens in the next norm's launch (:meth:`_add_norm`); with a
        conv, out is the :class:`PostConv` still to run, which that launch runs too. h (N, B, d); out as
        :meth:`_add_norm` takes it (None: h is the whole residual stream, the block's embedding)."""
        h, x = self._add_norm(h, out, norm)
        if conv is None:
            return h, fn(x)
        delta = F.linear(x, conv.projection)  # (N, B, 2·K·G): both sides' dynamic taps, from the normed input
        return h, PostConv(fn(local_conv(x, delta, conv.base, 0)), delta, conv.base)

    def _layer(
        self, i: int, h: torch.Tensor, out: torch.Tensor | PostConv | None, cos, sin, kv: KVCache, meta: StepMeta
    ):
        """Drafter layer i on the block h + out (N, B, d) -> its output as the pair (h, out): the sum is the output
        (out a PostConv for a DFlash2 drafter: :meth:`_sublayer`)."""
        w = self.weights.layers[i]
        h, out = self._sublayer(
            h, out, w.input_norm, w.attention_conv, lambda x: self._attention(i, x, cos, sin, kv, meta)
        )
        return self._sublayer(h, out, w.post_norm, w.mlp_conv, lambda x: self._mlp(i, x))

    def _mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Layer i's MLP, down(silu(gate(x)) · up(x)), with gate and up as one GEMM and the SwiGLU one launch
        (rounded where the module rounds). x (N, B, d) -> (N, B, d)."""
        return self.drafter.layers[i].mlp.down_proj(silu_mul(F.linear(x, self.weights.layers[i].gate_up)))

    @torch.no_grad()
    def hidden(self, ctx: DraftContext, anchor: torch.Tensor, kv_len: int | None = None) -> torch.Tensor:
        """The block [anchor, MASK × (B-1)] at positions lengths .. lengths+B-1 -> hidden (N, B, d) after norm.

        anchor (N,) long. kv_len: cache positions attended, ≥ max(lengths) + B (default all).
        """
        N, B = anchor.shape[0], self.block_size
        ids = torch.cat([anchor[:, None], self._masks.expand(N, -1)], dim=1)  # (N, B)
        h = self.drafter.embed_block(ids, self.target.embed).to(self.dtype)  # (N, B, d): the target's embedding
        meta = ctx.meta(B, kv_len)
        sliding = self.drafter.sliding_layers
        window_meta = ctx.meta(B, kv_len, window=self.config.sliding_window) if any(sliding) else None
        cos, sin = self._rope(ctx, meta.positions, h.dtype)
        out = None  # the residual stream is h + out: each add (and post-conv) is done by the next norm's launch
        for i in range(len(self.drafter.layers)):
            h, out = self._layer(i, h, out, cos, sin, ctx.kv, window_meta if sliding[i] else meta)
        return self._add_norm(h, out, self.weights.final_norm)[1]  # the last layer's post-conv runs here

    @torch.no_grad()
    def propose(
        self,
        ctx: DraftContext,
        anchor: torch.Tensor,
        params: SamplingParams,
        generator: torch.Generator | None = None,
        *,
        kv_len: int | None = None,
        argmax_drafts: bool = False,
    ) -> Proposal:
        """B-1 drafts per row after ``anchor`` (N,), and at T>0 the distribution they were drawn from.

        T=0 (or argmax_drafts): argmax of the drafter logits, or the selector's greedy path (at T>0 as a
        point mass). T>0: the selector's sampled path (sparse q over its k candidates; temperature only,
        as in the reference: any exact q is lossless), else a draw from warp_probs(logits) (dense q).
        """
        h = self.hidden(ctx, anchor, kv_len)[:, 1:]  # (N, P, d): slot k predicts the token at lengths + k
        logits = self.target.lm_head(h.to(self.target.lm_head.weight.dtype)).float()  # (N, P, V)
        selector = self.drafter.candidate_selector
        if params.greedy or argmax_drafts:
            tokens = selector_greedy_path(selector, h, logits, anchor) if selector is not None else logits.argmax(-1)
            return Proposal(tokens) if params.greedy else Proposal.point_mass(tokens)
        if selector is not None:
            return selector_sample_sparse(selector, h, logits, anchor, params.temperature, generator)
        # (N, P, V): the drafter's served logits (§3.4), the same warp as the target's p
        q = warp_probs(self.drafter.block_logits(h, self.target.lm_head, raw=logits), params)
        return Proposal(sample(q, generator), dense=q)
