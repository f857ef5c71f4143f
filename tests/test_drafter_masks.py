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


# --------------------------------------------------------------------- FlexAttention in training (issue 15)
def ragged_anchors(N, A, L, valid_counts, seed=0):
    """Anchors as training draws them (sorted, padding last) with a different number of valid
    anchors per row: valid_counts (N,) ints <= A."""
    from dflash2.drafter.objective import sample_anchors

    loss_mask = torch.zeros(N, L, dtype=torch.long)
    for n, count in enumerate(valid_counts):
        loss_mask[n, L - count - 1 :] = 1  # count + 1 response tokens: exactly count eligible anchors
    anchors, valid = sample_anchors(loss_mask, A, torch.Generator().manual_seed(seed))
    assert valid.sum(1).tolist() == [min(c, A) for c in valid_counts]
    return anchors, valid


@pytest.mark.parametrize("W", [None, 3, 9])
def test_mask_mod_on_every_pair_equals_the_dense_mask(W):
    """create_mask evaluates the mask_mod on all (b, q, kv) pairs as create_block_mask does:
    exactly the dense boolean mask (AND the sliding window when W is given)."""
    from torch.nn.attention.flex_attention import create_mask

    N, A, L, B = 3, 6, 40, 4
    anchors, valid = ragged_anchors(N, A, L, [6, 3, 0])
    anchors = torch.where(valid, anchors, torch.zeros_like(anchors))  # what training_forward hands the masks
    S = A * B
    dense = dense_block_mask(anchors, valid, L, B)
    if W is not None:
        q_pos = (anchors[:, :, None] + torch.arange(B)).view(N, S)
        dense = dense & sliding_window_mask(q_pos, torch.cat([torch.arange(L).expand(N, L), q_pos], 1), W)
    got = create_mask(block_mask_mod(anchors, valid, L, B, W), N, 1, S, L + S, device="cpu")
    assert got.shape == (N, 1, S, L + S) and torch.equal(got, dense)


def _tiny_config(window, **kw):
    return DrafterConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA: flex maps query heads to kv heads itself (enable_gqa)
        head_dim=16,
        rope_theta=10000.0,
        max_position_embeddings=1024,
        vocab_size=128,
        target_hidden_size=32,
        target_layer_ids=[0, 1],
        mask_token_id=127,
        block_size=8,
        layer_types=None if window is None else ["sliding_attention", "full_attention"],
        sliding_window=window,
        **kw,
    )


@pytest.mark.parametrize("window", [None, 5, 24])
def test_flex_equals_dense_training_forward_on_cpu(window):
    """The whole training forward, flex vs dense, fp32 on the CPU: ragged anchors (one row with a
    single valid anchor), 20 blocks over 200 context positions (several 128-wide tiles on both axes,
    some skipped), GQA, and a sliding layer when window is set. Forward only: FlexAttention has no
    CPU backward (the gradients are compared on CUDA, test_flex_vs_dense_gradients_on_cuda)."""
    torch.manual_seed(0)
    m = DFlashDrafter(_tiny_config(window, use_local_conv=True)).eval()
    emb = torch.nn.Embedding(128, 64)
    N, L, A = 2, 200, 20
    taps = torch.randn(N, L, 64)
    ids = torch.randint(0, 127, (N, L))
    anchors, valid = ragged_anchors(N, A, L, [60, 1], seed=3)
    with torch.no_grad():
        dense = m.training_forward(taps, ids, emb, anchors, valid, use_flex=False)
        flex = m.training_forward(taps, ids, emb, anchors, valid, use_flex=True)
    assert flex.shape == dense.shape == (N, A, 8, 64)
    torch.testing.assert_close(flex, dense, atol=1e-5, rtol=1e-5)  # padding blocks too: both see their block


def test_block_mask_sparsity_matches_the_dense_tiles():
    """block_mask_sparsity = the fraction of 128x128 tiles of the dense mask with nothing visible;
    > 0 at a realistic shape (32 anchors x block 8 over 512 context: blocks never see each other,
    and sorted anchors can leave the early blocks without the late context)."""
    from dflash2.drafter import block_mask_sparsity, flex_block_mask

    N, A, L, B = 2, 32, 512, 8
    anchors, valid = ragged_anchors(N, A, L, [400, 20])
    anchors = torch.where(valid, anchors, torch.zeros_like(anchors))
    S = A * B
    sparsity = block_mask_sparsity(flex_block_mask(anchors, valid, L, B))
    dense = dense_block_mask(anchors, valid, L, B)[:, 0]  # (N, S, L+S)
    tiles = torch.nn.functional.pad(dense, (0, -(L + S) % 128, 0, -S % 128))
    tiles = tiles.unflatten(2, (-1, 128)).unflatten(1, (-1, 128))  # (N, S/128, 128, (L+S)/128, 128)
    empty = ~tiles.any(4).any(2)
    assert sparsity == pytest.approx(empty.float().mean().item())
    # per row 2 query tiles x 6 key tiles; at least the 2 (query tile, other half's block tile) pairs are
    # skipped, since blocks never see each other; here 5 of 24 (row 0's first half misses late context)
    assert sparsity >= 4 / 24 and sparsity > 0


def test_uses_flex():
    from dflash2.drafter import uses_flex

    assert not uses_flex("auto", "cpu") and uses_flex("auto", torch.device("cuda", 0))
    assert uses_flex("flex", "cpu") and not uses_flex("dense", "cuda")
    # torch's compiled flex kernels refuse heads under 16 (seen on the H200 with a micro drafter's 8)
    assert uses_flex("auto", "cuda", head_dim=16) and not uses_flex("auto", "cuda", head_dim=8)
    assert uses_flex("flex", "cuda", head_dim=8)  # explicit: the training module says why it cannot run
    with pytest.raises(ValueError, match="auto, flex, dense"):
        uses_flex("sparse", "cpu")


def _module(target, drafter, attention):
    from dflash2.training.drafter_module import DrafterTrainingModule

    kw = dict(num_anchors=6, loss_gamma=4.0, selector_loss_weight=1.0, lr=1e-3, weight_decay=0.0)
    kw.update(warmup_ratio=0.0, total_steps=1, seed=0)
    return DrafterTrainingModule(drafter, target, attention=attention, **kw)


def test_the_training_module_reads_the_switch(make_spec_target, make_spec_drafter):
    """drafter.attention reaches the drafter: flex (forward, no grad: validation on the CPU) gives the
    dense losses and predictions; auto on the CPU is the dense path; flex under grad on the CPU is a
    one-line error (no CPU backward), as is an unknown mode."""
    from dflash2.drafter.objective import anchor_generator
    from dflash2.errors import DFlash2Error

    target = make_spec_target("qwen3")
    drafter = make_spec_drafter(target, 4, v2=True)
    ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "loss_mask": (torch.arange(40) >= 10).long().expand(2, 40)}
    outs = {}
    with torch.no_grad():
        for mode in ("dense", "flex", "auto"):
            outs[mode] = _module(target, drafter, mode).block_outputs(batch, anchor_generator(0, 0))
    for key in ("loss", "ce", "selector_loss"):
        torch.testing.assert_close(outs["flex"][key], outs["dense"][key])
        assert torch.equal(outs["auto"][key], outs["dense"][key])
    assert torch.equal(outs["flex"]["predictions"], outs["dense"]["predictions"])
    with pytest.raises(DFlash2Error, match="attention=flex on the CPU"):
        _module(target, drafter, "flex").block_outputs(batch, anchor_generator(0, 0))
    with pytest.raises(DFlash2Error, match=r"drafter\.attention='sparse' must be one of auto, flex, dense"):
        _module(target, drafter, "sparse")


@pytest.mark.cuda
@pytest.mark.parametrize("window", [None, 5, 24])
def test_flex_vs_dense_gradients_on_cuda(window):
    """Compiled flex vs dense SDPA on CUDA in fp32: outputs and every parameter gradient."""
    torch.manual_seed(0)
    dev = "cuda"
    base = DFlashDrafter(_tiny_config(window, use_local_conv=True, use_selector=True, selector_rank=16)).to(dev)
    emb = torch.nn.Embedding(128, 64).to(dev)
    N, L, A = 2, 300, 24
    taps, ids = torch.randn(N, L, 64, device=dev), torch.randint(0, 127, (N, L), device=dev)
    anchors, valid = (t.to(dev) for t in ragged_anchors(N, A, L, [100, 5], seed=4))
    w = torch.randn(N, A, 8, 64, device=dev) * valid[:, :, None, None]
    outs, grads = {}, {}
    for flex in (False, True):
        base.zero_grad()
        outs[flex] = base.training_forward(taps, ids, emb, anchors, valid, use_flex=flex)
        (outs[flex] * w).sum().backward()
        grads[flex] = {n: p.grad.clone() for n, p in base.named_parameters() if p.grad is not None}
    torch.testing.assert_close(outs[True], outs[False], atol=2e-4, rtol=2e-4)
    assert grads[True].keys() == grads[False].keys()
    for name in grads[False]:
        torch.testing.assert_close(grads[True][name], grads[False][name], atol=2e-4, rtol=2e-4, msg=name)
