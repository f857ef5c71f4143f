"""Target-cache rollback after a verify pass (ARCHITECTURE.md §5.4): attention cropped, GDN restored + replayed.

For every accepted length 0..B-1 (keep = accepted + 1 = 1..B committed tokens),
the cache after rollback must equal the cache of plain token-by-token decoding of
the same tokens: GDN conv + recurrent states within fp32 rounding (the replay uses
the chunked kernel, decoding the recurrent one), attention KV of the right length.
"""

import copy

import pytest
import torch

from dflash2.decoding.target_state import (
    attention_kv,
    cache_seq_len,
    crop_attention,
    gdn_state,
    restore,
    rollback,
    snapshot,
)

B, P = 8, 6
# Replay (chunked kernel, B-token GEMMs) vs decoding (recurrent kernel, 1-token GEMMs) differ by fp32
# rounding: measured max |diff| / max |ref| = 1e-7 (first GDN layer) .. 1.2e-6 (third); a wrong state
# (a token too many or too few) is off by O(1) of that scale.
REL = 1e-5
TOL = dict(rtol=1e-5, atol=1e-5)


def _states(target, cache):
    """{layer: tensors} clones: (conv, recurrent) for GDN layers, (K, V) for attention layers."""
    out = {}
    for i, kind in enumerate(target.layer_types):
        pair = gdn_state(cache, i) if kind == "linear_attention" else attention_kv(cache, i)
        out[i] = tuple(t.clone() for t in pair)
    return out


def _assert_states_close(target, got, ref):
    for i, kind in enumerate(target.layer_types):
        for g, r in zip(got[i], ref[i]):
            assert g.shape == r.shape, (i, kind)
            err, scale = (g - r).abs().max().item(), r.abs().max().item()
            assert err <= REL * scale, f"layer {i} ({kind}): max |diff| {err:.2e} vs scale {scale:.2e}"


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3"])
def case(request, spec_targets):
    """Prefilled cache for 2 rows, a verify block, and the token-by-token reference states after each token."""
    target = spec_targets[request.param]
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 100, (2, P), generator=g)
    block = torch.randint(0, 100, (2, B), generator=g)  # [anchor, d_1 .. d_7]: arbitrary tokens
    prefilled = target(prompt, use_cache=True).past_key_values
    ref_cache = copy.deepcopy(prefilled)
    ref_states, ref_logits = [_states(target, ref_cache)], []
    for t in range(B):  # plain decoding, one token per forward
        out = target(block[:, t : t + 1], past_key_values=ref_cache, use_cache=True)
        ref_states.append(_states(target, ref_cache))
        ref_logits.append(out.logits[:, -1])
    return target, prefilled, block, ref_states, ref_logits


@pytest.mark.parametrize("accepted", range(B))
def test_rollback_equals_token_by_token_decoding(case, accepted):
    target, prefilled, block, ref_states, ref_logits = case
    keep = accepted + 1  # anchor + accepted drafts; accepted = 0 still commits one token's state
    cache = copy.deepcopy(prefilled)
    snap = snapshot(cache, target.layer_types)
    verify = target(block, past_key_values=cache, use_cache=True)
    torch.testing.assert_close(verify.logits[:, keep - 1], ref_logits[keep - 1], **TOL)
    rollback(target, cache, snap, block, keep=keep)

    assert cache_seq_len(cache, target.layer_types) == P + keep
    _assert_states_close(target, _states(target, cache), ref_states[keep])
    if target.has_linear_attention and keep < B:  # the rollback really changed the post-verify state
        i = target.layer_types.index("linear_attention")
        post = ref_states[B][i][1]
        assert (gdn_state(cache, i)[1] - post).abs().max() > 100 * REL * post.abs().max()
    # decoding continues from the committed prefix exactly like plain decoding would
    if keep < B:
        nxt = target(block[:, keep : keep + 1], past_key_values=cache, use_cache=True)
        torch.testing.assert_close(nxt.logits[:, -1], ref_logits[keep], **TOL)
        assert torch.equal(nxt.logits[:, -1].argmax(-1), ref_logits[keep].argmax(-1))


def test_snapshot_is_a_copy_and_restore_is_exact(spec_targets):
    target = spec_targets["qwen3_5"]
    cache = target(torch.arange(1, P + 1)[None], use_cache=True).past_key_values
    before = _states(target, cache)
    snap = snapshot(cache, target.layer_types)
    target(torch.arange(10, 10 + B)[None], past_key_values=cache, use_cache=True)  # HF updates GDN states in place
    i = target.layer_types.index("linear_attention")
    assert not torch.equal(gdn_state(cache, i)[1], before[i][1])
    assert torch.equal(snap.gdn[i][1], before[i][1])  # the snapshot did not move with the live state
    restore(cache, target.layer_types, snap)
    after = _states(target, cache)
    for j in before:
        for a, b in zip(after[j], before[j]):
            assert torch.equal(a, b)


class _LegacyHybridCache:
    """The older per-model hybrid cache layout: per-layer lists instead of ``cache.layers``."""

    def __init__(self, n_rows=1):
        g = torch.Generator().manual_seed(0)
        self.key_cache = [None, torch.randn(n_rows, 2, 9, 4, generator=g)]
        self.value_cache = [None, torch.randn(n_rows, 2, 9, 4, generator=g)]
        self.conv_states = [torch.randn(n_rows, 6, 4, generator=g), None]
        self.recurrent_states = [torch.randn(n_rows, 2, 3, 3, generator=g), None]


def test_legacy_cache_layout_is_supported():
    types = ["linear_attention", "full_attention"]
    cache = _LegacyHybridCache()
    k0, conv0, rec0 = cache.key_cache[1].clone(), cache.conv_states[0].clone(), cache.recurrent_states[0].clone()
    snap = snapshot(cache, types)
    assert snap.seq_len == 9 and set(snap.gdn) == {0}
    cache.conv_states[0].add_(1.0)
    cache.recurrent_states[0].mul_(3.0)
    cache.key_cache[1] = torch.cat([cache.key_cache[1], torch.zeros(1, 2, 4, 4)], dim=2)
    cache.value_cache[1] = torch.cat([cache.value_cache[1], torch.zeros(1, 2, 4, 4)], dim=2)
    restore(cache, types, snap)
    assert torch.equal(cache.key_cache[1], k0) and cache.value_cache[1].shape[2] == 9
    assert torch.equal(cache.conv_states[0], conv0) and torch.equal(cache.recurrent_states[0], rec0)
    crop_attention(cache, types, 3)
    assert cache_seq_len(cache, types) == 6 and torch.equal(cache.key_cache[1], k0[:, :, :6])
