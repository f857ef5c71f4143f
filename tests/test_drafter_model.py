"""DFlashDrafter: ARCHITECTURE.md §7.2 state-dict keys, training forward == decoding, cache, drafting, config."""

import dataclasses
import math

import pytest
import torch

from dflash2.drafter import ContextCache, DFlashDrafter, DrafterConfig
from dflash2.drafter.model import apply_rope, rope_cos_sin
from dflash2.errors import DFlash2Error

V, D, DT, B = 96, 32, 16, 4


def tiny(**kw):
    base = dict(
        hidden_size=D,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        rope_theta=10000.0,
        max_position_embeddings=256,
        vocab_size=V,
        target_hidden_size=DT,
        target_layer_ids=[0, 2],
        mask_token_id=V - 1,
        block_size=B,
        conv_group_size=8,
        selector_rank=8,
        selector_top_k=5,
    )
    base.update(kw)
    return DrafterConfig(**base)


def randomized(cfg, seed=0):
    """A drafter whose conv/selector are far from their identity/small init."""
    torch.manual_seed(seed)
    m = DFlashDrafter(cfg)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "conv" in name or "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return m.eval()


V1_KEYS = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
    f"layers.{i}.{k}.weight"
    for i in range(2)
    for k in [
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "self_attn.q_norm",
        "self_attn.k_norm",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
        "input_layernorm",
        "post_attention_layernorm",
    ]
}


def test_v1_has_exactly_the_dflash_keys():
    m = DFlashDrafter(tiny())
    sd = m.state_dict()
    assert set(sd) == V1_KEYS
    assert sd["fc.weight"].shape == (D, 2 * DT)
    assert not any("conv" in n or "selector" in n for n, _ in m.named_parameters())
    assert all(mod.bias is None for mod in m.modules() if isinstance(mod, torch.nn.Linear))


def test_v2_adds_exactly_the_conv_and_selector_keys():
    m = DFlashDrafter(tiny(use_local_conv=True, use_selector=True))
    sd = m.state_dict()
    groups = D // 8
    extra = {
        "candidate_selector.predecessor_codebook": (V, 8),
        "candidate_selector.successor_codebook": (V, 8),
        "candidate_selector.hidden_projection.weight": (8, D),
    }
    for i in range(2):
        for c in ("attention_conv", "mlp_conv"):
            extra[f"layers.{i}.{c}.base_kernel"] = (2, 2, D)
            extra[f"layers.{i}.{c}.kernel_projection.weight"] = (2 * 2 * groups, D)
    assert set(sd) == V1_KEYS | set(extra)
    for k, shape in extra.items():
        assert tuple(sd[k].shape) == shape, k


def test_v2_at_init_equals_v1():
    """Identity conv at init: a fresh DFlash2 backbone computes DFlash v1."""
    torch.manual_seed(0)
    v1 = DFlashDrafter(tiny()).eval()
    v2 = DFlashDrafter(tiny(use_local_conv=True)).eval()
    v2.load_state_dict(v1.state_dict(), strict=False)
    emb = torch.nn.Embedding(V, D)
    args = (
        torch.randn(1, 12, 2 * DT),
        torch.randint(0, V, (1, 12)),
        emb,
        torch.tensor([[3, 7]]),
        torch.tensor([[True, True]]),
    )
    torch.testing.assert_close(v1.training_forward(*args), v2.training_forward(*args))


def _setup(seed=0, L=14):
    g = torch.Generator().manual_seed(seed)
    taps = torch.randn(1, L, 2 * DT, generator=g)
    ids = torch.randint(0, V - 1, (1, L), generator=g)
    emb = torch.nn.Embedding(V, D)
    return taps, ids, emb


SLIDING = dict(layer_types=["sliding_attention", "full_attention"], input_embedding_scale=0.5)


@pytest.mark.parametrize(
    "kw",
    [
        {},
        dict(use_local_conv=True, use_selector=True),
        dict(SLIDING, sliding_window=3),  # W < B: the window also cuts inside the block
        dict(SLIDING, sliding_window=6, use_local_conv=True),
    ],
    ids=["v1", "v2", "window3", "window6"],
)
@torch.no_grad()
def test_training_forward_equals_draft_block(kw):
    cfg = tiny(**kw)
    m = randomized(cfg)
    taps, ids, emb = _setup()
    anchors = torch.tensor([[0, 5, 9, 13, 2]])  # includes anchor 0 (no context) and the last position
    valid = torch.tensor([[True, True, True, True, False]])
    h = m.training_forward(taps, ids, emb, anchors, valid)  # (1, A, B, d)
    assert h.shape == (1, 5, B, D)
    c = m.fuse_context(taps)
    for j in range(4):
        a = int(anchors[0, j])
        cache = ContextCache()
        cache.append(m, c[:, :a], torch.arange(a)[None])
        blk = torch.full((1, B), cfg.mask_token_id)
        blk[0, 0] = ids[0, a]
        out = m.draft_block(m.embed_block(blk, emb), torch.arange(a, a + B)[None], cache)
        torch.testing.assert_close(out, h[:, j], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("W", [3, 6])
@torch.no_grad()
def test_sliding_layers_see_keys_within_the_window_only(W):
    """|query − key position| < W: context at or before anchor − W is invisible to the whole block
    (its first query sits at the anchor); context after it is not. Checked in training and decoding."""
    m = randomized(tiny(layer_types=["sliding_attention"] * 2, sliding_window=W))
    taps, ids, emb = _setup(L=16)
    a = 12
    anchors, valid = torch.tensor([[a]]), torch.tensor([[True]])
    base = m.training_forward(taps, ids, emb, anchors, valid)
    far, near = taps.clone(), taps.clone()
    far[:, : a - W + 1] += torch.randn_like(far[:, : a - W + 1])
    near[:, a - W + 1 : a] += torch.randn_like(near[:, a - W + 1 : a])
    torch.testing.assert_close(m.training_forward(far, ids, emb, anchors, valid), base)
    assert not torch.allclose(m.training_forward(near, ids, emb, anchors, valid), base)
    blk = torch.full((1, B), m.config.mask_token_id)
    blk[0, 0] = ids[0, a]
    for t, same in ((far, True), (near, False)):
        cache = ContextCache()
        cache.append(m, m.fuse_context(t[:, :a]), torch.arange(a)[None])
        out = m.draft_block(m.embed_block(blk, emb), torch.arange(a, a + B)[None], cache)
        assert torch.allclose(out, base[:, 0], atol=1e-5) == same
    # a full-attention layer in the stack sees all of it
    mixed = randomized(tiny(layer_types=["sliding_attention", "full_attention"], sliding_window=W))
    assert not torch.allclose(
        mixed.training_forward(far, ids, emb, anchors, valid), mixed.training_forward(taps, ids, emb, anchors, valid)
    )


@torch.no_grad()
def test_block_ignores_context_at_or_after_anchor_and_other_blocks():
    m = randomized(tiny(use_local_conv=True))
    taps, ids, emb = _setup(L=16)
    anchors, valid = torch.tensor([[6, 11]]), torch.tensor([[True, True]])
    base = m.training_forward(taps, ids, emb, anchors, valid)
    taps2, ids2 = taps.clone(), ids.clone()
    taps2[:, 6:] += torch.randn_like(taps2[:, 6:])
    ids2[:, 7:] = (ids2[:, 7:] + 1) % (V - 1)  # everything after anchor 0 except its own token
    out = m.training_forward(taps2, ids2, emb, anchors, valid)
    torch.testing.assert_close(out[:, 0], base[:, 0])
    assert not torch.allclose(out[:, 1], base[:, 1])  # block 1 does see context 6..10
    out = m.training_forward(taps, ids, emb, torch.tensor([[6, 2]]), valid)  # move the other block
    torch.testing.assert_close(out[:, 0], base[:, 0])


@torch.no_grad()
def test_batched_cache_with_ragged_lengths_matches_rows():
    m = randomized(tiny(use_local_conv=True))
    g = torch.Generator().manual_seed(1)
    c = torch.randn(2, 9, D, generator=g)
    pos = torch.arange(9).expand(2, 9)
    # batched: two appends with per-row valid counts -> lengths (3+4, 3+1)
    cache = ContextCache()
    cache.append(m, c[:, :3], pos[:, :3])
    nxt = torch.stack([c[0, 3:7], torch.cat([c[1, 3:4], torch.randn(3, D, generator=g)])])
    cache.append(m, nxt, pos[:, 3:7], num_valid=torch.tensor([4, 1]))
    assert cache.lengths.tolist() == [7, 4] and cache.slots == 7
    blk = torch.randn(2, B, D, generator=g)
    bpos = torch.stack([torch.arange(7, 7 + B), torch.arange(4, 4 + B)])
    out = m.draft_block(blk, bpos, cache)
    for n, L in enumerate([7, 4]):
        single = ContextCache()
        single.append(m, c[n : n + 1, :L], pos[n : n + 1, :L])
        torch.testing.assert_close(
            out[n : n + 1], m.draft_block(blk[n : n + 1], bpos[n : n + 1], single), atol=1e-5, rtol=1e-5
        )


@torch.no_grad()
def test_drafted_tokens():
    torch.manual_seed(0)
    lm_head = torch.nn.Linear(D, V, bias=False)
    hidden = torch.randn(3, B, D)
    anchor = torch.randint(0, V, (3,))
    v1 = DFlashDrafter(tiny())
    assert torch.equal(v1.drafted_tokens(hidden, lm_head, anchor), lm_head(hidden[:, 1:]).argmax(-1))
    tok, q = v1.drafted_tokens(hidden, lm_head, anchor, temperature=0.7, generator=torch.Generator().manual_seed(0))
    assert tok.shape == (3, B - 1) and q.shape == (3, B - 1, V)
    torch.testing.assert_close(q, torch.softmax(lm_head(hidden[:, 1:]) / 0.7, -1))
    v2 = DFlashDrafter(tiny(use_selector=True))
    sel = v2.candidate_selector
    h = hidden[:, 1:]
    assert torch.equal(v2.drafted_tokens(hidden, lm_head, anchor), sel.greedy_path(h, lm_head(h), anchor))
    tok, q = v2.drafted_tokens(hidden, lm_head, anchor, temperature=1.0)
    torch.testing.assert_close(q.sum(-1), torch.ones(3, B - 1))
    assert (q.gather(-1, tok[..., None]) > 0).all()


@torch.no_grad()
def test_serving_scales_in_drafting():
    """output_multiplier then softcap on the logits (T > 0 samples them; T = 0 argmax is unchanged);
    input_embedding_scale on the block embeddings; the selector scales its top-k values the same way."""
    torch.manual_seed(0)
    lm_head = torch.nn.Linear(D, V, bias=False)
    torch.nn.init.normal_(lm_head.weight, std=5.0)  # logits well inside the cap's curved range
    hidden, anchor = torch.randn(3, B, D), torch.randint(0, V, (3,))
    raw = lm_head(hidden[:, 1:])
    scaled = 7.0 * torch.tanh(raw * 0.5 / 7.0)
    m = DFlashDrafter(tiny(output_multiplier=0.5, final_logit_softcapping=7.0, input_embedding_scale=3.0))
    torch.testing.assert_close(m.block_logits(hidden[:, 1:], lm_head), scaled)
    assert torch.equal(m.drafted_tokens(hidden, lm_head, anchor), raw.argmax(-1))
    _, q = m.drafted_tokens(hidden, lm_head, anchor, temperature=0.7)
    torch.testing.assert_close(q, torch.softmax(scaled / 0.7, -1))
    emb = torch.nn.Embedding(V, D)
    ids = torch.randint(0, V, (2, B))
    torch.testing.assert_close(m.embed_block(ids, emb), 3.0 * emb(ids))
    sel = DFlashDrafter(tiny(use_selector=True, output_multiplier=0.5, final_logit_softcapping=7.0)).candidate_selector
    cand, unary = sel.candidates(raw)
    assert torch.equal(cand, raw.topk(5).indices)
    torch.testing.assert_close(unary, scaled.gather(-1, cand))


def test_rope_is_neox_rotate_half():
    hd, theta = 8, 10000.0
    x = torch.randn(1, 1, 1, hd)
    cos, sin = rope_cos_sin(torch.tensor([[5]]), hd, theta, torch.float32)
    y = apply_rope(x, cos, sin)[0, 0, 0]
    for i in range(hd // 2):  # pair (i, i + hd/2) rotated by 5 * theta^(-2i/hd)
        ang = 5 * theta ** (-2 * i / hd)
        a, b = x[0, 0, 0, i], x[0, 0, 0, i + hd // 2]
        assert math.isclose(y[i], a * math.cos(ang) - b * math.sin(ang), abs_tol=1e-5)
        assert math.isclose(y[i + hd // 2], b * math.cos(ang) + a * math.sin(ang), abs_tol=1e-5)


def test_config_validation_and_roundtrip():
    cfg = tiny(use_local_conv=True, use_selector=True)
    assert DrafterConfig.from_dict(cfg.to_dict()) == cfg and cfg.num_taps == 2
    windowed = tiny(layer_types=["sliding_attention", "full_attention"], sliding_window=5, output_multiplier=0.2)
    assert DrafterConfig.from_dict(windowed.to_dict()) == windowed
    assert windowed.has_sliding_layers and windowed.serving_scales == {"output_multiplier": 0.2}
    assert cfg.layer_kinds == ["full_attention"] * 2 and not cfg.has_sliding_layers and cfg.serving_scales == {}
    bad = [
        dict(mask_token_id=V),
        dict(block_size=1),
        dict(num_key_value_heads=3),
        dict(use_local_conv=True, conv_group_size=12),
        dict(target_layer_ids=[]),
        dict(use_selector=True, selector_top_k=V + 1),
        dict(layer_types=["sliding_attention"]),  # one entry for two layers
        dict(layer_types=["full_attention", "causal_attention"]),
        dict(layer_types=["sliding_attention"] * 2),  # no window
        dict(layer_types=["sliding_attention"] * 2, sliding_window=0),
        dict(sliding_window=8),  # a window no layer reads
        dict(output_multiplier=-1.0),  # would reverse the candidate order
        dict(input_embedding_scale=float("nan")),
        dict(final_logit_softcapping=0.0),  # "no cap" is null
    ]
    for kw in bad:
        with pytest.raises(DFlash2Error):
            DFlashDrafter(dataclasses.replace(cfg, **kw))
    with pytest.raises(DFlash2Error, match="hiden_size"):
        DrafterConfig.from_dict({**cfg.to_dict(), "hiden_size": 3})
