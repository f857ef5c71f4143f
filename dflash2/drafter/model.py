"""DFlash / DFlash2 block-diffusion drafter (ARCHITECTURE.md §2, §3).

A stack of Qwen3-style decoder layers whose attention keys/values are the block's
own K/V *prepended* with K/V projected from the fused target context c (KV
injection). No embedding and no LM head: callers embed block tokens with the
target's frozen ``embed_tokens`` and apply the target's frozen ``lm_head``.

Shapes: N rows, L context positions, S block tokens (A blocks of B, concatenated),
d hidden, H / Hkv heads, hd head_dim, K·d_t concatenated target features.
State-dict keys are exactly the export names of §7 (+ §3 conv/selector keys).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dflash2.drafter.config import DrafterConfig
from dflash2.drafter.initialisation import draw_seed, initialise_drafter
from dflash2.drafter.local_conv import BlockLocalConv
from dflash2.drafter.masks import (
    compiled,
    context_padding_mask,
    dense_block_mask,
    flex_block_mask,
    sliding_window_mask,
)
from dflash2.drafter.rms_norm import rms_norm
from dflash2.drafter.selector import CandidateSelector, scale_logits


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    # drafter.norm_kernels: the forward and backward as the Triton kernels of norm_kernels.py where they run (set
    # on every norm of a drafter by set_norm_kernels; off by default, and the torch code wherever they cannot run)
    use_kernels: bool = False

    def forward(self, x):
        if self.use_kernels:
            from dflash2.drafter.norm_kernels import kernels_apply, rms_norm_kernels

            if kernels_apply(x, self.weight):
                return rms_norm_kernels(x, self.weight, self.eps)
        # fp32 statistics and product, one rounding back to the input dtype (bf16-safe): rms_norm_reference's
        # values and gradients, in fewer passes over the activation and keeping less of it (rms_norm.py)
        return rms_norm(x, self.weight, self.eps)


def set_norm_kernels(module: nn.Module, flag: bool) -> None:
    """Switch every RMSNorm inside ``module`` to (or from) the Triton kernels (``drafter.norm_kernels``)."""
    for m in module.modules():
        if isinstance(m, RMSNorm):
            m.use_kernels = bool(flag)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """Neox-style RoPE tables at absolute positions.

    positions (N, T) long -> cos, sin (N, 1, T, hd) in ``dtype``. Computed in fp32 on
    the fly (no buffer, so ``.to(bf16)`` can never degrade inv_freq).
    """
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    freqs = positions.float()[..., None] * inv_freq  # (N, T, hd/2)
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # (N, 1, T, hd): rotate-half layout
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x, cos, sin):
    """x (N, h, T, hd): rotate-half (neox / HF Qwen3 / vLLM is_neox_style=True).

    Result keeps x's dtype (under autocast q/k are bf16 and must match v for flex)."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


# fp32 tiles for flex on CUDA. torch's default fp32 forward tile on Hopper (torch 2.11: 64 x 64 keys, 3 stages
# for head dims it has no entry for, e.g. 192) needs 48 KiB of q plus 3 x 96 KiB of k and v in shared memory,
# more than the 227 KiB an SM has: the compile fails ("out of resource"). One stage of 64 queries x 32 keys fits
# every head dim up to 256 (64 + 2 x 32 KiB at 256); bf16 (autocast, the training default) keeps torch's tiles.
FP32_FLEX_TILES = {"BLOCK_M": 64, "BLOCK_N": 32, "num_stages": 1}


def _flex_attention(q, k, v, block_mask):
    """flex_attention, compiled once per process on CUDA, with symbolic lengths (``masks.compiled``: one
    compile for every context length); eager elsewhere: unfused, no backward; the CPU tests' forward only.

    q (N, H, S, hd), k/v (N, Hkv, L+S, hd) -> (N, H, S, hd). GQA by enable_gqa: the kernel
    maps each query head to its kv head, no (N, H, L+S, hd) copy of k and v."""
    from torch.nn.attention.flex_attention import flex_attention

    fn = compiled("flex_attention") if q.is_cuda else flex_attention
    options = FP32_FLEX_TILES if q.is_cuda and q.dtype == torch.float32 else None
    return fn(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1], kernel_options=options)


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.h, self.hkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        d = cfg.hidden_size
        self.q_proj = nn.Linear(d, self.h * self.hd, bias=False)
        self.k_proj = nn.Linear(d, self.hkv * self.hd, bias=False)
        self.v_proj = nn.Linear(d, self.hkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.h * self.hd, d, bias=False)
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps)

    def context_kv(self, x, cos, sin):
        """K (after k_norm + RoPE) and V of x (N, T, d) -> each (N, Hkv, T, hd).

        Used for the injected context c *and* for the block tokens: same projections.
        """
        N, T, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(N, T, self.hkv, self.hd)).transpose(1, 2)
        v = self.v_proj(x).view(N, T, self.hkv, self.hd).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask):
        """x (N, S, d) block tokens; ctx_k/ctx_v (N, Hkv, L, hd); mask (N, 1, S, L+S) bool
        or a flex BlockMask. Returns (N, S, d)."""
        N, S, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(N, S, self.h, self.hd)).transpose(1, 2)
        q = apply_rope(q, cos, sin)  # (N, H, S, hd)
        bk, bv = self.context_kv(x, cos, sin)  # (N, Hkv, S, hd)
        k = torch.cat([ctx_k.to(bk.dtype), bk], dim=2)  # (N, Hkv, L+S, hd): context first
        v = torch.cat([ctx_v.to(bv.dtype), bv], dim=2)
        if isinstance(mask, torch.Tensor):
            rep = self.h // self.hkv  # GQA: each kv head serves `rep` query heads
            k = k[:, :, None].expand(-1, -1, rep, -1, -1).flatten(1, 2)  # (N, H, L+S, hd)
            v = v[:, :, None].expand(-1, -1, rep, -1, -1).flatten(1, 2)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            o = _flex_attention(q, k, v, mask)  # GQA inside the kernel
        return self.o_proj(o.transpose(1, 2).reshape(N, S, self.h * self.hd))


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.block_size = cfg.block_size
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        conv = lambda: BlockLocalConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)  # noqa: E731
        # None (not an identity module) when off: v1 must have no conv parameters at all
        self.attention_conv = conv() if cfg.use_local_conv else None
        self.mlp_conv = conv() if cfg.use_local_conv else None

    def _sublayer(self, h, norm, conv, fn):
        x = norm(h)
        if conv is None:
            return h + fn(x)
        delta = conv.deltas(x)  # (N, S, 2, K, G) from the normed input, used by both sides
        y = fn(conv(x, 0, delta, self.block_size))  # pre-conv -> sub-layer
        return h + conv(y, 1, delta, self.block_size)  # post-conv on its output

    def forward(self, h, cos, sin, ctx_k, ctx_v, mask):
        h = self._sublayer(
            h, self.input_layernorm, self.attention_conv, lambda x: self.self_attn(x, cos, sin, ctx_k, ctx_v, mask)
        )
        return self._sublayer(h, self.post_attention_layernorm, self.mlp_conv, self.mlp)


class ContextCache:
    """Per-layer context K (after k_norm + RoPE) and V for decoding.

    Context K/V depend only on c (never on block tokens), so this cache only grows
    with *verified* context and never holds block K/V: nothing to crop after a
    rejected block. Batched rows may hold different context lengths: storage is
    (N, capacity, Hkv, hd) per layer with row n valid on slots < lengths[n];
    ``draft_block`` masks the tail slots. ``positions`` (N, capacity) keeps each
    slot's absolute position, which sliding-window layers measure distances from.
    """

    def __init__(self):
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.positions: torch.Tensor | None = None  # (N, capacity) long
        self.lengths: torch.Tensor | None = None  # (N,) long
        self.slots = 0  # host-side max(lengths): how many slots attention reads

    def _reserve(self, n_rows, need):
        cap = self.k[0].shape[1] if self.k else 0
        if need <= cap:
            return
        new_cap = max(need, 2 * cap, 64)  # amortised growth
        for store in (self.k, self.v):
            for i, old in enumerate(store):
                t = old.new_zeros(n_rows, new_cap, *old.shape[2:])
                t[:, :cap] = old
                store[i] = t
        pos = self.positions.new_zeros(n_rows, new_cap)
        pos[:, :cap] = self.positions
        self.positions = pos

    @torch.no_grad()
    def append(self, drafter: DFlashDrafter, new_context, positions, num_valid=None):
        """new_context (N, num_new, d) fused context (``drafter.fuse_context``), positions
        (N, num_new) absolute positions, num_valid (N,) long: how many of the num_new
        entries are real for each row (default all). Row n's entries are written at
        slots lengths[n]..; entries beyond num_valid[n] are left as masked garbage
        (overwritten later). Syncs once (max length) — fine for the reference decoder."""
        N, num_new, _ = new_context.shape
        dev = new_context.device
        if self.lengths is None:
            self.lengths = torch.zeros(N, dtype=torch.long, device=dev)
            self.positions = torch.zeros(N, 0, dtype=torch.long, device=dev)
            cfg = drafter.config
            for store in (self.k, self.v):
                store.extend(new_context.new_zeros(N, 0, cfg.num_key_value_heads, cfg.head_dim) for _ in drafter.layers)
        self._reserve(N, self.slots + num_new)
        rows = torch.arange(N, device=dev)[:, None]  # (N, 1)
        idx = self.lengths[:, None] + torch.arange(num_new, device=dev)  # (N, num_new) per-row offsets
        cos, sin = rope_cos_sin(positions, drafter.config.head_dim, drafter.config.rope_theta, new_context.dtype)
        for i, layer in enumerate(drafter.layers):
            k, v = layer.self_attn.context_kv(new_context, cos, sin)  # (N, Hkv, num_new, hd)
            self.k[i][rows, idx] = k.transpose(1, 2).to(self.k[i].dtype)
            self.v[i][rows, idx] = v.transpose(1, 2).to(self.v[i].dtype)
        self.positions[rows, idx] = positions.to(self.positions)
        add = num_new if num_valid is None else num_valid.to(self.lengths)
        self.lengths = self.lengths + add
        self.slots = int(self.lengths.max())

    def slot_positions(self) -> torch.Tensor:
        """(N, slots) absolute position of every readable slot (tail slots: garbage, masked)."""
        return self.positions[:, : self.slots]

    def layer_kv(self, i):
        """(N, Hkv, slots, hd) K and V of layer i."""
        return self.k[i][:, : self.slots].transpose(1, 2), self.v[i][:, : self.slots].transpose(1, 2)


class DFlashDrafter(nn.Module):
    """init_seed: seed of the initial weights (``dflash2.drafter.initialisation``): at the same seed the
    backbone is bitwise the same whichever DFlash2 additions are on. None = drawn from the global RNG
    (one draw), so ``torch.manual_seed(s); DFlashDrafter(cfg)`` is reproducible as well."""

    def __init__(self, config: DrafterConfig, init_seed: int | None = None):
        super().__init__()
        self.config = config.validate()
        c = config
        # nn.Linear runs its own random init while it is built, and how many of them there are depends
        # on the variant: built on a forked RNG, so the global RNG after the build does not depend on it.
        with torch.random.fork_rng(devices=[]):
            self.fc = nn.Linear(c.num_taps * c.target_hidden_size, c.hidden_size, bias=False)
            self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
            self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_hidden_layers))
            # which layers read the sliding-window mask (§2.4); a plain list: no parameters, no state-dict keys
            self.sliding_layers = [kind == "sliding_attention" for kind in c.layer_kinds]
            self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
            self.candidate_selector = (
                CandidateSelector(
                    c.vocab_size,
                    c.hidden_size,
                    c.selector_rank,
                    c.selector_top_k,
                    output_multiplier=c.output_multiplier,
                    final_logit_softcapping=c.final_logit_softcapping,
                )
                if c.use_selector
                else None
            )
        self.reset_parameters(init_seed)

    def reset_parameters(self, init_seed: int | None = None):
        if self.fc.weight.is_meta:  # built on "meta" by load_drafter: every value comes from the file
            return
        initialise_drafter(self, draw_seed() if init_seed is None else init_seed)

    def _rope(self, positions, dtype):
        return rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, dtype)

    # ------------------------------------------------------------------ core
    def fuse_context(self, taps: torch.Tensor) -> torch.Tensor:
        """taps (N, L, K·d_t) concatenated target features, any float dtype -> c (N, L, d).

        The taps are cast to the drafter's own dtype: a bf16 target feeds an fp32 drafter
        in training (fp32 master weights) and a bf16 or fp32 one when served. Under autocast
        (bf16-mixed training) ``fc`` casts its input to the autocast dtype itself, and a tap
        cast to fp32 first rounds back to the same value there, so the taps go in as they are:
        no fp32 copy of the (N, L, K·d_t) taps, the same result."""
        if not torch.is_autocast_enabled(taps.device.type):
            taps = taps.to(self.fc.weight.dtype)
        return self.hidden_norm(self.fc(taps))

    def embed_block(self, ids: torch.Tensor, embed_fn: Callable) -> torch.Tensor:
        """Block ids (N, S) -> (N, S, d): the target's frozen embedding times ``input_embedding_scale`` (§3.4)."""
        e = embed_fn(ids)
        scale = self.config.input_embedding_scale
        return e * scale if scale != 1.0 else e

    def block_logits(self, hidden: torch.Tensor, lm_head: Callable, raw: torch.Tensor | None = None) -> torch.Tensor:
        """Drafted hidden states (..., d) -> the drafter's logits (..., V): the target's LM head (or
        ``raw``, its output when already computed), then ``output_multiplier`` and
        ``final_logit_softcapping`` (§3.4; fp32 when either is set, the LM head's dtype otherwise).
        What training's CE and sampling at T > 0 read; argmax and top-k sets are the raw logits'."""
        c = self.config
        raw = lm_head(hidden) if raw is None else raw
        if c.output_multiplier == 1.0 and c.final_logit_softcapping is None:
            return raw
        return scale_logits(raw, c.output_multiplier, c.final_logit_softcapping)

    def forward(self, block_embeds, block_positions, context, context_positions, attn_mask, window_mask=None):
        """block_embeds (N, S, d) (S = A·B, blocks concatenated), block_positions (N, S),
        context (N, L, d) fused, context_positions (N, L), attn_mask (N, 1, S, L+S) bool
        (True = attend) or a flex BlockMask; window_mask: the same for sliding_attention layers
        (attn_mask AND the window, §2.4), needed only when the config has such layers.
        Returns hidden (N, S, d) after ``norm``."""
        assert window_mask is not None or not any(self.sliding_layers), "sliding_attention layers need window_mask"
        bcos, bsin = self._rope(block_positions, block_embeds.dtype)
        ccos, csin = self._rope(context_positions, context.dtype)
        h = block_embeds
        for layer, sliding in zip(self.layers, self.sliding_layers):
            ck, cv = layer.self_attn.context_kv(context, ccos, csin)  # (N, Hkv, L, hd)
            h = layer(h, bcos, bsin, ck, cv, window_mask if sliding else attn_mask)
        return self.norm(h)

    def training_forward(self, taps, input_ids, embed_fn: Callable, anchors, anchor_valid, use_flex: bool = False):
        """All blocks of each sequence in one pass.

        taps (N, L, K·d_t) target features at every position; input_ids (N, L);
        embed_fn: ids (N, S) -> (N, S, d) (the target's frozen embed_tokens);
        anchors (N, A) long positions in [0, L); anchor_valid (N, A) bool (padding
        anchors: any value, masked). Block j = [input_ids[anchor_j], MASK × (B-1)] at
        positions anchor_j .. anchor_j+B-1; it sees context < anchor_j and its own block.
        Returns hidden (N, A, B, d); position k (1..B-1) predicts input_ids[anchor_j + k]
        (labels: ``dflash2.drafter.objective.block_labels``).
        use_flex: FlexAttention over a ``BlockMask`` (block-sparse: cost in visited 128x128
        tiles; ``drafter.attention``, CUDA by default) instead of SDPA over the dense
        (N, 1, S, L+S) bool mask (O(S·(L+S)) memory and work; the CPU path and the reference).
        """
        N, L = input_ids.shape
        A, B = anchors.shape[1], self.config.block_size
        c = self.fuse_context(taps)  # (N, L, d)
        anchors = torch.where(anchor_valid, anchors, torch.zeros_like(anchors)).clamp(0, L - 1)
        ids = torch.full((N, A, B), self.config.mask_token_id, dtype=torch.long, device=input_ids.device)
        ids[:, :, 0] = input_ids.gather(1, anchors)  # the anchor token opens each block
        pos = anchors[:, :, None] + torch.arange(B, device=anchors.device)  # (N, A, B)
        embeds = self.embed_block(ids.view(N, A * B), embed_fn).to(c.dtype)  # (N, S, d)
        ctx_pos = torch.arange(L, device=input_ids.device).expand(N, L)
        W = self.config.sliding_window if any(self.sliding_layers) else None
        if use_flex:
            mask = flex_block_mask(anchors, anchor_valid, L, B)
            window_mask = flex_block_mask(anchors, anchor_valid, L, B, W) if W is not None else None
        else:
            mask = dense_block_mask(anchors, anchor_valid, L, B)  # (N, 1, S, L+S)
            window_mask = None
            if W is not None:
                keys = torch.cat([ctx_pos, pos.view(N, A * B)], dim=1)  # (N, L+S) absolute key positions
                window_mask = mask & sliding_window_mask(pos.view(N, A * B), keys, W)
        h = self.forward(embeds, pos.view(N, A * B), c, ctx_pos, mask, window_mask)  # (N, S, d)
        return h.view(N, A, B, -1)

    # ------------------------------------------------------------------ decoding
    def draft_block(self, block_embeds, block_positions, cache: ContextCache):
        """One block per row: block_embeds (N, B, d), block_positions (N, B).

        Bidirectional inside the block, all valid cached context visible (per-row
        lengths masked). Returns hidden (N, B, d).
        """
        _, T, _ = block_embeds.shape
        assert cache.lengths is not None, "ContextCache is empty: append the prefill context first"
        mask = context_padding_mask(cache.lengths, cache.slots, T)  # (N, 1, T, slots+T)
        window_mask = None
        if any(self.sliding_layers):
            keys = torch.cat([cache.slot_positions(), block_positions], dim=1)  # (N, slots+T)
            window_mask = mask & sliding_window_mask(block_positions, keys, self.config.sliding_window)
        cos, sin = self._rope(block_positions, block_embeds.dtype)
        h = block_embeds
        for i, (layer, sliding) in enumerate(zip(self.layers, self.sliding_layers)):
            ck, cv = cache.layer_kv(i)
            h = layer(h, cos, sin, ck, cv, window_mask if sliding else mask)
        return self.norm(h)

    @torch.no_grad()
    def drafted_tokens(self, hidden, lm_head: Callable, anchor_ids, temperature: float = 0.0, generator=None):
        """hidden (N, B, d) from ``draft_block``; positions 1..B-1 predict the token at
        the same position (no shift). T=0: tokens (N, B-1) by argmax (or the selector's
        greedy path). T>0: (tokens (N, B-1), q (N, B-1, V) fp32) sampled from
        softmax(block_logits / T) (or the selector's sampled path); q is the proposal for
        lossless rejection sampling (§4)."""
        h = hidden[:, 1:]  # (N, P, d)
        logits = lm_head(h).float()  # (N, P, V) raw: the selector scales its own top-k values
        sel = self.candidate_selector
        if temperature <= 0:  # argmax of the raw logits = argmax of the scaled ones (increasing map)
            return sel.greedy_path(h, logits, anchor_ids) if sel is not None else logits.argmax(-1)
        if sel is not None:
            return sel.sample_path(h, logits, anchor_ids, temperature, generator)
        q = torch.softmax(self.block_logits(h, lm_head, raw=logits) / temperature, dim=-1)
        tok = torch.multinomial(q.flatten(0, 1), 1, generator=generator).view(q.shape[:2])
        return tok, q
