"""Snapshot / rollback of the target's HF cache after a verify pass (ARCHITECTURE.md §5.4).

A verify pass feeds the T = B block tokens ``[anchor, d_1 .. d_{B-1}]`` through
the target with its cache, so afterwards the cache holds all T. Only the first
``keep = accepted + 1`` (anchor + accepted drafts) are committed; the rest must go:

* attention layers (any softmax attention; KV (N, h, L, d)): crop the last
  ``T - keep`` positions;
* Gated DeltaNet layers (conv state (N, conv_dim, K) and recurrent state
  (N, H, dk, dv) fp32, both overwritten in place by HF): the post-verify state
  has folded in all T tokens and cannot be cut. This reference path restores
  the pre-verify states saved by :func:`snapshot` and *replays* the ``keep``
  committed tokens through the plain-PyTorch HF target forward (attention layers
  first cropped back to the pre-verify length, so they are recomputed too).
  Replay states equal token-by-token decoding up to fp32 rounding (the chunked
  kernel sums in another order than the recurrent one). Cost: one extra target
  forward of ``keep`` tokens per step with a rejection, plus T×state memory
  for the snapshot. The Triton ReplaySSM kernels (fold the logged k, u, g of the
  accepted tokens into the untouched pre-verify state, §5) replace this in the
  runtime issue; this module is the reference they are tested against.

Two HF cache layouts are handled: transformers >= 5.2x's ``DynamicCache`` whose
``cache.layers[i]`` is a ``DynamicLayer`` (``.keys/.values``) or a
``LinearAttentionLayer`` (``.conv_states[0]`` / ``.recurrent_states[0]``), and
the older per-model hybrid caches with ``key_cache / value_cache /
conv_states / recurrent_states`` lists indexed by layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

ATTENTION, GDN = "full_attention", "linear_attention"


@dataclass
class CacheSnapshot:
    """What a rollback needs: the pre-verify length and clones of every GDN state.

    seq_len: committed positions before the verify pass.
    gdn: {layer index: (conv (N, conv_dim, K), recurrent (N, H, dk, dv))}, cloned.
    """

    seq_len: int
    gdn: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


# ----------------------------------------------------------------- layout access
def _layered(cache) -> bool:
    return hasattr(cache, "layers") and not hasattr(cache, "key_cache")


def attention_kv(cache, i: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(keys, values) (N, h, L, d) of attention layer i, or (None, None) before its first use."""
    if _layered(cache):
        layer = cache.layers[i]
        return getattr(layer, "keys", None), getattr(layer, "values", None)
    return cache.key_cache[i], cache.value_cache[i]


def _set_attention_kv(cache, i: int, k: torch.Tensor, v: torch.Tensor) -> None:
    if _layered(cache):
        cache.layers[i].keys, cache.layers[i].values = k, v
    else:
        cache.key_cache[i], cache.value_cache[i] = k, v


def gdn_state(cache, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(conv (N, conv_dim, K), recurrent (N, H, dk, dv)) of GDN layer i: live tensors, not copies."""
    if _layered(cache):
        layer = cache.layers[i]
        return layer.conv_states[0], layer.recurrent_states[0]
    return cache.conv_states[i], cache.recurrent_states[i]


def _set_gdn_state(cache, i: int, conv: torch.Tensor, rec: torch.Tensor) -> None:
    """Write the states back *in place* when shapes match (keeps static addresses for CUDA graphs)."""
    cur_conv, cur_rec = gdn_state(cache, i)
    if cur_conv is not None and cur_conv.shape == conv.shape and cur_rec is not None and cur_rec.shape == rec.shape:
        cur_conv.copy_(conv)
        cur_rec.copy_(rec)
    elif _layered(cache):
        cache.layers[i].conv_states[0], cache.layers[i].recurrent_states[0] = conv.clone(), rec.clone()
    else:
        cache.conv_states[i], cache.recurrent_states[i] = conv.clone(), rec.clone()


def cache_seq_len(cache, layer_types: list[str]) -> int:
    """Committed positions, read from the first attention layer (GDN layers have no length)."""
    for i, kind in enumerate(layer_types):
        if kind == ATTENTION:
            k, _ = attention_kv(cache, i)
            return 0 if k is None or k.numel() == 0 else int(k.shape[-2])
    return 0  # no attention layer (pure GDN): nothing has a length to crop


# ----------------------------------------------------------------- operations
def crop_attention(cache, layer_types: list[str], remove: int) -> None:
    """Drop the last ``remove`` positions of every attention layer's KV (in the layer's own tensors).

    Sliced directly rather than through ``cache.crop``: on hybrid caches that also
    "crops" the GDN layers, which transformers refuses unless it recorded the past.
    """
    if remove <= 0:
        return
    for i, kind in enumerate(layer_types):
        if kind != ATTENTION:
            continue
        k, v = attention_kv(cache, i)
        if k is None or k.numel() == 0:
            continue
        _set_attention_kv(cache, i, k[..., : k.shape[-2] - remove, :], v[..., : v.shape[-2] - remove, :])


def snapshot(cache, layer_types: list[str]) -> CacheSnapshot:
    """Before a verify pass: the committed length and clones of the GDN states (none for pure attention)."""
    gdn = {}
    for i, kind in enumerate(layer_types):
        if kind == GDN:
            conv, rec = gdn_state(cache, i)
            gdn[i] = (conv.clone(), rec.clone())
    return CacheSnapshot(seq_len=cache_seq_len(cache, layer_types), gdn=gdn)


def restore(cache, layer_types: list[str], snap: CacheSnapshot) -> None:
    """Put the cache back exactly as it was at ``snapshot``: crop attention, copy GDN states back."""
    crop_attention(cache, layer_types, cache_seq_len(cache, layer_types) - snap.seq_len)
    for i, (conv, rec) in snap.gdn.items():
        _set_gdn_state(cache, i, conv, rec)


def rollback(target, cache, snap: CacheSnapshot, verify_ids: torch.Tensor, keep: int) -> None:
    """Leave ``cache`` holding the pre-verify prefix + the first ``keep`` of ``verify_ids``.

    target: the ``TargetModel`` that ran the verify; verify_ids (N, T) the verified
    tokens (all rows keep the same count: the reference decoder keeps one cache per
    sequence); keep in [1, T]. Attention-only targets: crop T - keep. Hybrids:
    restore the snapshot and replay verify_ids[:, :keep] (see the module docstring).
    keep == T needs nothing: the verify state *is* the committed state.
    """
    T = verify_ids.shape[1]
    if not 1 <= keep <= T:
        raise ValueError(f"keep={keep} must be in [1, {T}]")
    if keep == T:
        return
    if not snap.gdn:
        crop_attention(cache, target.layer_types, T - keep)
        return
    restore(cache, target.layer_types, snap)
    target(verify_ids[:, :keep], past_key_values=cache, use_cache=True)  # replay; logits/taps unused
