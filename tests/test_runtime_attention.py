"""The split-K decode-attention kernel (dflash2/runtime/kernels/attention.py) and the 'triton' backend.

The kernel against its naive fp32 twin on CPU through Triton's interpreter (and on a GPU
when there is one): GQA ratios G = 1, 4, 7, head_dim 64 / 128 and non-powers of two (40,
and 8, below the 16-wide dot tile), T = 1, 4, 16, ragged rows with 0 cached keys, a row
that fills the attended length, lengths that are no multiple of the key tile or the chunk,
one chunk, the automatic split and an explicit 3-way split of 16-key tiles; both mask rules
(the target's causal block, the drafter's whole block). Keys past the attended length are
NaN: the kernel must never load them. Then the backend names: 'default' (and None, and the
setting a fresh process starts with) is 'triton', 'sdpa' is PyTorch's SDPA exactly as before
(the default until the kernel was measured), an unknown name is one line listing them all.
``KVCache.attend`` with the triton backend equals the sdpa path for the target's and the
drafter's metadata, falls back to SDPA where the kernel does not apply, and a whole
speculative generation with it equals HF greedy token for token. On a GPU: the kernel inside
a CUDA graph follows lengths changed between replays.

Tolerances: fp32 uses IEEE fp32 dots, so only summation order differs (1e-5). In bf16 / fp16
the kernel rounds its output once and the twin rounds its fp32 result once (rtol: two units in
the last place, 2^-6 bf16 / 2^-9 fp16; the interpreter's casts truncate instead of rounding),
and the kernel rounds p to the value dtype before p·v, as every flash kernel does: at most one
truncation unit of each weight (2^-8 bf16, 2^-10 fp16) times |v| ≲ 4 (normal values), so atol
2^-6 bf16 / 2^-8 fp16.
"""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from kernel_devices import kernel_devices

from dflash2.runtime import kernels
from dflash2.runtime.cache import (
    BACKENDS,
    DecodeState,
    KVCache,
    attention_backend,
    attention_in_use,
    set_attention_backend,
)
from dflash2.runtime.kernels import attention as attn_kernels
from dflash2.runtime.kernels.attention import decode_attention, decode_attention_ref, plan

TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(rtol=2**-6, atol=2**-6),
    torch.float16: dict(rtol=2**-9, atol=2**-8),
}


@pytest.fixture
def triton_backend():
    old = attention_backend()
    set_attention_backend("triton")
    yield
    set_attention_backend(old)


def _inputs(N, hkv, G, T, D, S, lengths, dtype, device, seed=0):
    """q (N, G·Hkv, T, D); k, v (N, Hkv, S, D) views of caches whose positions ≥ S are NaN; positions (N, T)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(N, hkv * G, T, D, generator=g)
    k_full = torch.full((N, hkv, S + 5, D), float("nan"))
    v_full = torch.full((N, hkv, S + 5, D), float("nan"))
    k_full[:, :, :S] = torch.randn(N, hkv, S, D, generator=g)  # past a row's length + T: stale but finite
    v_full[:, :, :S] = torch.randn(N, hkv, S, D, generator=g)
    q, k_full, v_full = (t.to(device, dtype) for t in (q, k_full, v_full))
    positions = (torch.tensor(lengths)[:, None] + torch.arange(T)).to(device)
    return q, k_full[:, :, :S], v_full[:, :, :S], positions


# (G, D, T): GQA 1 / 4 / 7, head_dim 64 / 128 / 40 / 8, AR and verify blocks (7·16 rows: two query tiles)
CASES = [(1, 64, 1), (4, 128, 1), (7, 64, 4), (4, 64, 16), (1, 128, 16), (7, 64, 16), (4, 40, 4), (2, 8, 3)]
# the automatic split (here 2 chunks of one 64-key tile), one chunk, 3 chunks of 3 16-key tiles (48, 48, 4 keys)
SPLITS = [{}, dict(num_splits=1), dict(num_splits=3, block_n=16)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("G", "D", "T"), CASES)
def test_kernel_equals_twin(interpret, G, D, T, dtype):
    N, hkv, S = 3, 2, 100
    lengths = [0, 37, S - T]  # no cached key; mid-tile; the block ends exactly at the attended length
    for device in kernel_devices():
        q, k, v, pos = _inputs(N, hkv, G, T, D, S, lengths, dtype, device)
        for causal, splits in ((True, SPLITS), (False, SPLITS[:1])):  # the rules differ only in each row's limit
            ref = decode_attention_ref(q, k, v, pos, causal)
            assert not ref.isnan().any()
            for options in splits:
                y = decode_attention(q, k, v, pos, causal, **options)
                assert y.shape == q.shape and y.dtype == dtype
                torch.testing.assert_close(y.float(), ref.float(), **TOL[dtype])
                # token-major: the same values, written straight into (N, T, H, D) (direct store and combine)
                yt = decode_attention(q, k, v, pos, causal, token_major=True, **options)
                assert yt.shape == (N, T, hkv * G, D) and yt.is_contiguous()
                assert torch.equal(yt, y.transpose(1, 2))


def test_kernel_fp16_and_strided_q(interpret):
    """fp16, and q as a transposed view (as the drafter builds it): the launcher copies what it must."""
    N, hkv, G, T, D, S = 2, 2, 4, 5, 64, 70
    for device in kernel_devices():
        q, k, v, pos = _inputs(N, hkv, G, T, D, S, [3, 65], torch.float16, device)
        qt = q.transpose(1, 2).contiguous().transpose(1, 2)  # (N, H, T, D), not contiguous
        for options in SPLITS:
            y = decode_attention(qt, k, v, pos, True, **options)
            torch.testing.assert_close(y, decode_attention_ref(q, k, v, pos, True), **TOL[torch.float16])


def test_plan_depends_on_shapes_only():
    """The grid comes from shapes and options (never from lengths): splits ≤ key tiles, no empty chunk."""
    cpu = torch.device("cpu")
    p = plan(1, 8, 4, 512, 128, cpu)
    assert p["block_m"] == 16 and p["block_n"] == 64 and p["block_d"] == 128 and p["m_tiles"] == 1
    assert p["splits"] == 2 and p["chunk"] == 256  # 2·8 SMs (the interpreter's stand-in) ÷ 8 programs
    p = plan(1, 8, 4, 300, 128, cpu, num_splits=4)  # 5 tiles in 4 chunks of 2: 3 chunks
    assert p["splits"] == 3 and p["chunk"] == 128
    p = plan(2, 2, 7 * 16, 100, 40, cpu, num_splits=64)
    assert p["block_m"] == 64 and p["m_tiles"] == 2 and p["block_d"] == 64 and p["splits"] == 2
    for S in (1, 63, 64, 65, 4352):
        for splits in (1, 2, 3, 7, 64):
            p = plan(1, 8, 4, S, 128, cpu, num_splits=splits)
            tiles = -(-S // p["block_n"])
            assert (p["splits"] - 1) * p["chunk"] < S <= p["splits"] * p["chunk"] and p["splits"] <= tiles


def test_kernel_refuses_what_it_cannot_do():
    q = torch.zeros(1, 4, 1, 8)
    k = torch.zeros(1, 3, 5, 8)
    with pytest.raises(ValueError, match="groups"):
        decode_attention(q, k, k, torch.zeros(1, 1, dtype=torch.long))
    big = torch.zeros(1, 1, 1, 264)
    with pytest.raises(ValueError, match="head_dim 264"):
        decode_attention(big, big, big, torch.zeros(1, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="bf16 / fp16 / fp32"):
        decode_attention(q.double(), k.double()[:, :2], k.double()[:, :2], torch.zeros(1, 1, dtype=torch.long))


def test_set_attention_backend_names():
    """'default' and None are the triton kernel; 'sdpa' and 'efficient' are themselves; others: one line."""
    old = attention_backend()
    try:
        assert BACKENDS == ("default", "triton", "sdpa", "efficient")
        for name, resolved in (("default", "triton"), (None, "triton"), ("sdpa", "sdpa"), ("efficient", "efficient")):
            set_attention_backend("sdpa" if resolved == "triton" else "triton")  # from a different setting
            set_attention_backend(name)
            assert attention_backend() == resolved
            set_attention_backend(attention_backend())  # the resolved name round-trips
            assert attention_backend() == resolved
        for bad in ("flash", "Default", "cudnn"):
            with pytest.raises(ValueError) as e:
                set_attention_backend(bad)
            assert str(e.value) == f"attention backend {bad!r} not known; use one of default, triton, sdpa, efficient"
        assert attention_backend() == "efficient"  # a refused name changes nothing
    finally:
        set_attention_backend(old)


def test_fresh_process_defaults_to_triton():
    """Nothing set: a new process's backend is 'triton' (other tests here restore what they change)."""
    from conftest import subprocess_env

    code = "from dflash2.runtime.cache import attention_backend; print(attention_backend())"
    command = [sys.executable, "-c", code]
    out = subprocess.run(command, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["triton"]


def test_attention_in_use_applies_the_fallbacks():
    """What decode blocks on a device run: triton on CUDA (CPU: only inside on_cpu() under the interpreter),
    SDPA under kernels(False) (eval.speedup's ablation row) and for the sdpa / efficient names."""
    old = attention_backend()
    try:
        set_attention_backend("default")
        assert attention_in_use("cpu") == "sdpa"
        if os.environ.get("TRITON_INTERPRET") == "1":
            with kernels.on_cpu():
                assert attention_in_use("cpu") == "triton"
                with kernels.kernels(False):
                    assert attention_in_use("cpu") == "sdpa"
        for name in ("sdpa", "efficient"):
            set_attention_backend(name)
            assert attention_in_use("cpu") == "sdpa"  # efficient restricts CUDA SDPA only
        if torch.cuda.is_available():
            for name, used in (("default", "triton"), ("sdpa", "sdpa"), ("efficient", "efficient")):
                set_attention_backend(name)
                assert attention_in_use("cuda") == used
                with kernels.kernels(False):
                    assert attention_in_use("cuda") == ("efficient" if name == "efficient" else "sdpa")
    finally:
        set_attention_backend(old)


def _spy(monkeypatch):
    calls = []

    def spy(*args, **kw):
        calls.append(kw.get("causal"))
        return decode_attention(*args, **kw)

    monkeypatch.setattr(attn_kernels, "decode_attention", spy)
    return calls


def _cache(N, hkv, G, D, S_max, dtype, device, lengths):
    kv = KVCache(2, N, hkv, S_max, D, groups=G, dtype=dtype, device=device)
    g = torch.Generator().manual_seed(4)
    kv.k.copy_(torch.randn(kv.k.shape, generator=g))
    kv.v.copy_(torch.randn(kv.v.shape, generator=g))
    return kv, DecodeState(torch.tensor(lengths, device=device), kv, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attend_triton_equals_sdpa(interpret, triton_backend, monkeypatch, dtype):
    """KVCache.attend through the kernel == through SDPA: target (causal) and drafter (block) metadata."""
    from dflash2.runtime.drafter import DraftContext

    calls = _spy(monkeypatch)
    N, hkv, G, D = 3, 2, 3, 32
    for device in kernel_devices():
        kv, state = _cache(N, hkv, G, D, 96, dtype, device, [0, 13, 50])
        ctx = DraftContext(state.lengths, kv, None)
        g = torch.Generator().manual_seed(5)
        for T, kv_len in ((1, 64), (5, 64), (16, 96)):
            q = torch.randn(N, hkv * G, T, D, generator=g).to(device, dtype)
            for meta, rule in ((state.step_meta(T, kv_len), True), (ctx.meta(T, kv_len), False)):
                calls.clear()
                y = kv.attend(1, q, meta)
                assert calls == [rule]  # the kernel ran, with the rule the metadata states
                set_attention_backend("default")  # the same kernel
                assert torch.equal(kv.attend(1, q, meta), y) and calls == [rule, rule]
                yt = kv.attend(1, q, meta, token_major=True)
                assert yt.is_contiguous() and torch.equal(yt, y.transpose(1, 2))
                set_attention_backend("sdpa")
                ref = kv.attend(1, q, meta)
                ref_t = kv.attend(1, q, meta, token_major=True)
                set_attention_backend("triton")
                assert calls == [rule, rule, rule]  # sdpa never reaches the kernel
                torch.testing.assert_close(y.float(), ref.float(), **TOL[dtype])
                assert ref_t.is_contiguous() and torch.equal(ref_t, ref.transpose(1, 2))


def test_sdpa_backend_is_plain_sdpa(interpret, monkeypatch):
    """'sdpa' is what the default was before the kernel: F.scaled_dot_product_attention over the folded
    query rows with the dense mask, bit for bit, never the kernel (even where the kernel could run)."""
    from dflash2.runtime.drafter import DraftContext

    calls = _spy(monkeypatch)
    N, hkv, G, D = 3, 2, 3, 32
    old = attention_backend()
    set_attention_backend("sdpa")
    try:
        for device in dict.fromkeys(["cpu", *kernel_devices()]):  # the CPU even without the interpreter
            kv, state = _cache(N, hkv, G, D, 96, torch.float32, device, [0, 13, 50])
            ctx = DraftContext(state.lengths, kv, None)
            for T, kv_len in ((1, 64), (5, 64), (16, 96), (17, 96)):
                q = torch.randn(N, hkv * G, T, D, device=device)
                for meta in (state.step_meta(T, kv_len), ctx.meta(T, kv_len)):
                    y = kv.attend(1, q, meta)
                    k, v = kv.k[1, :, :, :kv_len], kv.v[1, :, :, :kv_len]
                    qg = q.reshape(N, hkv, G * T, D)
                    ref = F.scaled_dot_product_attention(qg, k, v, attn_mask=meta.mask).reshape(N, hkv * G, T, D)
                    assert torch.equal(y, ref)
        assert calls == []
    finally:
        set_attention_backend(old)


def test_attend_triton_falls_back_to_sdpa(interpret, triton_backend, monkeypatch):
    """Where the kernel does not apply, attend is the sdpa path exactly: prefill-length blocks
    (T > TRITON_MAX_T), a sliding-window drafter mask (no rule), the kernels switched off."""
    from dflash2.runtime.drafter import DraftContext

    calls = _spy(monkeypatch)
    N, hkv, G, D = 2, 1, 2, 16
    for device in kernel_devices():
        kv, state = _cache(N, hkv, G, D, 64, torch.float32, device, [0, 7])
        ctx = DraftContext(state.lengths, kv, None)
        q17 = torch.randn(N, hkv * G, 17, D, device=device)
        q4 = torch.randn(N, hkv * G, 4, D, device=device)
        cases = [(q17, state.step_meta(17, 32)), (q4, ctx.meta(4, 32, window=3)), (q4, state.step_meta(4, 32))]
        outs = [kv.attend(0, q, m) for q, m in cases[:2]]
        with kernels.kernels(False):
            outs.append(kv.attend(0, *cases[2]))
        assert calls == []
        set_attention_backend("sdpa")
        for (q, m), y in zip(cases, outs):
            assert torch.equal(y, kv.attend(0, q, m))
        set_attention_backend("triton")


def test_attend_triton_on_cpu_tensors_outside_on_cpu(triton_backend, monkeypatch):
    """CPU tensors reach the kernel only inside kernels.on_cpu() (tests); elsewhere SDPA runs."""
    calls = _spy(monkeypatch)
    kv, state = _cache(2, 1, 2, 16, 64, torch.float32, "cpu", [0, 7])
    q = torch.randn(2, 2, 4, 16)
    y = kv.attend(0, q, state.step_meta(4, 32))
    assert calls == []
    set_attention_backend("sdpa")
    assert torch.equal(y, kv.attend(0, q, state.step_meta(4, 32)))


def test_spec_decode_with_triton_attention_equals_greedy(interpret, hf_targets, monkeypatch):
    """A whole speculative generation with the triton backend (target verify: the causal rule; the
    drafter's block: the block rule; prefill: the kernel too, its 7 tokens ≤ TRITON_MAX_T) equals HF greedy."""
    from conftest import nontrivial_dflash2, spec_drafter

    from dflash2.decoding import greedy_generate
    from dflash2.runtime import generate_spec, load_model
    from dflash2.runtime.drafter import RuntimeDrafter
    from dflash2.target import TargetModel

    calls = _spy(monkeypatch)
    prompts = [[5, 9, 2, 7, 1, 3, 8], [4, 4, 6]]
    hf, folder = hf_targets["qwen3"]
    target = TargetModel(hf, target_layer_ids=[0, 1])
    ref = greedy_generate(target, prompts, 12)
    for device in kernel_devices():
        model = load_model(folder, device=device, target_layer_ids=[0, 1])
        drafter = RuntimeDrafter(nontrivial_dflash2(spec_drafter(target, 4, v2=True, seed=2)).to(device), model)
        old = attention_backend()
        try:
            set_attention_backend("triton")
            out = generate_spec(model, drafter, prompts, 12).sequences
        finally:
            set_attention_backend(old)
        assert out == ref
        assert set(calls) == {True, False}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernel_in_cuda_graph_follows_lengths():
    """Captured once, replayed after the lengths changed in place: equals the twin at the new lengths."""
    N, hkv, G, D, S_max = 2, 8, 4, 128, 512
    kv, state = _cache(N, hkv, G, D, S_max, torch.bfloat16, "cuda", [10, 300])
    q = torch.randn(N, hkv * G, 16, D, device="cuda", dtype=torch.bfloat16)
    old = attention_backend()
    set_attention_backend("triton")
    try:
        meta = state.step_meta(16, S_max)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            kv.attend(0, q, meta)  # compile outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = kv.attend(0, q, meta)
        for lengths in ([10, 300], [0, 496], [257, 3]):
            meta.positions.copy_(torch.tensor(lengths, device="cuda")[:, None] + torch.arange(16, device="cuda"))
            graph.replay()
            ref = decode_attention_ref(q, kv.k[0, :, :, :S_max], kv.v[0, :, :, :S_max], meta.positions)
            torch.testing.assert_close(y.float(), ref.float(), **TOL[torch.bfloat16])
    finally:
        set_attention_backend(old)
