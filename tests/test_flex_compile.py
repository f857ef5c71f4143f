"""flex_attention and create_block_mask are compiled once per process with symbolic lengths and without
duck sizing (dflash2/drafter/masks.py ``compiled``): one compile serves batches of every context length, row
count and anchor count."""

from __future__ import annotations

import pytest
import torch

from dflash2.drafter.masks import (
    block_mask_mod,
    compile_without_duck_sizing,
    compiled,
    dense_block_mask,
    flex_block_mask,
)
from dflash2.drafter.objective import row_anchor_generator, sample_anchors

# Batches as training pads them: another longest sequence (L), rows (N) and anchors (A) every time. At least
# two 128-wide tiles of queries (A x block) and keys (L + A x block) each, as at any real size: a length of
# one tile is a special case torch.compile specialises for (and then compiles the general case at the next).
# The first batches' 2 rows equal the test drafter's 2 kv heads (_tiny_config): with duck sizing, N was compiled
# as a constant then and the 3 rows of the last batch built another graph (compile_without_duck_sizing).
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


def test_compiled_functions_trace_without_duck_sizing(monkeypatch):
    from torch.fx.experimental import _config as fx_config

    import dflash2.drafter.masks as masks

    seen = []
    monkeypatch.setattr(masks, "_COMPILED", {})
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: lambda *a, **k: seen.append(fx_config.use_duck_shape))
    compiled("flex_attention")()
    compiled("create_block_mask")()
    assert seen == [False, False] and fx_config.use_duck_shape  # off inside the calls only


def _graph_counter():
    """A torch.compile backend that runs the traced graph as it is and counts the graphs it is given."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    return backend, graphs


@pytest.mark.parametrize("duck", [True, False])
def test_a_static_dim_equal_to_the_row_count_does_not_pin_it_without_duck_sizing(duck):
    """What flex_attention does to its inputs, in miniature (and fast: no inductor): under dynamic=True it
    marks the head dims static. With duck sizing the kv heads (2) and the rows of the first batch (2) share one
    symbol, so the rows are pinned to 2 too and 3 rows build a second graph; without it, one graph serves
    both. The duck case checks that the miniature still shows what the fix is for."""

    def attend(q, k):  # q (N, H, S), k (N, Hkv, K)
        torch._dynamo.mark_static(k, 1)  # flex_attention: mark_static(x, -3) on q, k and v
        return q.sum((1, 2)) + k.sum((1, 2))  # (N,)

    backend, graphs = _graph_counter()
    compile = torch.compile if duck else compile_without_duck_sizing
    fn = compile(attend, dynamic=True, backend=backend)
    for n, s, k in [(2, 5, 7), (2, 6, 9), (3, 4, 8)]:
        q, kv = torch.randn(n, 4, s), torch.randn(n, 2, k)
        torch.testing.assert_close(fn(q, kv), attend(q, kv))
    assert len(graphs) == (2 if duck else 1)


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


@pytest.mark.slow
def test_one_compiled_flex_forward_serves_every_length_and_row_count_on_cpu():
    """The compiled flex_attention the drafter trains with (CUDA; here inductor's C++ template, forward only:
    torch has no CPU flex backward) over compiled block masks, GQA 4 query / 2 kv heads as _tiny_config's:
    graphs are built for the first batch only, the 3-row batch included, and every output equals SDPA over
    the dense mask."""
    import torch.nn.functional as F

    torch._dynamo.reset()  # the first compile happens here, at 2 rows = 2 kv heads
    block, heads, kv_heads, head_dim, counts = 8, 4, 2, 16, []
    for step, (n, length, a) in enumerate(SHAPES):
        anchors, valid = _anchors(n, length, a, step)
        s = a * block
        q = torch.randn(n, heads, s, head_dim)
        k, v = (torch.randn(n, kv_heads, length + s, head_dim) for _ in range(2))
        mask = flex_block_mask(anchors, valid, length, block, compile_mask=True)
        got = compiled("flex_attention")(q, k, v, block_mask=mask, enable_gqa=True)
        counts.append(_graphs())
        rep = heads // kv_heads
        dense = dense_block_mask(anchors, valid, length, block)  # (N, 1, S, L+S)
        want = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), dense)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
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
