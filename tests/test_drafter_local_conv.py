"""DFlash2 block-local dynamic conv (ARCHITECTURE.md §3.1): naive equality, block isolation, causality,
identity init."""

import torch

from dflash2.drafter import BlockLocalConv, naive_block_local_conv


def random_conv(hidden=32, k=2, group=8, seed=0):
    torch.manual_seed(seed)
    conv = BlockLocalConv(hidden, k, group)
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_(std=0.3)
    return conv


def test_matches_naive_loop():
    for k, B in [(2, 4), (3, 5)]:
        conv = random_conv(k=k)
        T = 3 * B  # three concatenated blocks
        x = torch.randn(T, 32)
        delta = conv.deltas(x)
        assert delta.shape == (T, 2, k, 32 // 8)
        for side in (0, 1):
            ref = naive_block_local_conv(x, conv.base_kernel.detach(), delta.detach(), side, B, 8)
            torch.testing.assert_close(conv(x, side, delta, B), ref, atol=1e-5, rtol=1e-5)


def test_batched_matches_per_row():
    conv = random_conv(k=2)
    x = torch.randn(3, 12, 32)
    delta = conv.deltas(x)
    out = conv(x, 1, delta, 4)
    for n in range(3):
        torch.testing.assert_close(out[n], conv(x[n], 1, delta[n], 4))


def test_no_mixing_across_blocks_and_no_lookahead():
    conv = random_conv(k=3, seed=1)
    B, T = 4, 12
    x = torch.randn(T, 32)
    base = conv(x, 0, conv.deltas(x), B)
    for i in range(T):
        x2 = x.clone()
        x2[i] += torch.randn(32)
        out = conv(x2, 0, conv.deltas(x2), B)
        changed = (out - base).abs().amax(-1) > 0  # (T,)
        blk = i // B
        # only positions >= i inside the same block may change
        allowed = torch.zeros(T, dtype=torch.bool)
        allowed[i : (blk + 1) * B] = True
        assert not changed[~allowed].any(), f"perturbing {i} changed {changed.nonzero().flatten().tolist()}"
        assert changed[i]


def test_identity_at_init():
    conv = BlockLocalConv(32, 2, 16)
    x = torch.randn(2, 8, 32)
    d = conv.deltas(x)
    assert torch.equal(d, torch.zeros_like(d))
    assert torch.equal(conv(x, 0, d, 4), x) and torch.equal(conv(x, 1, d, 4), x)
