"""Block-sparse training masks: exact semantics (ARCHITECTURE.md §2.6) and flex == dense."""

import pytest
import torch

from dflash2.drafter import DFlashDrafter, DrafterConfig, block_mask_mod, dense_block_mask
from dflash2.drafter.masks import sliding_window_mask


def loop_mask(anchors, valid, L, B):
    N, A = anchors.shape
    S = A * B
    m = torch.zeros(N, 1, S, L + S, dtype=torch.bool)
    for n in range(N):
        for j in range(A):
            for r in range(j * B, j * B + B):
                for p in range(L):
                    m[n, 0, r, p] = bool(valid[n, j]) and p < int(anchors[n, j])
                for s in range(j * B, j * B + B):
                    m[n, 0, r, L + s] = True
    return m


def random_anchors(N=3, A=5, L=17, seed=0):
    g = torch.Generator().manual_seed(seed)
    anchors = torch.randint(0, L, (N, A), generator=g)
    valid = torch.rand(N, A, generator=g) > 0.3
    valid[:, 0] = True
    return anchors, valid


def test_dense_mask_matches_loop():
    L, B = 17, 4
    anchors, valid = random_anchors(L=L)
    m = dense_block_mask(anchors, valid, L, B)
    assert m.shape == (3, 1, 5 * B, L + 5 * B) and m.dtype == torch.bool
    assert torch.equal(m, loop_mask(anchors, valid, L, B))
    assert m.any(-1).all(), "every row must see at least one key (no NaN softmax)"


def test_padded_anchor_sees_only_its_block():
    L, B = 10, 3
    anchors = torch.tensor([[5, 9]])
    valid = torch.tensor([[True, False]])
    m = dense_block_mask(anchors, valid, L, B)[0, 0]
    assert not m[B:, :L].any()  # padded block: no context
    assert m[B:, L + B :].all() and not m[B:, L : L + B].any()  # own block only
    assert m[:B, :5].all() and not m[:B, 5:L].any()  # valid block: context < 5


def test_mask_mod_matches_dense_on_cpu():
    # evaluate the flex mask_mod on a broadcast index grid (what create_mask does via
    # vmap, without its multi-second tracing cost)
    L, B = 11, 4
    anchors, valid = random_anchors(N=2, A=3, L=L, seed=1)
    S = 3 * B
    b = torch.arange(2)[:, None, None, None]
    h = torch.zeros(1, 1, 1, 1, dtype=torch.long)
    q = torch.arange(S)[None, None, :, None]
    kv = torch.arange(L + S)[None, None, None, :]
    flexm = block_mask_mod(anchors, valid, L, B)(b, h, q, kv)
    assert torch.equal(flexm.expand(2, 1, S, L + S), dense_block_mask(anchors, valid, L, B))


@pytest.mark.parametrize("W", [1, 3, 6])
def test_sliding_window_masks_match_a_loop(W):
    """|q − k| < W on absolute positions, the dense form (mask AND window) and the flex mask_mod."""
    L, B = 11, 4
    anchors, valid = random_anchors(N=2, A=3, L=L, seed=2)
    S = 3 * B
    q_pos = (anchors[:, :, None] + torch.arange(B)).view(2, S)  # (N, S)
    keys = torch.cat([torch.arange(L).expand(2, L), q_pos], dim=1)  # (N, L+S)
    dense = dense_block_mask(anchors, valid, L, B) & sliding_window_mask(q_pos, keys, W)
    for n in range(2):
        for i in range(S):
            for k in range(L + S):
                inside = abs(int(q_pos[n, i]) - int(keys[n, k])) < W
                assert bool(dense[n, 0, i, k]) == (bool(dense_block_mask(anchors, valid, L, B)[n, 0, i, k]) and inside)
    assert dense[:, 0].any(-1).all()  # every query still sees itself
    b = torch.arange(2)[:, None, None, None]
    h = torch.zeros(1, 1, 1, 1, dtype=torch.long)
    q = torch.arange(S)[None, None, :, None]
    kv = torch.arange(L + S)[None, None, None, :]
    flexm = block_mask_mod(anchors, valid, L, B, W)(b, h, q, kv)
    assert torch.equal(flexm.expand(2, 1, S, L + S), dense)


@pytest.mark.cuda
@pytest.mark.parametrize("window", [None, 5, 24])
def test_flex_vs_dense_model_outputs(window):
    torch.manual_seed(0)
    cfg = DrafterConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        max_position_embeddings=1024,
        vocab_size=128,
        target_hidden_size=32,
        target_layer_ids=[0, 1],
        mask_token_id=127,
        block_size=8,
        use_local_conv=True,
        use_selector=True,
        selector_rank=16,
        selector_top_k=4,
        layer_types=None if window is None else ["sliding_attention", "full_attention"],
        sliding_window=window,
    )
    dev = "cuda"
    m = DFlashDrafter(cfg).to(dev)
    emb = torch.nn.Embedding(128, 64).to(dev)
    N, L, A = 2, 200, 20
    taps = torch.randn(N, L, 64, device=dev)
    ids = torch.randint(0, 128, (N, L), device=dev)
    anchors = torch.randint(0, L, (N, A), device=dev)
    valid = torch.rand(N, A, device=dev) > 0.2
    dense = m.training_forward(taps, ids, emb, anchors, valid, use_flex=False)
    flex = m.training_forward(taps, ids, emb, anchors, valid, use_flex=True)
    ok = valid[:, :, None, None]
    torch.testing.assert_close(flex * ok, dense * ok, atol=2e-3, rtol=2e-3)
    assert torch.isfinite(flex).all()
