"""The runtime drafter's arithmetic (draft_math.py, draft_weights.py, selector_path.py) equals the drafter modules'
bit for bit (``torch.equal``), piece by piece and for a whole draft step and context append.

The whole-step oracle is the runtime drafter as it was before its ops were batched: the drafter's own
modules (``DecoderLayer._sublayer``, ``Attention.context_kv``, ``rope_cos_sin`` / ``apply_rope``,
``CandidateSelector.greedy_path``) over the same static cache. fp32 and bf16 drafters, v1 and DFlash2
(conv and selector moved off their init), a sliding-window layer, ragged rows.
"""

import dataclasses
from functools import partial
from types import SimpleNamespace

import pytest
import torch
from conftest import nontrivial_dflash2, spec_drafter

from dflash2.decoding import SamplingParams
from dflash2.drafter import DFlashDrafter
from dflash2.drafter.local_conv import BlockLocalConv
from dflash2.drafter.model import RMSNorm, apply_rope, rope_cos_sin
from dflash2.drafter.selector import CandidateSelector
from dflash2.runtime import load_model
from dflash2.runtime.draft_math import conv_kernels, conv_side, rms_norm, rope_rows, rope_tables, rotate
from dflash2.runtime.draft_weights import ConvWeights
from dflash2.runtime.drafter import RuntimeDrafter
from dflash2.runtime.selector_path import selector_greedy_path

DTYPES = [torch.float32, torch.bfloat16]


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal to the last bit, signed zeros included (torch.equal says -0 == 0)."""
    ints = {2: torch.int16, 4: torch.int32}
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.view(ints[a.element_size()]), b.view(ints[b.element_size()]))
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_stacked_weights_is_the_modules(dtype):
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(3, 5, 4 + 2 + 2, 24, generator=g).to(dtype)  # (N, T, H + 2·Hkv, hd): q, k, v heads
    q_norm, k_norm = RMSNorm(24).to(dtype), RMSNorm(24).to(dtype)
    with torch.no_grad():
        q_norm.weight.normal_(generator=g)
        k_norm.weight.normal_(generator=g)
        stacked = torch.cat([q_norm.weight.float().expand(4, 24), k_norm.weight.float().expand(2, 24)])
        got = rms_norm(qkv[:, :, :6], stacked, q_norm.eps)  # a strided view, one call for q and k
        assert _bits_equal(got[:, :, :4], q_norm(qkv[:, :, :4]))
        assert _bits_equal(got[:, :, 4:], k_norm(qkv[:, :, 4:6]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_as_a_roll_is_apply_rope(dtype):
    g = torch.Generator().manual_seed(1)
    hd = 32
    positions = torch.randint(0, 4000, (3, 1), generator=g) + torch.arange(6)  # (N, T)
    x = torch.randn(3, 6, 5, hd, generator=g).to(dtype)  # (N, T, h, hd)
    inv = 1e6 ** (-torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    sign = torch.cat([-torch.ones(hd // 2), torch.ones(hd // 2)])
    cos, sin = rope_tables(positions, torch.cat([inv, inv]), sign, dtype)
    ref_cos, ref_sin = rope_cos_sin(positions, hd, 1e6, dtype)  # (N, 1, T, hd)
    assert _bits_equal(cos[:, :, 0], ref_cos[:, 0])
    ref = apply_rope(x.transpose(1, 2), ref_cos, ref_sin)  # (N, h, T, hd)
    assert _bits_equal(rotate(x, cos, sin), ref.transpose(1, 2))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_rows_gathered_are_the_tables_computed(dtype):
    """A drafter context's rows of every position (rope_rows), indexed by a step's positions, equal
    rope_tables at those positions bit for bit."""
    hd = 32
    inv = 1e6 ** (-torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    freqs, sign = torch.cat([inv, inv]), torch.cat([-torch.ones(hd // 2), torch.ones(hd // 2)])
    cos_rows, sin_rows = rope_rows(4100, freqs, sign, dtype)
    assert cos_rows.shape == sin_rows.shape == (4100, 1, hd)
    positions = torch.randint(0, 4000, (3, 1), generator=torch.Generator().manual_seed(4)) + torch.arange(8)
    cos, sin = rope_tables(positions, freqs, sign, dtype)
    assert _bits_equal(cos_rows[positions], cos) and _bits_equal(sin_rows[positions], sin)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kernel_size,T", [(2, 8), (2, 5), (3, 4), (3, 2)])
def test_one_block_conv_is_the_modules(dtype, kernel_size, T):
    """Both sides from one set of kernels, as ``DecoderLayer._sublayer`` uses them; T ≤ B (one block)."""
    g = torch.Generator().manual_seed(2)
    conv = BlockLocalConv(32, kernel_size, group_size=8)
    with torch.no_grad():
        conv.base_kernel.normal_(generator=g)
        conv.kernel_projection.weight.normal_(generator=g)
    conv = conv.to(dtype)
    x, y = (torch.randn(3, T, 32, generator=g).to(dtype) for _ in range(2))
    x[0, 0, :4] = 0.0  # exact zeros (and their signs) go through the padding as through the mask
    x[1, 1, :4] = -0.0
    w = ConvWeights.of(conv)
    kernels = conv_kernels(x, w.projection, w.base)
    delta = conv.deltas(x)
    with torch.no_grad():
        assert _bits_equal(conv_side(x, kernels, 0), conv(x, 0, delta, 8))
        assert _bits_equal(conv_side(y, kernels, 1), conv(y, 1, delta, 8))


@pytest.mark.parametrize("dtype", DTYPES)
def test_selector_walk_is_greedy_path(dtype):
    g = torch.Generator().manual_seed(3)
    sel = CandidateSelector(vocab=60, hidden=16, rank=8, top_k=5, init_std=0.5).to(dtype)
    for N in (1, 4):
        hidden = torch.randn(N, 8, 16, generator=g).to(dtype)[:, 1:]  # (N, P, d), a strided view as in propose
        logits, anchor = torch.randn(N, 7, 60, generator=g), torch.randint(0, 60, (N,), generator=g)
        assert torch.equal(selector_greedy_path(sel, hidden, logits, anchor), sel.greedy_path(hidden, logits, anchor))


# ----------------------------------------------------------------------------- a whole step
class ModuleDrafter(RuntimeDrafter):
    """The oracle: the runtime drafter with the drafter modules' own ops, one layer and one projection at a time."""

    def write_context(self, ctx, taps):
        T = taps.shape[1]
        c = self.drafter.fuse_context(taps.to(self.dtype))
        meta = ctx.meta(T, attend=False)
        cos, sin = rope_cos_sin(meta.positions, self.config.head_dim, self.config.rope_theta, c.dtype)
        for i, layer in enumerate(self.drafter.layers):
            k, v = layer.self_attn.context_kv(c, cos, sin)
            ctx.kv.write(i, k, v, meta)

    def _module_attention(self, attn, x, *, cos, sin, kv, slot, meta):
        N, T, _ = x.shape
        q = apply_rope(attn.q_norm(attn.q_proj(x).view(N, T, attn.h, attn.hd)).transpose(1, 2), cos, sin)
        k, v = attn.context_kv(x, cos, sin)
        kv.write(slot, k, v, meta)
        y = kv.attend(slot, q, meta)
        return attn.o_proj(y.transpose(1, 2).reshape(N, T, attn.h * attn.hd))

    def hidden(self, ctx, anchor, kv_len=None):
        N, B = anchor.shape[0], self.block_size
        ids = torch.cat([anchor[:, None], anchor.new_full((N, B - 1), self.config.mask_token_id)], dim=1)
        h = self.drafter.embed_block(ids, self.target.embed).to(self.dtype)
        meta = ctx.meta(B, kv_len)
        sliding = self.drafter.sliding_layers
        window_meta = ctx.meta(B, kv_len, window=self.config.sliding_window) if any(sliding) else None
        cos, sin = rope_cos_sin(meta.positions, self.config.head_dim, self.config.rope_theta, h.dtype)
        for i, layer in enumerate(self.drafter.layers):
            m = window_meta if sliding[i] else meta
            attend = partial(self._module_attention, layer.self_attn, cos=cos, sin=sin, kv=ctx.kv, slot=i, meta=m)
            h = layer._sublayer(h, layer.input_layernorm, layer.attention_conv, attend)
            h = layer._sublayer(h, layer.post_attention_layernorm, layer.mlp_conv, layer.mlp)
        return self.drafter.norm(h)

    def propose(self, ctx, anchor, params, generator=None, *, kv_len=None, argmax_drafts=False):
        assert params.greedy
        h = self.hidden(ctx, anchor, kv_len)[:, 1:]
        logits = self.target.lm_head(h.to(self.target.lm_head.weight.dtype)).float()
        sel = self.drafter.candidate_selector
        return sel.greedy_path(h, logits, anchor) if sel is not None else logits.argmax(-1)


@pytest.fixture(scope="module")
def runtime_target(hf_targets):
    return load_model(hf_targets["qwen3"][1], target_layer_ids=[0, 1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["v1", "dflash2", "window"])
def test_a_draft_step_and_an_append_are_the_modules(runtime_target, dtype, kind):
    shape = SimpleNamespace(
        hidden_size=runtime_target.hidden_size, vocab_size=runtime_target.vocab_size, target_layer_ids=[0, 1]
    )
    cfg = dataclasses.replace(spec_drafter(shape, 8, v2=kind != "v1").config, num_hidden_layers=2)
    if kind == "window":  # a sliding-window layer (SDPA with its mask) before a full one (the 'block' rule)
        cfg = dataclasses.replace(cfg, layer_types=["sliding_attention", "full_attention"], sliding_window=5)
    drafter = DFlashDrafter(cfg, init_seed=4).eval()
    if kind != "v1":
        nontrivial_dflash2(drafter)
    drafter = drafter.to(dtype)
    fast, oracle = RuntimeDrafter(drafter, runtime_target), ModuleDrafter(drafter, runtime_target)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 120, (3, 30), generator=g)
    taps = runtime_target(ids, runtime_target.new_state(3, 40)).taps  # (3, 30, 2·d)
    contexts = [run.new_context(3, 48) for run in (fast, oracle)]
    lengths = torch.tensor([4, 9, 1])
    for run, ctx in zip((fast, oracle), contexts):
        run.append(ctx, taps[:, :9], lengths)
    for keep in ([3, 1, 8], [1, 2, 1]):
        anchor = ids.gather(1, contexts[0].lengths[:, None])[:, 0]
        hidden = [run.hidden(ctx, anchor, kv_len=32) for run, ctx in zip((fast, oracle), contexts)]
        assert _bits_equal(*hidden)
        drafts = fast.propose(contexts[0], anchor, SamplingParams(), kv_len=32).tokens
        assert torch.equal(drafts, oracle.propose(contexts[1], anchor, SamplingParams(), kv_len=32))
        positions = contexts[0].lengths[:, None] + torch.arange(8)
        new = taps.gather(1, positions[..., None].expand(-1, -1, taps.shape[-1]))
        for run, ctx in zip((fast, oracle), contexts):
            run.append(ctx, new, torch.tensor(keep))
        # context K/V and, past the lengths, the block K/V the draft wrote: the whole cache, bit for bit
        assert _bits_equal(contexts[0].kv.k, contexts[1].kv.k) and _bits_equal(contexts[0].kv.v, contexts[1].kv.v)
