"""Skinny GEMM y = x @ Wᵀ for decode steps: a few rows against a weight streamed once (twin: fp32 matmul).

    x (M, K), W (N, K) as ``nn.Linear`` stores it, optional bias (N,)  ->  y (M, N) in x's dtype
    y[m, n] = round(Σ_k x[m, k]·W[n, k] + bias[n])      fp32 accumulation, one rounding at the end

M is small — 1..16 in a decode step (AR at batch 1–8, a block-16 verify at batch 1); up to
:data:`MAX_M` rows are accepted (a verify at batch 8 is 128 rows) — and N·K is large: the time is
one read of W (2·N·K bytes in bf16) and the kernel is built to stream W at full HBM bandwidth.

Why: cuBLAS picks, per shape, kernels that leave bandwidth unused at these shapes (measured on an
H200 at the Qwen3-8B shapes, batch 1: q|k|v 4096 -> 6144 at ~78 % of copy bandwidth, o_proj
4096 -> 4096 at ~74 % plus a split-K reduction kernel; gate|up 4096 -> 24576 is fine at ~97 %).

Tiling. Program (m tile, n tile, k split) owns BLOCK_N output columns of BLOCK_M = 16 rows and
one slice of K (``k_split`` elements, a multiple of BLOCK_K; SPLIT_K slices). It walks its slice
in (BLOCK_N, BLOCK_K) tiles of W, loaded along K (W's contiguous axis), with the matching
(16, BLOCK_K) tile of x (masked to the M real rows; x is small and stays in L2), and accumulates
``acc = dot(x, Wᵀ, acc)`` on tensor cores in fp32 (fp32 inputs: IEEE fp32 dots, not TF32). W's
rows past N are clamped to row N-1 (no mask on the streamed operand; those columns are never
stored). ``swap=True`` computes the transposed tile ``dot(W, xᵀ)`` instead (W as the MMA's A
operand; a tuning knob). Compiled for sm_90 (on a CPU machine, triton 3.9), the loads are 16-byte
``cp.async`` copies into shared memory, ``num_stages`` - 1 tiles ahead (Triton's software
pipeline); dot(x, Wᵀ) is ``mma.sync`` m16n8k16, the swapped dot ``wgmma``; none of the
benchmark's tiles spill. M > 16 runs ceil(M / 16) row tiles, each streaming W again (m is the
fastest grid axis, so a W tile's row tiles run together and the repeats mostly hit L2).

Reduction over K (deterministic). With SPLIT_K = 1 the program rounds and stores its tile. With
SPLIT_K > 1 each program writes its fp32 partial to ``part`` (SPLIT_K, M, N), and the partials
are summed in split order — part[0] + part[1] + ... — either by a second small kernel
(``reduce="kernel"``, the default) or by the last program of each tile to finish
(``reduce="fused"``: programs count arrivals with an atomic counter per tile; whoever arrives
last, it sums all SPLIT_K partials in the same fixed order and resets the counter, so the result
is the same bits as the two-kernel path — only *who* sums depends on scheduling, not *how*; it
saves the second launch but needs a per-device counter workspace, so it is opt-in and must not
run on two streams at once). No atomics ever touch the values: results never depend on
scheduling.

Batch invariance (what lossless speculative decoding needs: the AR step runs M = batch rows, the
verify step M = batch · block, and a row must come out the same bits in both). A row's result
depends on its own x row, W and the order of its fp32 sum over K, and that order is fixed by the
launch plan — BLOCK_K, SPLIT_K / k_split, and swap (mma.sync or wgmma: different instructions,
different rounding) — which :func:`plan` derives from (N, K, dtype, device) only, never from M.
Every row tile is the same 16-row tile (rows past M are zeros, masked), and M is not a
specialisation key (``do_not_specialize``: Triton would otherwise compile separate variants for
M = 1 and M % 16 = 0), so every M runs the same binary and a row computes identically at any M
and in any position: row m of a call with M = 16 equals the same x row sent alone. Tested bit for
bit in tests/test_runtime_skinny_gemm.py, interpreted (where the tile products are explicit fp32
products and sums, see :func:`_dot_mode`) and, cuda-marked, compiled. Options passed by hand are
part of the plan: use the same ones for every M of a model.

Runtime switch (opt-in). ``gemm.set_gemm_backend("skinny")`` (dflash2/runtime/gemm.py; the default
'cublas' keeps ``F.linear``) sends the runtime target's projections (q|k|v, o_proj, gate|up,
down_proj, the GDN in/out projections, lm_head) here through ``gemm.linear``, with the default plan,
so the AR and the verify step use the kernel alike (both, or neither: else the two steps round
differently). ``kernels(False)`` turns it off with the other kernels; the fallback is ``F.linear``.
Prefill (M > MAX_M) keeps cuBLAS. The default ``reduce="kernel"`` keeps no cached workspace, so a
CUDA graph may capture it; ``reduce="fused"``'s counters are cached per device (warm up first).

Twin: :func:`skinny_linear_ref` (tests): the same K slices, each an fp32 matmul, summed in split
order, bias added in fp32, rounded once; it differs from the kernel only by the summation order
inside a slice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton.language as tl

from dflash2.runtime.kernels import jit, use_triton
from dflash2.runtime.kernels.attention import _next_pow2, _sm_count

BLOCK_M = 16  # rows per program: tl.dot's minimum, and the same for every M (batch invariance)
MAX_M = 128  # rows skinny_linear sends to the kernel; more (prefill) go to F.linear
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
REDUCE = ("kernel", "fused")


# ----------------------------------------------------------------------------- twin
def skinny_linear_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, k_split: int | None = None
) -> torch.Tensor:
    """The fp32 twin: x (..., K), weight (N, K), bias (N,) or None -> (..., N) in x's dtype.

    K is cut into slices of ``k_split`` (all of K when None; :func:`plan`'s ``k_split`` gives the
    kernel's), each an fp32 matmul, summed in slice order, plus the bias in fp32, rounded once."""
    K = x.shape[-1]
    step = k_split or K
    xf, wf = x.float(), weight.float()
    acc = None
    for k0 in range(0, K, step):
        part = xf[..., k0 : k0 + step] @ wf[:, k0 : k0 + step].T
        acc = part if acc is None else acc + part
    if acc is None:  # K = 0
        acc = xf.new_zeros(*x.shape[:-1], weight.shape[0])
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(x.dtype)


# ----------------------------------------------------------------------------- kernels
def _skinny_gemm_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    part_ptr,
    cnt_ptr,
    M,
    N,
    K,
    K_SPLIT,
    s_xm,
    s_wn,
    s_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    FUSED: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SWAP: tl.constexpr,
    DOT: tl.constexpr,
):
    # program (m tile, n tile, k split); m fastest, so the programs sharing a W tile run together
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    w_rows = tl.minimum(cols, N - 1)  # clamped: the streamed operand needs no mask on N
    ks = tl.arange(0, BLOCK_K)
    # 64-bit row offsets (lm_head: N·K is ~6e8 elements); offsets along K stay 32-bit
    x_tile = x_ptr + rows.to(tl.int64)[:, None] * s_xm + ks[None, :]  # (BLOCK_M, BLOCK_K)
    w_tile = w_ptr + w_rows.to(tl.int64)[:, None] * s_wn + ks[None, :]  # (BLOCK_N, BLOCK_K)
    k_lo = pid_k * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    if SWAP:  # noqa: SIM108 (constexpr branches: only one side is compiled)
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_tile + k0, mask=row_ok[:, None], other=0.0)
            w = tl.load(w_tile + k0)
        else:  # the last tile of K is partial: zeros past K in both operands
            k_ok = (k0 + ks < K)[None, :]
            x = tl.load(x_tile + k0, mask=row_ok[:, None] & k_ok, other=0.0)
            w = tl.load(w_tile + k0, mask=k_ok, other=0.0)
        if DOT == 2:  # the interpreter: explicit fp32 products and sums (see _dot_mode)
            if SWAP:
                acc += tl.sum(w.to(tl.float32)[:, None, :] * x.to(tl.float32)[None, :, :], axis=2)
            else:
                acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
        elif SWAP:
            if DOT == 0:  # noqa: SIM108 (as above)
                acc = tl.dot(w, tl.trans(x), acc)
            else:  # fp32: IEEE, not TF32
                acc = tl.dot(w, tl.trans(x), acc, input_precision="ieee")
        else:
            if DOT == 0:  # noqa: SIM108 (as above)
                acc = tl.dot(x, tl.trans(w), acc)
            else:
                acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
    if SWAP:
        acc = tl.trans(acc)  # (BLOCK_M, BLOCK_N)
    out_ok = row_ok[:, None] & col_ok[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        y = y_ptr + rows.to(tl.int64)[:, None] * s_ym + cols[None, :]
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=out_ok)
    else:
        # partials (SPLIT_K, M, N) fp32, contiguous; M·N is small (≤ MAX_M · N)
        mn = rows.to(tl.int64)[:, None] * N + cols[None, :]
        tl.store(part_ptr + pid_k.to(tl.int64) * M * N + mn, acc, mask=out_ok)
        if FUSED:
            tile = pid_n * tl.num_programs(0) + pid_m
            tl.debug_barrier()  # every thread's partial stored before the arrival is counted
            arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT_K - 1:  # the last of the tile's splits: sum them in split order
                tl.debug_barrier()
                total = tl.load(part_ptr + mn, mask=out_ok, other=0.0, cache_modifier=".cg")
                for s in tl.static_range(1, SPLIT_K):
                    total += tl.load(part_ptr + s * M * N + mn, mask=out_ok, other=0.0, cache_modifier=".cg")
                if HAS_BIAS:
                    total += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
                y = y_ptr + rows.to(tl.int64)[:, None] * s_ym + cols[None, :]
                tl.store(y, total.to(y_ptr.dtype.element_ty), mask=out_ok)
                tl.atomic_xchg(cnt_ptr + tile, 0)  # ready for the next call (or graph replay)


def _splitk_reduce_kernel(
    part_ptr, b_ptr, y_ptr, M, N, s_ym, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr
):
    # program (column block, row): y[row, cols] = round(part[0] + part[1] + ... (+ bias)), in split order
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    row = tl.program_id(1).to(tl.int64)
    ok = cols < N
    total = tl.load(part_ptr + row * N + cols, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        total += tl.load(part_ptr + (s * M + row) * N + cols, mask=ok, other=0.0)
    if HAS_BIAS:
        total += tl.load(b_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * s_ym + cols, total.to(y_ptr.dtype.element_ty), mask=ok)


# ----------------------------------------------------------------------------- launch plan
# Weights at least this wide (gate|up, LM heads) stream best in 64-column tiles of 128 K (the sweep's winners
# there); narrower ones (q|k|v, o_proj, down) in 32-column tiles.
WIDE_N = 16384


def plan(N: int, K: int, dtype: torch.dtype, device: torch.device, **options) -> dict:
    """The launch plan of a (N, K) weight: tiles, K slices, warps, stages — never a function of M.

    options (tuning knobs; dflash2/runtime/bench_gemm.py sweeps them): block_n (output columns per
    program), block_k (K per tile), split_k (slices of K; 1 = none), reduce ("kernel" | "fused", how
    split partials are summed), swap (dot(W, xᵀ) instead of dot(x, Wᵀ)), num_warps, num_stages.
    Defaults, from bench_gemm's sweep on an H200 (docs/BENCHMARKS.md): block_n 32, or 64 for N ≥ WIDE_N;
    block_k 256, or 128 for fp32, N ≥ WIDE_N or K > 4096, capped at K rounded up to a power of two (≥ 16:
    tl.dot's minimum); split_k cuts K only when the columns fill fewer than half the SMs, to ~2 programs
    per SM, keeping slices ≥ 4 tiles. Returned: the resolved knobs, k_split (K elements per slice, a multiple of
    block_k), split_k (slices actually launched: empty trailing ones dropped), n_tiles, even_k.
    """
    unknown = set(options) - {"block_n", "block_k", "split_k", "reduce", "swap", "num_warps", "num_stages"}
    if unknown:
        raise ValueError(f"unknown skinny GEMM options {sorted(unknown)}")
    sms = _sm_count(torch.device(device))
    wide = N >= WIDE_N  # gate|up, LM heads: wider column tiles, shorter K tiles
    block_k = options.get("block_k") or min(
        128 if dtype == torch.float32 or wide or K > 4096 else 256, max(16, _next_pow2(K))
    )
    block_n = options.get("block_n") or (64 if wide else 32)
    if block_n < 16 or block_k < 16 or block_n & (block_n - 1) or block_k & (block_k - 1):
        raise ValueError(f"block_n {block_n} and block_k {block_k} must be powers of two ≥ 16 (tl.dot)")
    n_tiles = -(-N // block_n)
    k_tiles = max(1, -(-K // block_k))
    split = options.get("split_k")
    if not split:  # only where the columns fill under half the SMs: splitting costs a partial write and a sum
        split = 1 if 2 * n_tiles >= sms else min(-(-2 * sms // n_tiles), max(1, k_tiles // 4))
    split = max(1, min(int(split), k_tiles))
    tiles_per_split = -(-k_tiles // split)
    split = -(-k_tiles // tiles_per_split)  # e.g. 5 tiles in 4 slices of 2: 3 slices
    reduce = options.get("reduce") or "kernel"
    if reduce not in REDUCE:
        raise ValueError(f"reduce must be one of {REDUCE}; got {reduce!r}")
    return dict(
        block_m=BLOCK_M,
        block_n=block_n,
        block_k=block_k,
        split_k=split,
        k_split=tiles_per_split * block_k,
        reduce=reduce if split > 1 else "none",
        swap=bool(options.get("swap", False)),
        num_warps=options.get("num_warps") or 4,
        num_stages=options.get("num_stages") or 4,
        n_tiles=n_tiles,
        even_k=K % block_k == 0,
    )


def _dot_mode(dtype: torch.dtype) -> int:
    """How the kernel multiplies tiles: 0 ``tl.dot`` natively (bf16 / fp16 on tensor cores, fp32
    accumulation), 1 ``tl.dot`` in IEEE fp32 (fp32 inputs: not TF32), 2 under Triton's interpreter:
    fp32 products summed with ``tl.sum`` — the interpreter's tl.dot is numpy's matmul, whose BLAS
    rounds a row differently depending on its position in the tile (an ulp in fp32; and bf16 tiles
    are multiplied as raw integers in triton 3.9), so it could not test batch invariance; numpy's
    sum over the last axis sums every (row, column) in the same order."""
    from dflash2.runtime.kernels.triton_util import interpreting

    if interpreting():
        return 2
    return 1 if dtype == torch.float32 else 0


_COUNTERS: dict = {}
# counters a larger grid outgrew, kept alive: a CUDA graph captured while one was current still points at it,
# and freed memory would be handed to other tensors whose bytes the graph's kernels would then count in
_OUTGROWN: list = []


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """The fused reduction's arrival counters: at least n int32 zeros, reset by the kernel itself after each use.

    Cached per device and grown when a larger grid needs more; the one it replaces stays allocated (_OUTGROWN).
    Inside a CUDA graph capture a buffer too small is not replaced: the capture gets a buffer of its own from
    its private pool, zeroed by a memset that every replay of that graph repeats (never cached: outside the
    graph those zeros would not exist)."""
    key = (device.type, device.index)
    buf = _COUNTERS.get(key)
    if buf is not None and buf.numel() >= n:
        return buf
    fresh = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return fresh
    if buf is not None:
        _OUTGROWN.append(buf)
    _COUNTERS[key] = fresh
    return fresh


# ----------------------------------------------------------------------------- entry points
def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, **options) -> torch.Tensor:
    """The Triton kernel itself: x (M, K) with unit stride in K, weight (N, K) with unit stride in K,
    bias (N,) or None, one dtype of :data:`DTYPES` -> y (M, N) contiguous. options: see :func:`plan`.
    CPU tensors need Triton's interpreter (the caller checks; :func:`skinny_linear` falls back)."""
    M, K = x.shape
    N = weight.shape[0]
    if weight.shape[1] != K or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"x (M, K) and weight (N, K) need one K and unit stride in it; got {x.shape}, {weight.shape}")
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    if K == 0:
        return y.copy_(bias.expand(M, N)) if bias is not None else y.zero_()
    p = plan(N, K, x.dtype, x.device, **options)
    split = p["split_k"]
    m_tiles = -(-M // BLOCK_M)
    part = torch.empty(split, M, N, dtype=torch.float32, device=x.device) if split > 1 else y
    fused = p["reduce"] == "fused"
    cnt = _counters(x.device, m_tiles * p["n_tiles"]) if fused else y
    b = bias if bias is not None else y  # never read without HAS_BIAS
    jit(_skinny_gemm_kernel, do_not_specialize=("M",))[(m_tiles, p["n_tiles"], split)](
        x,
        weight,
        b,
        y,
        part,
        cnt,
        M,
        N,
        K,
        p["k_split"],
        x.stride(0),
        weight.stride(0),
        y.stride(0),
        BLOCK_M=BLOCK_M,
        BLOCK_N=p["block_n"],
        BLOCK_K=p["block_k"],
        SPLIT_K=split,
        FUSED=fused,
        EVEN_K=p["even_k"],
        HAS_BIAS=bias is not None,
        SWAP=p["swap"],
        DOT=_dot_mode(x.dtype),
        num_warps=p["num_warps"],
        num_stages=p["num_stages"],
    )
    if split > 1 and not fused:
        block = min(1024, max(128, _next_pow2(N)))
        jit(_splitk_reduce_kernel, do_not_specialize=("M",))[(-(-N // block), M)](
            part, b, y, M, N, y.stride(0), SPLIT_K=split, BLOCK=block, HAS_BIAS=bias is not None, num_warps=4
        )
    return y


def supported(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether :func:`skinny_linear` sends these tensors to the kernel (else F.linear)."""
    if not use_triton(x) or weight.device != x.device or weight.dim() != 2 or x.dim() < 1:
        return False
    if x.dtype not in DTYPES or weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        return False
    M = x.numel() // max(x.shape[-1], 1)
    return 1 <= M <= MAX_M and weight.shape[1] == x.shape[-1] and weight.stride(1) == 1


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, **options) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for decode-sized inputs: x (..., K), weight (N, K), bias (N,) -> (..., N).

    The Triton kernel for CUDA tensors (CPU ones inside ``kernels.on_cpu()``) of one dtype among
    bf16 / fp16 / fp32, 1 ≤ M ≤ MAX_M rows (M = x.numel() / K) and unit stride along K in the
    weight; anything else — and everything under ``kernels(False)`` — runs ``F.linear``.
    options: see :func:`plan` (use the same for every M: they fix the rounding)."""
    if not supported(x, weight, bias):
        return F.linear(x, weight, bias)
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return skinny_gemm(x2, weight, bias, **options).view(*x.shape[:-1], weight.shape[0])
