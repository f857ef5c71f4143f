"""Decode attention over the static KV cache, split over the key length (twin: a naive fp32 softmax).

What it computes is exactly ``KVCache.attend``'s masked SDPA (docs/ARCHITECTURE.md §6):
row n holds T new query tokens at ``positions[n]``; query head h = j·G + g reads K/V
head j (GQA, G = H / Hkv, never copied per query head), and token t sees key positions

    causal=True:   s ≤ positions[n, t]      (the target's step: the context + the block causally)
    causal=False:  s ≤ positions[n, T-1]    (the drafter's step: the context + the whole block)

and s < S. Scores are scaled by 1/sqrt(D) (SDPA's default).

Why split-K (flash-decoding): a decode step has only G·T query rows per (row, K/V head) —
4 for a Qwen3-8B AR step — so one program per (row, K/V head) would put 8 programs on a
132-SM GPU at batch 1, each walking all keys serially. Instead the key range is cut into
``num_splits`` chunks and each chunk gets its own program, which writes an unnormalised
partial (running max m, sum l, accumulator acc, all fp32) for its G·T rows; a second
small kernel merges the chunks (rescale each by 2^(m_c − max m), sum, divide). With one
chunk the first kernel writes the normalised output itself and the second never runs.

The grid depends only on the shapes (N, Hkv, G·T, S and the options), never on the
lengths, so the launch can be captured in a CUDA graph per attended-length bucket; each
program reads its rows' limits from ``positions`` on the device and loads only keys that
some of its rows can see, so chunks past the longest row (the bucket's slack) cost one
early exit. No host sync anywhere.

Precision: q·k and p·v accumulate in fp32 (tensor cores for bf16/fp16; fp32 inputs use
IEEE fp32 dots, not TF32); the softmax is online in fp32 (base 2, the log2(e) folded into
the scale); p is rounded to the value dtype before p·v, as every flash kernel does, and
the output is rounded once to q's dtype.

Shapes: N rows, T query tokens per row, H query heads, Hkv K/V heads, G = H / Hkv,
M = G·T folded query rows (row g·T + t, the order ``KVCache.attend`` folds), S keys
attended, D head_dim (any D ≤ 256: the tile is the next power of two, masked).
"""

from __future__ import annotations

import math

import torch
import triton.language as tl

from dflash2.runtime.kernels import jit

MAX_HEAD_DIM = 256
_LOG2E = 1.4426950408889634


def decode_attention_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, causal: bool = True
) -> torch.Tensor:
    """The naive twin: mask from positions, fp32 softmax, output in q's dtype.

    q (N, H, T, D); k, v (N, Hkv, S, D); positions (N, T) long -> (N, H, T, D).
    """
    N, H, T, D = q.shape
    hkv, S = k.shape[1], k.shape[2]
    G = H // hkv
    limit = positions if causal else positions[:, -1:].expand(N, T)  # (N, T) last visible key per token
    keys = torch.arange(S, device=q.device)
    visible = (keys <= limit[..., None]).repeat(1, G, 1)[:, None]  # (N, 1, G·T, S), row g·T + t
    qg = q.float().reshape(N, hkv, G * T, D)  # head j·G + g -> K/V head j, query row g·T + t
    scores = qg @ k.float().transpose(-1, -2) / math.sqrt(D)  # (N, Hkv, G·T, S)
    p = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return (p @ v.float()).to(q.dtype).reshape(N, H, T, D)


def _decode_attention_partial(
    q_ptr,
    k_ptr,
    v_ptr,
    pos_ptr,
    out_ptr,
    acc_ptr,
    ml_ptr,
    HKV,
    M,
    T,
    S,
    CHUNK,
    SPLITS,
    qk_scale,
    s_qn,
    s_qh,
    s_qm,
    s_kn,
    s_kh,
    s_ks,
    s_vn,
    s_vh,
    s_vs,
    s_pn,
    s_pt,
    s_on,
    s_oj,
    s_og,
    s_ot,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT: tl.constexpr,
):
    # program (n·Hkv + j, chunk c, query tile): rows mt·BLOCK_M .. of (n, j) against keys c·CHUNK ..
    nj = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    mt = tl.program_id(2)
    n = nj // HKV
    j = nj % HKV
    rows = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    if CAUSAL:  # noqa: SIM108 (constexpr branches: only one side is compiled)
        t = rows % T
    else:
        t = tl.zeros([BLOCK_M], dtype=tl.int32) + (T - 1)
    # exclusive key limit per row; rows past M get 0 so they never extend the loop
    # (int32 from here: key offsets stay 32-bit, pointers are formed from a 64-bit per-program base)
    lim = tl.load(pos_ptr + n * s_pn + t * s_pt, mask=row_ok, other=-1).to(tl.int32) + 1
    lim = tl.minimum(lim, S)
    start = c * CHUNK
    stop = tl.minimum(start + CHUNK, tl.max(lim, axis=0))  # keys no row of this tile sees are never loaded
    q = tl.load(
        q_ptr + n * s_qn + j * s_qh + rows[:, None] * s_qm + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0
    )
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    k_base = k_ptr + n * s_kn + j * s_kh
    v_base = v_ptr + n * s_vn + j * s_vh
    for s0 in range(start, stop, BLOCK_N):
        cols = s0 + tl.arange(0, BLOCK_N)
        kv_ok = (cols < stop)[:, None] & d_ok[None, :]
        k = tl.load(k_base + cols[:, None] * s_ks + d[None, :], mask=kv_ok, other=0.0)
        if DOT == 1:  # fp32 inputs: IEEE fp32 dots, not TF32
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        elif DOT == 2:  # bf16 in the interpreter: the same exact products, in fp32 (see _dot_mode)
            qk = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        qk = tl.where(cols[None, :] < lim[:, None], qk * qk_scale, float("-inf"))  # (BLOCK_M, BLOCK_N), log2 units
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet: exp2(-inf) = 0, no NaN
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(qk - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + cols[:, None] * s_vs + d[None, :], mask=kv_ok, other=0.0)
        if DOT == 1:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        elif DOT == 2:  # p still rounded to bf16 first, as on the GPU
            pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
            acc = acc * alpha[:, None] + pv
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    if SPLIT:
        # partials (Hkv·N, SPLITS, M, ·): the combine kernel rescales and sums them
        part = (nj * SPLITS + c) * M
        tl.store(acc_ptr + part * D + rows[:, None] * D + d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])
        tl.store(ml_ptr + part * 2 + rows * 2, m_i, mask=row_ok)
        tl.store(ml_ptr + part * 2 + rows * 2 + 1, l_i, mask=row_ok)
    else:
        y = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # l = 0 only for a row with no visible key: output 0
        # row g·T + t of K/V head j is query head j·G + g, token t: placed by the output's strides
        o = out_ptr + n * s_on + j * s_oj + ((rows // T) * s_og + (rows % T) * s_ot)[:, None] + d[None, :]
        tl.store(o, y.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _decode_attention_combine(
    acc_ptr,
    ml_ptr,
    out_ptr,
    M,
    SPLITS,
    HKV,
    T,
    s_on,
    s_oj,
    s_og,
    s_ot,
    D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # program (n·Hkv + j, row tile): merge the SPLITS partials of BLOCK_R query rows, all loaded at once
    nj = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    cs = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    ok = (rows < M)[:, None] & (cs < SPLITS)[None, :]  # (BLOCK_R, BLOCK_S)
    base = nj * SPLITS * M  # this (row, head)'s first partial row (64-bit); offsets within it are 32-bit
    part = cs[None, :] * M + rows[:, None]
    m = tl.load(ml_ptr + base * 2 + part * 2, mask=ok, other=float("-inf"))
    l_c = tl.load(ml_ptr + base * 2 + part * 2 + 1, mask=ok, other=0.0)
    m_max = tl.max(m, axis=1)
    w = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max)[:, None])  # empty chunks (m = -inf) weigh 0
    d_ok = (d < D)[None, None, :]
    acc = tl.load(acc_ptr + base * D + part[:, :, None] * D + d[None, None, :], mask=ok[:, :, None] & d_ok, other=0.0)
    total = tl.sum(w * l_c, axis=1)
    y = tl.sum(w[:, :, None] * acc, axis=1) / tl.where(total > 0, total, 1.0)[:, None]  # (BLOCK_R, BLOCK_D)
    n, j = nj // HKV, nj % HKV
    o = out_ptr + n * s_on + j * s_oj + ((rows // T) * s_og + (rows % T) * s_ot)[:, None] + d[None, :]
    tl.store(o, y.to(out_ptr.dtype.element_ty), mask=(rows < M)[:, None] & (d < D)[None, :])


def _dot_mode(dtype: torch.dtype) -> int:
    """How the kernel multiplies tiles: 0 natively (bf16 / fp16 on tensor cores, fp32 accumulation),
    1 IEEE fp32 (fp32 inputs: not TF32), 2 bf16 upcast to fp32 first — only under Triton's interpreter,
    whose tl.dot multiplies bf16 tiles as raw 16-bit integers (triton 3.9); bf16 × bf16 products are
    exact in fp32, so this is the same arithmetic as the GPU's."""
    from dflash2.runtime.kernels.triton_util import interpreting

    if dtype == torch.float32:
        return 1
    return 2 if dtype == torch.bfloat16 and interpreting() else 0


def _next_pow2(n: int) -> int:
    return 1 << (max(int(n), 1) - 1).bit_length()


_SM_COUNT: dict = {}


def _sm_count(device: torch.device) -> int:
    """SMs of a CUDA device (cached: a property read is not free); 8 for the interpreter (small grids)."""
    if device.type != "cuda":
        return 8
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def plan(N: int, hkv: int, M: int, S: int, D: int, device: torch.device, **options) -> dict:
    """Tiles, chunks and warps of one launch, from the shapes only (so a captured graph's grid is fixed).

    options (tuning knobs, the benchmark sweeps them): num_splits (key chunks per (row, K/V head);
    default: enough programs for ~2 per SM, at most one chunk per key tile), block_n (keys per tile),
    block_m (query rows per program), num_warps, num_stages (software pipelining of the key loop; None:
    Triton's default). Returns the resolved values, chunk (keys per chunk) and splits (chunks actually
    launched: trailing empty ones dropped).
    """
    block_d = max(16, _next_pow2(D))  # tl.dot needs ≥ 16 on every side
    block_m = options.get("block_m") or min(64, max(16, _next_pow2(M)))
    block_n = options.get("block_n") or (64 if block_d <= 128 else 32)
    m_tiles = -(-M // block_m)
    key_tiles = max(1, -(-S // block_n))
    splits = options.get("num_splits")
    if not splits:
        # why: at batch 1 only Hkv programs would exist; cut the keys until ~2 programs per SM run
        splits = -(-2 * _sm_count(device) // (N * hkv * m_tiles))
    splits = max(1, min(int(splits), key_tiles))
    tiles_per_chunk = -(-key_tiles // splits)
    splits = -(-key_tiles // tiles_per_chunk)  # e.g. 5 tiles in 4 chunks of 2: 3 chunks
    # 8 warps once the fp32 accumulator reaches 64 × 128 (4 spill there when compiled for sm_90)
    warps = options.get("num_warps") or (4 if block_m * block_d < 64 * 128 else 8)
    return dict(
        block_m=block_m,
        block_n=block_n,
        block_d=block_d,
        m_tiles=m_tiles,
        splits=splits,
        chunk=tiles_per_chunk * block_n,
        num_warps=warps,
        num_stages=options.get("num_stages"),
    )


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    causal: bool = True,
    token_major: bool = False,
    **options,
) -> torch.Tensor:
    """Masked softmax attention of a decode / verify block over the cache (Triton; see the module docstring).

    q (N, H, T, D); k, v (N, Hkv, S, D) with unit stride in D (e.g. ``KVCache.k[slot, :, :, :S]``, a view);
    positions (N, T) long on the device; bf16, fp16 or fp32 (q, k, v one dtype). Returns (N, H, T, D) in
    q's dtype; with ``token_major`` (N, T, H, D) contiguous instead — the layout the output projection
    reads, written by the kernel directly (no transposing copy after it). options: see :func:`plan`.
    CPU tensors need Triton's interpreter.
    """
    from dflash2.runtime.kernels.triton_util import check_device

    N, H, T, D = q.shape
    if k.dim() != 4 or k.shape != v.shape or k.shape[0] != N or k.shape[3] != D:
        raise ValueError(f"k, v must be (N, Hkv, S, D) = ({N}, Hkv, S, {D}); got {tuple(k.shape)}, {tuple(v.shape)}")
    hkv, S = k.shape[1], k.shape[2]
    if H % hkv:
        raise ValueError(f"{H} query heads do not split into groups over {hkv} K/V heads")
    if D > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {D} > {MAX_HEAD_DIM}: the kernel keeps a D-wide tile per program")
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one of bf16 / fp16 / fp32; got {q.dtype}, {k.dtype}, {v.dtype}")
    if positions.shape != (N, T):
        raise ValueError(f"positions must be (N, T) = ({N}, {T}); got {tuple(positions.shape)}")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("k and v need unit stride in head_dim")
    check_device(q, k, v)
    G = H // hkv
    M = G * T
    qg = q.reshape(N, hkv, M, D)  # a view for a contiguous q: head j·G + g, row g·T + t
    if qg.stride(-1) != 1:
        qg = qg.contiguous()
    if token_major:  # out[n, t, j·G + g] for row g·T + t of K/V head j
        out = torch.empty(N, T, H, D, dtype=q.dtype, device=q.device)
        out_strides = (T * H * D, G * D, D, H * D)
    else:  # (N, Hkv, M, D): row g·T + t of head j, i.e. (N, H, T, D)
        out = torch.empty(N, hkv, M, D, dtype=q.dtype, device=q.device)
        out_strides = (hkv * M * D, M * D, T * D, D)
    shape = (N, T, H, D) if token_major else (N, H, T, D)
    if N == 0 or M == 0:
        return out.view(shape)
    p = plan(N, hkv, M, S, D, q.device, **options)
    split = p["splits"] > 1
    if split:
        acc = torch.empty(N * hkv, p["splits"], M, D, dtype=torch.float32, device=q.device)
        ml = torch.empty(N * hkv, p["splits"], M, 2, dtype=torch.float32, device=q.device)
    else:
        acc = ml = out  # not touched: the kernel writes the output directly
    jit(_decode_attention_partial)[(N * hkv, p["splits"], p["m_tiles"])](
        qg,
        k,
        v,
        positions,
        out,
        acc,
        ml,
        hkv,
        M,
        T,
        S,
        p["chunk"],
        p["splits"],
        _LOG2E / math.sqrt(D),
        qg.stride(0),
        qg.stride(1),
        qg.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        positions.stride(0),
        positions.stride(1),
        *out_strides,
        D=D,
        BLOCK_M=p["block_m"],
        BLOCK_N=p["block_n"],
        BLOCK_D=p["block_d"],
        CAUSAL=bool(causal),
        SPLIT=split,
        DOT=_dot_mode(q.dtype),
        num_warps=p["num_warps"],
        **({} if p["num_stages"] is None else {"num_stages": p["num_stages"]}),
    )
    if split:
        block_s = _next_pow2(p["splits"])
        # rows per program: a (rows, splits, D) fp32 tile of ≤ 4096 values, 32 per thread at 4 warps
        block_r = max(1, min(_next_pow2(M), 4096 // (block_s * p["block_d"])))
        jit(_decode_attention_combine)[(N * hkv, -(-M // block_r))](
            acc,
            ml,
            out,
            M,
            p["splits"],
            hkv,
            T,
            *out_strides,
            D=D,
            BLOCK_R=block_r,
            BLOCK_S=block_s,
            BLOCK_D=p["block_d"],
            num_warps=4,
        )
    return out.view(shape)
