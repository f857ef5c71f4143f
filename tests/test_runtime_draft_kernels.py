"""The runtime drafter's fused kernels (add_rms_norm_fp32w, draft_qk_rope_write) against their twins, and a
draft step through them against the eager step.

On the CPU they run through Triton's interpreter (``kernels.on_cpu()``; conftest sets TRITON_INTERPRET=1
without a GPU). Tolerances: the kernels round at the twins' points, and the one reduction (a row's or
head's sum of squares) sums in Triton's order, so rstd may differ in its last fp32 bit. fp32 outputs:
a few fp32 ulps (rtol = atol = 1e-5, as test_runtime_kernels.py; values are O(1), products of ≤ 3
rounded terms). bf16: where that last bit flips a rounding, one bf16 ulp (2⁻⁸ relative) on a GPU; under
the interpreter the fp32 -> bf16 cast does not round to nearest (test_runtime_kernels.py), so a few
ulps there. The residual sum h (one fp32 add, rounded once) is exact but for that cast; V, a copy,
is exact. The whole step: the fused path drafts the same tokens as the eager path (fp32) and
writes the same caches (the kernel tests poison what must stay unwritten).
"""

import dataclasses
import os
from types import SimpleNamespace

import pytest
import torch
from conftest import nontrivial_dflash2, spec_drafter

from dflash2.decoding import SamplingParams
from dflash2.drafter import DFlashDrafter
from dflash2.runtime import kernels, load_model
from dflash2.runtime.draft_math import rope_tables
from dflash2.runtime.drafter import RuntimeDrafter
from dflash2.runtime.kernels import draft_rope, norm, selector
from dflash2.runtime.kernels.draft_rope import draft_qk_rope_write, draft_qk_rope_write_ref
from dflash2.runtime.kernels.norm import add_rms_norm_fp32w, add_rms_norm_fp32w_ref
from dflash2.runtime.kernels.selector import selector_walk, selector_walk_ref

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture
def interpret():
    if os.environ.get("TRITON_INTERPRET") != "1":
        yield  # a GPU machine: the CPU half of each test is skipped below, the GPU half runs for real
        return
    with kernels.on_cpu():
        yield


def _devices():
    cpu = ["cpu"] if os.environ.get("TRITON_INTERPRET") == "1" else []
    return cpu + (["cuda"] if torch.cuda.is_available() else [])


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
    for device in _devices():
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
    for device in _devices():
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
def test_selector_walk(interpret, dtype):
    """Odd sizes: k = 5 candidates of 40 tokens, rank 24, 3 rows, 6 positions. Tokens are chosen by argmax,
    a near-tie of scores could go either way (see the kernel's docstring); these seeds have none, so the
    tokens are compared exactly (bf16 too, even with the interpreter's truncating cast)."""
    N, P, k, V, r = 3, 6, 5, 40, 24
    for device in _devices():
        g = torch.Generator().manual_seed(4)
        pcb, scb = (torch.randn(V, r, generator=g).to(device, dtype) for _ in range(2))
        hh = torch.randn(N, P, r, generator=g).to(device, dtype)
        cand_ids = torch.stack([torch.randperm(V, generator=g)[:k] for _ in range(N * P)]).view(N, P, k).to(device)
        unary = torch.randn(N, P, k, generator=g).to(device)
        anchor = torch.tensor([0, 7, 39], device=device)
        got = selector_walk(hh, cand_ids, unary, anchor, pcb, scb)
        want = selector_walk_ref(hh, cand_ids, unary, anchor, pcb, scb)
        assert got.dtype == torch.long and got.shape == (N, P)
        assert torch.equal(got, want)


@pytest.fixture(scope="module")
def runtime_target(hf_targets):
    return load_model(hf_targets["qwen3"][1], target_layer_ids=[0, 1])


@pytest.mark.parametrize("kind", ["v1", "dflash2", "window"])
def test_fused_draft_step_equals_the_eager_step(runtime_target, kind, monkeypatch):
    """Appends and draft steps (T=0) through the kernels (interpreter) == the eager drafter's: same drafts,
    hidden states and whole caches (context K/V and the block's) to fp32 rounding. fp32, 2 layers, ragged rows."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the kernels through the interpreter")
    shape = SimpleNamespace(
        hidden_size=runtime_target.hidden_size, vocab_size=runtime_target.vocab_size, target_layer_ids=[0, 1]
    )
    cfg = dataclasses.replace(spec_drafter(shape, 8, v2=kind != "v1").config, num_hidden_layers=2)
    if kind == "window":
        cfg = dataclasses.replace(cfg, layer_types=["sliding_attention", "full_attention"], sliding_window=5)
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
            m.setattr(selector, "selector_walk_ref", no_twin)
            a = fn(contexts[0], *args, **kwargs)
        with kernels.kernels(False):
            b = fn(contexts[1], *args, **kwargs)
        return a, b

    lengths = torch.tensor([4, 9, 1])
    both(run.append, taps[:, :9], lengths)
    for keep in ([3, 1, 8], [1, 2, 1], [8, 8, 8]):
        anchor = ids.gather(1, contexts[0].lengths[:, None])[:, 0]
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
