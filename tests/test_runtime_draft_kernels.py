"""The runtime drafter's fused kernels (add_rms_norm_fp32w, draft_qk_rope_write, local_conv, conv_add_rms_norm_fp32w,
selector_walk and its pair tables) against their twins, and a draft step through them against the eager step.

On the CPU they run through Triton's interpreter (``kernels.on_cpu()``; conftest sets TRITON_INTERPRET=1
without a GPU). Tolerances: the kernels round at the twins' points, and the one reduction (a row's or
head's sum of squares) sums in Triton's order, so rstd may differ in its last fp32 bit. fp32 outputs:
a few fp32 ulps (rtol = atol = 1e-5, as test_runtime_kernels.py; values are O(1), products of ≤ 3
rounded terms). bf16: where that last bit flips a rounding, one bf16 ulp (2⁻⁸ relative) on a GPU; under
the interpreter the fp32 -> bf16 cast does not round to nearest (test_runtime_kernels.py), so a few
ulps there. The residual sum h (one fp32 add, rounded once) is exact but for that cast; V, a copy,
is exact. local_conv has no reduction and is compiled without FMA contraction, so it is exact against its twin
where the cast rounds to nearest (fp32 under the interpreter: asserted bit for bit); on a GPU it is held to the
convention above, and bf16 under the interpreter to the interpreter's (each of its 2K-1 roundings may truncate).
conv_add_rms_norm_fp32w is the same Triton code as local_conv's post side then add_rms_norm_fp32w: equal to that
pair bit for bit on any device, and to the twins as they are.
The whole step: the fused path drafts the same tokens as the eager path (fp32) and writes the same caches (the
kernel tests poison what must stay unwritten).
"""

import dataclasses
import os
from types import SimpleNamespace

import pytest
import torch
from conftest import nontrivial_dflash2, spec_drafter
from kernel_devices import kernel_devices

from dflash2.decoding import SamplingParams
from dflash2.drafter import DFlashDrafter
from dflash2.drafter.selector import CandidateSelector
from dflash2.runtime import kernels, load_model
from dflash2.runtime.draft_math import conv_apply, conv_kernels_of, rope_tables
from dflash2.runtime.drafter import RuntimeDrafter
from dflash2.runtime.kernels import act, conv_norm, draft_rope, local_conv, norm, selector
from dflash2.runtime.kernels.conv_norm import conv_add_rms_norm_fp32w_ref
from dflash2.runtime.kernels.draft_rope import draft_qk_rope_write, draft_qk_rope_write_ref
from dflash2.runtime.kernels.local_conv import local_conv_ref
from dflash2.runtime.kernels.norm import add_rms_norm_fp32w, add_rms_norm_fp32w_ref
from dflash2.runtime.kernels.selector import selector_walk, selector_walk_ref

DTYPES = [torch.float32, torch.bfloat16]


def _assert_close(a, b, dtype, device):
    if dtype == torch.float32:
        tol = dict(rtol=1e-5, atol=1e-5)
    elif device == "cpu":  # the interpreter's bf16 cast truncates
        tol = dict(rtol=0.02, atol=0.07)
    else:
        tol = dict(rtol=0.008, atol=0.008)  # one bf16 ulp
    torch.testing.assert_close(a.float(), b.float(), **tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("D", [37, 768])
def test_add_rms_norm_fp32w(interpret, dtype, residual, D):
    for device in kernel_devices():
        g = torch.Generator().manual_seed(0)
        x = torch.randn(3, 5, D, generator=g).to(device, dtype)
        r = torch.randn(3, 5, D, generator=g).to(device, dtype) if residual else None
        w = torch.randn(D, generator=g).to(device)  # fp32, as DraftWeights holds it
        h, y = add_rms_norm_fp32w(x, r, w, 1e-6)
        h_ref, y_ref = add_rms_norm_fp32w_ref(x, r, w, 1e-6)
        assert h.dtype == y.dtype == dtype and y.shape == x.shape
        if dtype == torch.float32 or device == "cuda":
            assert torch.equal(h, h_ref)  # one fp32 add, rounded once: exact
        else:
            _assert_close(h, h_ref, dtype, device)  # the interpreter's bf16 cast truncates
        _assert_close(y, y_ref, dtype, device)


def _rope_case(device, dtype, N, T, H, L, Hkv, hd, S, seed):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(N, T, (H + 2 * L * Hkv) * hd, generator=g).to(device, dtype)
    norm32 = (1 + 0.3 * torch.randn(H + L * Hkv, hd, generator=g)).to(device)
    lengths = torch.randint(0, S - T + 1, (N,), generator=g).to(device)
    positions = lengths[:, None] + torch.arange(T, device=device)
    freqs = 10000.0 ** (-torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    sign = torch.ones(hd)
    sign[: hd // 2] = -1
    cos, sin = rope_tables(positions, torch.cat([freqs, freqs]).to(device), sign.to(device), dtype)
    return qkv, norm32, cos, sin, positions


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", ["draft_step", "append_all_layers"])
def test_draft_qk_rope_write(interpret, dtype, variant):
    """A draft step's layer (H query heads, one cache slot as (N, Hkv, S, hd)) and the context append of all
    layers (no q, L slots); odd sizes: 3 query heads, hd 24 (a masked block of 32), 5 tokens."""
    N, T, Hkv, hd, S, Lc = 2, 5, 2, 24, 11, 3
    H, L = (3, 1) if variant == "draft_step" else (0, Lc)
    for device in kernel_devices():
        qkv, norm32, cos, sin, positions = _rope_case(device, dtype, N, T, H, L, Hkv, hd, S, seed=2)
        caches = torch.full((2, Lc, N, Hkv, S, hd), float("nan"), dtype=dtype, device=device)  # poison
        ref = caches.clone()

        inputs = (qkv, norm32, cos, sin, positions)
        q, q_ref = (
            fn(*inputs, *((c[0, 1], c[1, 1]) if H else (c[0], c[1])), num_heads=H, eps=1e-6)  # slot 1, or every slot
            for fn, c in ((draft_qk_rope_write, caches), (draft_qk_rope_write_ref, ref))
        )
        if H:
            assert q.shape == (N, H, T, hd) and q.dtype == dtype
            _assert_close(q, q_ref, dtype, device)
        else:
            assert q is None and q_ref is None
        slots = [1] if H else list(range(Lc))
        for n in range(N):  # exactly the block's positions of each row were written, nothing else
            cols = positions[n].cpu()
            others = torch.tensor([s for s in range(S) if s not in cols.tolist()])
            for kv in (0, 1):
                got, want = caches[kv, slots, n][:, :, cols], ref[kv, slots, n][:, :, cols]
                if kv == 1:
                    assert torch.equal(got, want)  # V: a copy
                else:
                    _assert_close(got, want, dtype, device)
                assert caches[kv, slots, n][:, :, others].isnan().all()
        if H:
            assert caches[:, [0, 2]].isnan().all()  # other slots untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B", [4, 8, 16])
@pytest.mark.parametrize("K,G,gs", [(2, 7, 3), (3, 5, 9), (2, 80, 16)])
def test_local_conv(interpret, dtype, B, K, G, gs):
    """Both sides of one block, every token position 0..B-1 of it (and a partial block of B-1 / 1 tokens: the
    first tokens of a block, where the taps reach into the padding); odd channel counts (21, 45: one masked
    tile) and 1280 in groups of 16 (two tiles of 1024 per token, the second masked); K = 2 (the released
    setting) and 3; an fp32 base with a bf16 x (cast as the twin casts it); exact zeros of both signs."""
    d = G * gs
    for device in kernel_devices():
        g = torch.Generator().manual_seed(B + K)
        for T in (B, B - 1, 1):
            x = torch.randn(3, T, d, generator=g).to(device, dtype)
            x[0, 0, :5] = 0.0
            x[1, 0, :5] = -0.0
            delta = torch.randn(3, T, 2 * K * G, generator=g).to(device, dtype)
            for base_dtype in (dtype, torch.float32):
                base = (1 + torch.randn(2, K, G, gs, generator=g)).to(device, base_dtype)
                for side in (0, 1):
                    got = local_conv.local_conv(x, delta, base, side)
                    want = local_conv_ref(x, delta, base, side)
                    assert got.shape == (3, T, d) and got.dtype == dtype
                    if dtype == torch.float32 and device == "cpu":
                        assert torch.equal(got, want)  # same roundings, no reduction, no FMA: bit for bit
                    elif device == "cpu":  # bf16 in the interpreter: see _assert_conv_close
                        _assert_conv_close(got, want, x, delta, base, side)
                    else:
                        _assert_close(got, want, dtype, device)


def _assert_conv_close(got, want, x, delta, base, side):
    """bf16 local conv under the interpreter, whose fp32 -> bf16 cast truncates: each of the 2K-1 roundings of an
    output (K kernel adds, K products, K-1 sums; and the base's cast) may be off by < 1 ulp (2⁻⁷ relative) of what
    it rounds, in the kernel and by half that in the twin, so the difference is bounded by ~(K+1)·2⁻⁷ of the
    magnitudes summed, Σ_t (|base|+|δ|)·|x[i-t]| (held to twice that), not of the output: with cancellation
    between taps a fixed rtol/atol (the file's interpreter convention) is too tight (seen: 0.125 on an output
    of 1.4 with taps ~±8)."""
    K = base.shape[1]
    mags = conv_apply(x.float().abs(), conv_kernels_of(delta.float().abs(), base.float().abs(), side))
    assert ((got.float() - want.float()).abs() <= (K + 2) * 2**-6 * mags + 1e-30).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K,G,gs", [(2, 7, 3), (3, 5, 9), (2, 80, 16)])
def test_conv_add_rms_norm_fp32w(interpret, dtype, K, G, gs):
    """The post-conv + residual add + norm launch == local_conv's side 1 then add_rms_norm_fp32w, both kernels,
    bit for bit (the same Triton code, row block, warps and compile flags; under the interpreter for bf16 too,
    whose truncating casts are the same in both), and the twin (today's eager ops) to the file's conventions.
    Block lengths T from 1 to 16 (odd and even, short and full; the interpreter's cost is per token row), so the
    first tokens of a block, whose taps reach into the padding, and full blocks of 4, 8, 16; 2 rows; odd channel
    counts (21, 45) and 1280 in groups of 16 (a row block of 2048, masked past 1280); K = 2 and 3; an fp32 base
    with a bf16 x (odd T); exact zeros of both signs in z."""
    d = G * gs
    lengths = (1, 2, 3, 5, 7, 11, 16) if G == 7 else (1, 2, 3, 4, 8, 16)
    for device in kernel_devices():
        g = torch.Generator().manual_seed(10 * K + G)
        for T in lengths:
            x, z = (torch.randn(2, T, d, generator=g).to(device, dtype) for _ in range(2))
            z[0, 0, :5] = 0.0
            z[1, 0, :5] = -0.0
            delta = torch.randn(2, T, 2 * K * G, generator=g).to(device, dtype)
            w = (1 + 0.3 * torch.randn(d, generator=g)).to(device)  # fp32, as DraftWeights holds it
            base_dtype = torch.float32 if T % 2 else dtype
            base = (1 + torch.randn(2, K, G, gs, generator=g)).to(device, base_dtype)
            h, y = conv_norm.conv_add_rms_norm_fp32w(x, z, delta, base, w, 1e-6)
            assert h.shape == y.shape == (2, T, d) and h.dtype == y.dtype == dtype
            h_pair, y_pair = add_rms_norm_fp32w(x, local_conv.local_conv(z, delta, base, 1), w, 1e-6)
            assert torch.equal(h, h_pair) and torch.equal(y, y_pair)  # the unfused kernels' bits
            h_ref, y_ref = conv_add_rms_norm_fp32w_ref(x, z, delta, base, w, 1e-6)
            if dtype == torch.float32 or device == "cuda":
                if device == "cpu":
                    assert torch.equal(h, h_ref)  # conv and add: no reduction, no FMA, fp32 casts exact
                else:
                    _assert_close(h, h_ref, dtype, device)  # local_conv's GPU convention
                _assert_close(y, y_ref, dtype, device)
            else:  # bf16 in the interpreter: the conv's bound (_assert_conv_close) plus the add's truncation
                out_ref = local_conv_ref(z, delta, base, 1)
                mags = conv_apply(z.float().abs(), conv_kernels_of(delta.float().abs(), base.float().abs(), 1))
                bound = (K + 2) * 2**-6 * mags + 2**-6 * (x.float().abs() + out_ref.float().abs())
                assert ((h.float() - h_ref.float()).abs() <= bound + 1e-30).all()
                _assert_close(y, add_rms_norm_fp32w_ref(h, None, w, 1e-6)[1], dtype, device)  # the norm of its h


def test_local_conv_is_the_module():
    """The twin (and so the fused path's definition) is BlockLocalConv's side, bit for bit (fp32, CPU)."""
    from dflash2.drafter.local_conv import BlockLocalConv
    from dflash2.runtime.draft_weights import ConvWeights

    g = torch.Generator().manual_seed(3)
    conv = BlockLocalConv(21, 3, group_size=3)
    with torch.no_grad():
        conv.base_kernel.normal_(generator=g)
        conv.kernel_projection.weight.normal_(generator=g)
        x = torch.randn(2, 8, 21, generator=g)
        w = ConvWeights.of(conv)
        delta = torch.nn.functional.linear(x, w.projection)
        for side in (0, 1):
            assert torch.equal(local_conv_ref(x, delta, w.base, side), conv(x, side, conv.deltas(x), 8))


# (N, P, k, V, r): odd sizes (k and r no powers of two), the real drafter's (P 15, k 16, r 256), one position,
# k above one 16-wide tile and r not a multiple of 16
WALK_SIZES = [(3, 6, 5, 40, 24), (1, 15, 16, 300, 256), (3, 15, 16, 300, 256), (3, 1, 5, 40, 24), (2, 7, 19, 64, 100)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_nan_score_is_chosen_as_torch_argmax_chooses_it(interpret, dtype):
    """torch.argmax takes a NaN as the largest (its first NaN); the walks must too, never a padded lane (k = 5 is
    padded to 16). Greedy: the NaN candidate's token; sampled: a NaN prob row is still a real candidate."""
    from dflash2.runtime.kernels.selector_sample import selector_sample_walk, selector_sample_walk_ref

    for device in kernel_devices():
        hh, cand_ids, unary, anchor, pcb, scb = _walk_case(dtype, device, 3, 6, 5, 40, 24)
        unary[1, 2, 3] = float("nan")  # row 1, position 2, candidate 3
        got = selector_walk(hh, cand_ids, unary, anchor, pcb, scb)
        assert torch.equal(got, selector_walk_ref(hh, cand_ids, unary, anchor, pcb, scb))
        assert got[1, 2] == cand_ids[1, 2, 3]
        races = torch.ones(6, 3, 5, device=device)
        tokens, _ = selector_sample_walk(hh, cand_ids, unary, anchor, pcb, scb, 0.8, races)
        want, _ = selector_sample_walk_ref(hh, cand_ids, unary, anchor, pcb, scb, 0.8, races)
        assert torch.equal(tokens[1, :3], want[1, :3])  # up to and at the NaN position: the twin's choices
        assert bool((tokens[..., None] == cand_ids).any(-1).all())  # every token one of its candidates


def _walk_case(dtype, device, N, P, k, V, r, seed=4):
    g = torch.Generator().manual_seed(seed)
    pcb, scb = (torch.randn(V, r, generator=g).to(device, dtype) for _ in range(2))
    # hh scaled by sqrt(24 / r): the pair terms spread as at rank 24 (the first case's), so a rounding of bf16's
    # stays as small against the gaps between scores (unscaled, rank 256 makes them about 3 times larger)
    hh = (torch.randn(N, P, r, generator=g) * (24 / r) ** 0.5).to(device, dtype)
    cand_ids = torch.stack([torch.randperm(V, generator=g)[:k] for _ in range(N * P)]).view(N, P, k).to(device)
    unary = torch.randn(N, P, k, generator=g).to(device)
    anchor = torch.tensor([0, 7, 39], device=device) if N == 3 else torch.randint(0, V, (N,), generator=g).to(device)
    return hh, cand_ids, unary, anchor, pcb, scb


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sizes", WALK_SIZES)
def test_selector_walk(interpret, dtype, sizes):
    """The walk's kernels (pair tables, walk) == the twin at WALK_SIZES. Tokens are chosen by argmax, a near-tie
    of scores could go either way (see the kernel's docstring); these seeds have none, so the tokens are compared
    exactly (bf16 too, even with the interpreter's truncating cast)."""
    N, P = sizes[:2]
    for device in kernel_devices():
        hh, cand_ids, unary, anchor, pcb, scb = _walk_case(dtype, device, *sizes)
        got = selector_walk(hh, cand_ids, unary, anchor, pcb, scb)
        want = selector_walk_ref(hh, cand_ids, unary, anchor, pcb, scb)
        assert got.dtype == torch.long and got.shape == (N, P)
        assert torch.equal(got, want)


def _walk_table(table, cand_ids, unary):
    """The greedy walk over given pair tables (N, P, k, k), eagerly: position 0 from row 0 (the anchor's)."""
    N, P, k = cand_ids.shape
    choice, tokens = torch.zeros(N, dtype=torch.long), []
    for pos in range(P):
        row = table[:, pos].gather(1, choice[:, None, None].expand(N, 1, k))[:, 0]  # (N, k)
        choice = (unary[:, pos] + row).argmax(-1)
        tokens.append(cand_ids[:, pos].gather(1, choice[:, None])[:, 0])
    return torch.stack(tokens, dim=1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sizes", WALK_SIZES)
def test_selector_pair_table(interpret, dtype, sizes):
    """The pair tables' kernel == the eager tables in the twin's own arithmetic (selector_pair_table_ref) to the
    dot's summation order, and the eager tables are the twin's pair terms: walked eagerly they draft the twin's
    tokens. Bound per entry, with m = Σ_r |pred · hh| · |succ| (the same table of magnitudes): fp32 2⁻¹⁶ m
    (any order of 256 fp32 terms) + 1e-6; bf16 2⁻⁶ (m + |pair|) (the product's and the result's rounding, the
    interpreter's truncating to the twin's nearest: each up to one bf16 step, 2⁻⁷ relative)."""
    N, P, k = sizes[:3]
    for device in kernel_devices():
        hh, cand_ids, unary, anchor, pcb, scb = _walk_case(dtype, device, *sizes)
        got = selector.selector_pair_table(hh, cand_ids, anchor, pcb, scb)
        want = selector.selector_pair_table_ref(hh, cand_ids, anchor, pcb, scb)
        assert got.dtype == torch.float32 and got.shape == want.shape == (N, P, k, k)
        mags = selector.selector_pair_table_ref(
            hh.float().abs(), cand_ids, anchor, pcb.float().abs(), scb.float().abs()
        )
        bound = 2**-16 * mags + 1e-6 if dtype == torch.float32 else 2**-6 * (mags + want.abs())
        assert ((got - want).abs() <= bound).all()
        assert (want[:, 0] == want[:, 0, :1]).all()  # position 0: the anchor's row for every j
        want_tokens = selector_walk_ref(hh, cand_ids, unary, anchor, pcb, scb)
        assert torch.equal(_walk_table(want.cpu(), cand_ids.cpu(), unary.cpu()), want_tokens.cpu())


@pytest.fixture(scope="module")
def runtime_target(hf_targets):
    return load_model(hf_targets["qwen3"][1], target_layer_ids=[0, 1])


@pytest.mark.parametrize("kind", ["v1", "dflash2", "dflash2_k3", "window"])
def test_fused_draft_step_equals_the_eager_step(runtime_target, kind, monkeypatch):
    """Appends and draft steps (T=0) through the kernels (interpreter; the selector's top-k too) == the eager
    drafter's: same drafts, hidden states and whole caches (context K/V and the block's) to fp32 rounding. fp32,
    2 layers, ragged rows; DFlash2 drafters with their local convs off the identity, each side through
    local_conv's kernel."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the kernels through the interpreter")
    shape = SimpleNamespace(
        hidden_size=runtime_target.hidden_size, vocab_size=runtime_target.vocab_size, target_layer_ids=[0, 1]
    )
    cfg = dataclasses.replace(spec_drafter(shape, 8, v2=kind != "v1").config, num_hidden_layers=2)
    if kind == "window":
        cfg = dataclasses.replace(cfg, layer_types=["sliding_attention", "full_attention"], sliding_window=5)
    if kind == "dflash2_k3":  # three conv taps (the released drafters have two)
        cfg = dataclasses.replace(cfg, conv_kernel_size=3)
    drafter = DFlashDrafter(cfg, init_seed=4).eval()
    if kind != "v1":
        nontrivial_dflash2(drafter)
    run = RuntimeDrafter(drafter, runtime_target)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 120, (3, 30), generator=g)
    taps = runtime_target(ids, runtime_target.new_state(3, 40)).taps  # (3, 30, 2·d)
    contexts = [run.new_context(3, 48) for _ in range(2)]  # [fused, eager]

    def no_twin(*args, **kwargs):
        raise AssertionError("a twin ran on the fused path")

    def both(fn, *args, **kwargs):
        """fn(ctx, *args) on the fused path's context (every norm, q/k/RoPE/write a kernel) and on the eager path's."""
        with kernels.on_cpu(), monkeypatch.context() as m:
            m.setattr(norm, "add_rms_norm_fp32w_ref", no_twin)
            m.setattr(draft_rope, "draft_qk_rope_write_ref", no_twin)
            m.setattr(local_conv, "local_conv_ref", no_twin)
            m.setattr(conv_norm, "conv_add_rms_norm_fp32w_ref", no_twin)
            m.setattr(selector, "selector_walk_ref", no_twin)
            m.setattr(selector, "selector_pair_table_ref", no_twin)
            m.setattr(act, "silu_mul_ref", no_twin)  # the MLP's SwiGLU of its stacked gate|up GEMM
            m.setattr(CandidateSelector, "top_candidates", no_twin)  # its torch.topk: kernels/topk.py instead
            a = fn(contexts[0], *args, **kwargs)
        with kernels.kernels(False):
            b = fn(contexts[1], *args, **kwargs)
        return a, b

    lengths = torch.tensor([4, 9, 1])
    both(run.append, taps[:, :9], lengths)
    # two ragged steps (a row keeping 1, rows keeping all 8): the interpreter's time is per drafted step
    for step, keep in enumerate(([3, 1, 8], [8, 8, 8])):
        anchor = ids.gather(1, contexts[0].lengths[:, None])[:, 0]
        if step == 0:  # the hidden states themselves once (propose runs the same forward every step)
            hidden = both(run.hidden, anchor, kv_len=40)
            torch.testing.assert_close(*hidden, rtol=1e-5, atol=1e-5)
        drafts = both(run.propose, anchor, SamplingParams(), kv_len=40)
        assert torch.equal(drafts[0].tokens, drafts[1].tokens)
        positions = contexts[0].lengths[:, None] + torch.arange(8)
        new = taps.gather(1, positions.clamp(max=29)[..., None].expand(-1, -1, taps.shape[-1]))
        both(run.append, new, torch.tensor(keep))
        assert torch.equal(contexts[0].lengths, contexts[1].lengths)
        for a, b in ((contexts[0].kv.k, contexts[1].kv.k), (contexts[0].kv.v, contexts[1].kv.v)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)  # V too: projected from normed inputs
