"""The skinny GEMM (dflash2/runtime/kernels/skinny_gemm.py) against its fp32 twin, and its batch invariance.

On the CPU the kernel runs through Triton's interpreter (conftest sets TRITON_INTERPRET=1 on
machines without a GPU; ``kernels.on_cpu()`` sends CPU tensors to it) at small odd shapes with
small tiles, so that K spans several tiles, slices and a partial last tile and N a partial last
column block: fp32 to rounding, bf16 to one unit in the last place (plus the interpreter's
fp32 -> bf16 cast, which truncates). The property the runtime's lossless check needs is tested
bit for bit: a row's output does not depend on M or on the row's position (AR step vs verify
step). ``cuda``-marked tests repeat both at the Qwen3-8B shapes, compiled.
"""

import os

import pytest
import torch
import torch.nn.functional as F

from dflash2.runtime import kernels
from dflash2.runtime.kernels.skinny_gemm import MAX_M, plan, skinny_gemm, skinny_linear, skinny_linear_ref, supported

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
cpu_only = pytest.mark.skipif(
    not INTERPRETED, reason="CPU tensors need TRITON_INTERPRET=1 (set by conftest without a GPU)"
)

N, K = 45, 83  # neither a multiple of any block
# launch options the CPU tests run: single slice, split-K with both reductions, the swapped dot, K tiles
# that divide K evenly (no K mask: EVEN_K) — all with small tiles so that the interpreter is quick
OPTIONS = {
    "plain": dict(block_n=16, block_k=32),
    "split3": dict(block_n=32, block_k=16, split_k=3),
    "split2_fused": dict(block_n=16, block_k=32, split_k=2, reduce="fused"),
    "swap_split2": dict(block_n=16, block_k=16, split_k=2, swap=True),
}


def _inputs(M, n=N, k=K, dtype=torch.float32, device="cpu", bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, k, generator=g).to(device, dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(device, dtype)
    b = torch.randn(n, generator=g).to(device, dtype) if bias else None
    return x, w, b


def _check(y, ref, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    else:  # one bf16 ulp (2^-8 relative) of rounding plus the interpreter's truncating cast
        torch.testing.assert_close(y.float(), ref.float(), rtol=2**-7, atol=1e-2)


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_matches_twin(dtype, name):
    opts = OPTIONS[name]
    p = plan(N, K, dtype, torch.device("cpu"), **opts)
    for M in (1, 3, 16):
        x, w, b = _inputs(M, dtype=dtype, bias=M == 3, seed=M)
        with kernels.on_cpu():
            y = skinny_linear(x, w, b, **opts)
        assert y.shape == (M, N) and y.dtype == dtype
        _check(y, skinny_linear_ref(x, w, b, p["k_split"]), dtype)


@cpu_only
def test_even_k_and_fp16():
    """K a multiple of block_k (the unmasked K loop) and fp16 inputs (a native tl.dot in the interpreter)."""
    for dtype in (torch.float32, torch.float16):
        x, w, b = _inputs(5, n=40, k=64, dtype=dtype, bias=True)
        p = plan(40, 64, dtype, torch.device("cpu"), block_n=16, block_k=32, split_k=2)
        assert p["even_k"] and p["split_k"] == 2
        with kernels.on_cpu():
            y = skinny_linear(x, w, b, block_n=16, block_k=32, split_k=2)
        ref = skinny_linear_ref(x, w, b, p["k_split"])
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(y, ref, **tol)


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["plain", "split3", "split2_fused"])
def test_batch_invariance(dtype, name):
    """Row m of a 16-row call == the same row in a call of 1 or 3 rows, or sent alone from any
    position, bit for bit; and a 40-row call (3 row tiles) agrees with its rows sent one by one."""
    opts = OPTIONS[name]
    x, w, _ = _inputs(40, dtype=dtype)
    with kernels.on_cpu():
        full = skinny_linear(x[:16], w, **opts)
        for M in (1, 3):
            assert torch.equal(skinny_linear(x[:M], w, **opts), full[:M])
        for m in (0, 5, 15):
            assert torch.equal(skinny_linear(x[m : m + 1], w, **opts)[0], full[m])
        # the same rows as a (batch, block) verify input: (2, 8, K) -> (2, 8, N)
        assert torch.equal(skinny_linear(x[:16].view(2, 8, K), w, **opts), full.view(2, 8, N))
        tall = skinny_linear(x, w, **opts)
        assert torch.equal(tall[:16], full)
        for m in (17, 39):
            assert torch.equal(skinny_linear(x[m : m + 1], w, **opts)[0], tall[m])


@cpu_only
def test_fused_reduction_equals_kernel_reduction():
    """Both split-K reductions sum the partials in split order: the same bits, and the fused one leaves
    its arrival counters at zero for the next call."""
    from dflash2.runtime.kernels import skinny_gemm as mod

    x, w, b = _inputs(3, dtype=torch.bfloat16, bias=True)
    with kernels.on_cpu():
        a = skinny_linear(x, w, b, block_n=16, block_k=16, split_k=4, reduce="kernel")
        for _ in range(2):
            f = skinny_linear(x, w, b, block_n=16, block_k=16, split_k=4, reduce="fused")
            assert torch.equal(a, f)
    assert not mod._COUNTERS[("cpu", None)].any()


@cpu_only
def test_strided_and_empty_inputs():
    x, w, b = _inputs(6, bias=True)
    xs = torch.randn(3, 2 * K, generator=torch.Generator().manual_seed(9))[:, ::2]  # K with stride 2
    with kernels.on_cpu():
        torch.testing.assert_close(skinny_linear(xs, w, b, **OPTIONS["plain"]), skinny_linear_ref(xs, w, b))
        ws = torch.randn(2 * N, K)[::2]  # row stride 2·K
        torch.testing.assert_close(skinny_linear(x, ws, **OPTIONS["plain"]), skinny_linear_ref(x, ws))
        assert skinny_gemm(x[:0], w).shape == (0, N)
        torch.testing.assert_close(skinny_gemm(x[:, :0], w[:, :0], b), b.expand(6, N))


def test_plan_depends_on_shape_only():
    """The plan (which fixes the rounding) is a function of (N, K, dtype, device); splits drop empty slices."""
    cpu = torch.device("cpu")
    p = plan(4096, 12288, torch.bfloat16, cpu, split_k=3)
    assert p["block_k"] == 128 and p["k_split"] % p["block_k"] == 0
    assert p["split_k"] * p["k_split"] >= 12288 > (p["split_k"] - 1) * p["k_split"]
    # the defaults bench_gemm's H200 sweep picked per Qwen3-8B weight: (block_n, block_k), no split where
    # the columns fill half the SMs (8 "SMs" off CUDA)
    for (n, k), tiles in {(6144, 4096): (32, 256), (4096, 12288): (32, 128), (24576, 4096): (64, 128)}.items():
        got = plan(n, k, torch.bfloat16, cpu)
        assert (got["block_n"], got["block_k"], got["split_k"]) == (*tiles, 1), (n, k)
    assert plan(64, 4096, torch.bfloat16, cpu)["split_k"] > 1  # 2 column tiles for 8 SMs: K is split
    q = plan(N, K, torch.float32, cpu, block_n=16, block_k=16, split_k=4)  # 6 tiles of K: 3 slices of 2
    assert (q["split_k"], q["k_split"], q["even_k"], q["n_tiles"]) == (3, 32, False, 3)
    assert plan(N, K, torch.float32, cpu, split_k=1)["reduce"] == "none"
    with pytest.raises(ValueError, match="unknown"):
        plan(N, K, torch.float32, cpu, block_m=32)
    with pytest.raises(ValueError, match="powers of two"):
        plan(N, K, torch.float32, cpu, block_n=24)


def test_falls_back_to_f_linear():
    """Unsupported inputs, CPU tensors outside on_cpu() and kernels(False) all run F.linear itself."""
    x, w, b = _inputs(3, dtype=torch.bfloat16, bias=True)
    assert not supported(x, w, b)  # a CPU tensor outside on_cpu()
    assert torch.equal(skinny_linear(x, w, b), F.linear(x, w, b))
    if INTERPRETED:
        with kernels.on_cpu():
            assert supported(x, w, b)
            assert not supported(x, w.float(), b)  # mixed dtypes
            assert not supported(x.to(torch.int32), w.to(torch.int32))
            assert not supported(torch.randn(MAX_M + 1, K), w.float())  # prefill-sized
            assert not supported(x, w.T.contiguous().T)  # weight not contiguous along K
            with kernels.kernels(False):
                assert not supported(x, w, b)
                assert torch.equal(skinny_linear(x, w, b), F.linear(x, w, b))


# ----------------------------------------------------------------------------- CUDA, compiled
QWEN3_8B = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "down": (4096, 12288), "gate_up": (24576, 4096)}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", list(QWEN3_8B))
@pytest.mark.parametrize("reduce", ["kernel", "fused"])
def test_cuda_qwen3_8b_shapes(name, reduce):
    """At the real shapes, bf16 with a bias: the default plan and a forced split-K are within a bf16 ulp of
    the fp32 twin; rows are bit-identical between M = 1, 8, 16 and 40 (3 row tiles) and in any position;
    the two split-K reductions give the same bits."""
    n, k = QWEN3_8B[name]
    x, w, b = _inputs(40, n=n, k=k, dtype=torch.bfloat16, device="cuda", bias=True)
    for opts in ({"reduce": reduce}, {"split_k": 4, "reduce": reduce}):
        p = plan(n, k, torch.bfloat16, x.device, **opts)
        full = skinny_linear(x[:16], w, b, **opts)
        ref = skinny_linear_ref(x[:16], w, b, p["k_split"])
        torch.testing.assert_close(full.float(), ref.float(), rtol=2**-7, atol=1e-2)
        for M in (1, 8):
            assert torch.equal(skinny_linear(x[:M], w, b, **opts), full[:M])
        for m in (3, 15):
            assert torch.equal(skinny_linear(x[m : m + 1], w, b, **opts)[0], full[m])
        tall = skinny_linear(x, w, b, **opts)
        assert torch.equal(tall[:16], full)
        assert torch.equal(skinny_linear(x[37:38], w, b, **opts)[0], tall[37])
        if p["split_k"] > 1:
            other = "kernel" if reduce == "fused" else "fused"
            assert torch.equal(skinny_linear(x[:16], w, b, **{**opts, "reduce": other}), full)
    torch.cuda.synchronize()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_cuda_odd_shapes(dtype, name):
    """The CPU tests' odd shapes and options, compiled: close to the twin, rows bit-identical across M."""
    opts = OPTIONS[name]
    p = plan(N, K, dtype, torch.device("cuda"), **opts)
    x, w, b = _inputs(40, dtype=dtype, device="cuda", bias=True)
    full = skinny_linear(x[:16], w, b, **opts)
    if dtype == torch.bfloat16:
        _check(full, skinny_linear_ref(x[:16], w, b, p["k_split"]), dtype)
    else:
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(full, skinny_linear_ref(x[:16], w, b, p["k_split"]), **tol)
    for M in (1, 3):
        assert torch.equal(skinny_linear(x[:M], w, b, **opts), full[:M])
    assert torch.equal(skinny_linear(x[7:8], w, b, **opts)[0], full[7])
    assert torch.equal(skinny_linear(x, w, b, **opts)[:16], full)


def test_counters_grow_without_freeing_the_outgrown_buffer():
    """A larger grid gets a larger counter buffer; the smaller one stays referenced (a CUDA graph captured
    while it was current still points at it), and a buffer large enough is reused."""
    from dflash2.runtime.kernels import skinny_gemm as mod

    dev, key = torch.device("cpu"), ("cpu", None)
    before = mod._COUNTERS.pop(key, None)
    try:
        small = mod._counters(dev, 10)
        assert small.numel() >= 10 and not small.any()
        assert mod._counters(dev, small.numel()) is small
        big = mod._counters(dev, small.numel() + 1)
        assert big.numel() > small.numel() and not big.any()
        assert mod._counters(dev, 5) is big
        assert any(b is small for b in mod._OUTGROWN)
    finally:
        mod._COUNTERS.pop(key, None)
        if before is not None:
            mod._COUNTERS[key] = before


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_counters_grown_inside_a_capture_belong_to_that_graph():
    """Inside a capture a too-small cached buffer is not replaced (eager calls keep theirs); the graph gets
    its own, zeroed at every replay."""
    from dflash2.runtime.kernels import skinny_gemm as mod

    dev = torch.device("cuda", torch.cuda.current_device())
    cached = mod._counters(dev, 1)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        own = mod._counters(dev, cached.numel() + 1)
    assert mod._counters(dev, 1) is cached
    assert own is not cached and own.numel() > cached.numel()
    own.fill_(7)
    graph.replay()
    torch.cuda.synchronize()
    assert not own.any()
