"""flex_attention and create_block_mask are compiled once per process with symbolic lengths
(dflash2/drafter/masks.py ``compiled``): one compile serves batches of every context length."""

from __future__ import annotations

import pytest
import torch

from dflash2.drafter.masks import block_mask_mod, compiled, flex_block_mask
from dflash2.drafter.objective import row_anchor_generator, sample_anchors

# Batches as training pads them: another longest sequence (L), rows (N) and anchors (A) every time. At least
# two 128-wide tiles of queries (A x block) and keys (L + A x block) each, as at any real size: a length of
# one tile is a special case torch.compile specialises for (and then compiles the general case at the next).
SHAPES = [(2, 150, 40), (2, 181, 40), (2, 260, 36), (3, 133, 34)]
TABLES = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")
TABLES += ("q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


def _anchors(n: int, length: int, a: int, step: int, device="cpu"):
    mask = torch.zeros(n, length, dtype=torch.long)
    mask[:, length // 2 :] = 1
    anchors, valid = sample_anchors(mask, a, [row_anchor_generator(0, step, r) for r in range(n)])
    anchors = torch.where(valid, anchors, torch.zeros_like(anchors))  # what training_forward hands the masks
    return anchors.to(device), valid.to(device)


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def test_the_compiled_functions_are_built_once():
    assert compiled("create_block_mask") is compiled("create_block_mask")
    assert compiled("flex_attention") is compiled("flex_attention")


@pytest.mark.parametrize("env,dynamic", [(None, True), ("1", True), ("0", None)])
def test_symbolic_lengths_unless_the_environment_says_otherwise(monkeypatch, env, dynamic):
    import dflash2.drafter.masks as masks

    seen = []
    monkeypatch.setattr(masks, "_COMPILED", {})
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.append(kw) or fn)
    if env is None:
        monkeypatch.delenv("DFLASH2_FLEX_DYNAMIC", raising=False)
    else:
        monkeypatch.setenv("DFLASH2_FLEX_DYNAMIC", env)
    compiled("flex_attention")
    assert seen == [{"dynamic": dynamic}]


@pytest.mark.slow
@pytest.mark.parametrize("window", [None, 5])
def test_one_compiled_mask_builder_serves_every_length_and_equals_the_eager_one(window):
    """CPU (inductor's C++ backend; the CUDA path compiles the same graph for Triton): the first batch
    compiles, later batches of other lengths, rows and anchors reuse it, and every tile table equals
    create_block_mask's uncompiled one."""
    from torch.nn.attention.flex_attention import create_block_mask

    block, counts = 4, []
    for step, (n, length, a) in enumerate(SHAPES):
        anchors, valid = _anchors(n, length, a, step)
        got = flex_block_mask(anchors, valid, length, block, window, compile_mask=True)
        counts.append(_graphs())
        mod = block_mask_mod(anchors, valid, length, block, window)
        want = create_block_mask(mod, B=n, H=None, Q_LEN=a * block, KV_LEN=length + a * block, device="cpu")
        assert got.shape == want.shape and got.BLOCK_SIZE == want.BLOCK_SIZE
        for name in TABLES:
            g, w = getattr(got, name), getattr(want, name)
            assert (g is None) == (w is None), name
            if g is not None:
                assert torch.equal(g, w), (step, name)
    assert counts[1:] == [counts[0]] * (len(counts) - 1), counts  # no graph after the first batch's


@pytest.mark.cuda
@pytest.mark.parametrize("head_dim", [16, 192])
def test_one_flex_compile_serves_every_length_on_cuda_and_equals_dense(head_dim):
    """Forward and backward of the drafter's flex attention in fp32 at several context lengths: graphs are
    built for the first batch only, and outputs and gradients match the dense path at each length. Head dim
    192 (the GPU-sized drafter's): torch's own fp32 tile for it does not fit in shared memory on Hopper
    (model.FP32_FLEX_TILES)."""
    import dataclasses

    from test_drafter_masks import _tiny_config

    from dflash2.drafter import DFlashDrafter

    torch.manual_seed(0)
    torch._dynamo.reset()  # the graph counts below start from this test's first compile
    cfg = dataclasses.replace(_tiny_config(None, use_local_conv=True), head_dim=head_dim)
    drafter = DFlashDrafter(cfg).cuda()
    emb = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size).cuda()
    tap_width = cfg.target_hidden_size * len(cfg.target_layer_ids)
    counts = []
    for step, (n, length, a) in enumerate(SHAPES):
        taps = torch.randn(n, length, tap_width, device="cuda")
        ids = torch.randint(0, 127, (n, length), device="cuda")
        anchors, valid = _anchors(n, length, a, step, "cuda")
        w = torch.randn(n, a, cfg.block_size, cfg.hidden_size, device="cuda") * valid[:, :, None, None]
        outs, grads = {}, {}
        for flex in (False, True):
            drafter.zero_grad()
            outs[flex] = drafter.training_forward(taps, ids, emb, anchors, valid, use_flex=flex)
            (outs[flex] * w).sum().backward()
            grads[flex] = {k: p.grad.clone() for k, p in drafter.named_parameters() if p.grad is not None}
        counts.append(_graphs())
        torch.testing.assert_close(outs[True], outs[False], atol=2e-4, rtol=2e-4)
        for k in grads[False]:
            torch.testing.assert_close(grads[True][k], grads[False][k], atol=2e-4, rtol=2e-4, msg=k)
    assert counts[1:] == [counts[0]] * (len(counts) - 1), counts
