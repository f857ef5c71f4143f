"""The verify's chunked recurrence (``chunked=True``, ReplaySSM only; twin: chunked_reference.py).

``gdn_recur_chunk_kernel`` replaces kernel.py's ``gdn_recur_kernel`` after the same prep kernel, on
grid (d_v / BV, N·H). A program owns BV value columns of one (row, value head), a whole number M of
the sequential kernel's block_v-wide slices (BV = chunk_block_v, default block_v: M = 1, the
sequential grid), so the deferred commit's pending counts keep their layout (one per block_v slice;
all equal within a row, as the deferred commit kernel writes them). A program

1. reads its first slice's pending count n and, if n > 0, folds the pending tokens into its state
   tile exactly as gdn_recur_kernel does (the same ``_fold_rows`` / ``_fold_token``, same order: bit
   for bit the commit kernel's state; the fold is elementwise, so the tile's width changes nothing),
   writes the tile back and zeroes the counts of its M slices;
2. computes the block's outputs and logged u from that state S0 per chunk of BT = 16 tokens (the
   equations in chunked_reference.py), in two phases:

   * a loop over d_k in KB-row slices (KB = chunk_block_k) accumulating KS0 = K S0 and QS0 = Q S0
     (BT × BW) and KKᵀ, QKᵀ (BT × BT) with tl.dot, each slice of S0 re-read from ``rec`` (where the
     fold left it: no state tile stays live in registers);
   * on (BT × BT) and (BT × BW) tiles: the decays γ_t / γ_s = exp(D[t, s]), D[t, s] = Σ_{s<r≤t} g_r
     accumulated one gate r at a time (a static loop of 16 masked adds), the unit-lower-triangular
     solve (I + A) U = B by forward substitution, then O = exp(G) ⊙ QS0 + (decay ⊙ QKᵀ)_{s≤t} U.

   Blocks longer than one chunk (prefill) carry S to the next chunk slice by slice,
   S ← exp(G_last) S + Kᵀ (exp(D_last) ⊙ U), through a scratch copy of the programs' tiles (``scr``,
   allocated only for T > BT; ``rec`` holds S0 and is never written past the fold).

Why chunks: the sequential walk is T dependent steps, each waiting for a d_k-long cross-warp reduction
(hᵀk) before the next can start; at batch 1 that chain, not bandwidth, is the recurrence's time. Here
the d_k-long reductions are independent tl.dot products; what stays serial is the triangular solve, by
forward substitution over the BT rows of a (BT × BW) tile. Forward substitution, not an inverse by
doubling ((I − A)(I + A²)(I + A⁴)(I + A⁸)): it is backward stable, while the powers of A can grow
(entries up to C(15, 7) when the keys align) and cancel in fp32.

Why this structure (measured 2026-12-02, H200, Qwen3.5-9B GDN shape: 32 value / 16 key heads, d_k = d_v
= 128, T = 16; bench_gdn verify µs per layer, 3 tokens accepted): the first version took 261.9 µs at
batch 1 and 12604.8 µs at batch 64, against 18.6 and 627.3 µs for the sequential walk — 14 to 20 times
slower. It held the whole (d_k × BV) state, the chunk's q and k rows (BT × d_k each) and a (BT, BT, BT)
masked tensor for D in registers at once, its tl.dots had K = d_k, and its warps came from the
sequential kernel's heuristic (1 warp at block_v 16). Compiled offline for sm_90a (Triton 3.9's
ptxas) it used 64 registers, a 9 KB stack frame, 26 KB of spill stores and 38 KB of spill loads: an
FMA tl.dot keeps its operands' whole K extent in every thread (two rows of Q or K and two columns of S0
at 1 warp, 512 values for one K = 128 product), S0 was carried across the chunk loop in two copies of
that operand layout, and D's tensor alone was 128 values per thread. Now every dot has K ≤ KB (or BT),
D is a (BT × BT) accumulator, no state tile stays live past the fold, the solve updates U column by
column (the row-by-row form needed A's row t along the other axis of the tile, a conversion through
shared memory at every step; A's column s is a sum along the axis it is broadcast on, and at 4 warps
the compiler puts A and U in one layout, so no step converts anything), and the kernel has its own
warps (chunk_warps, default 4: its products are parallel over the tile, unlike the walk's
chain). Offline for sm_90a at that shape (block_v 16): 85 registers at 4 warps and KB = 16 (the
defaults), 146 at KB = 32, 234 at 1 warp and KB = 32, none spilling. Measured on an H200
(docs/BENCHMARKS.md, stop 16): correct, and no longer spilling, but still slower than the
sequential walk at the 9B shape and block 16: 22.0–25.5 µs against 19.7 per layer at batch 1,
2.2–3.4× at batch 64; so it stays opt-in (bench_gdn's chunk_* options sweep it). Not done: KKᵀ and QKᵀ
depend only on the key head, yet every program of a key head (H / Hk value heads × d_v / BV slices)
computes them again (half of a program's multiply-adds at BV = 16); a wider chunk_block_v amortises
them over more columns, and hoisting them into a per-(row, key head) pass is a bigger change.

Numerics: the same values up to fp32 rounding (the products sum in another order; each decay's log is
summed over its own segment, left to right, so its error scales with that segment's gates, not with
the chunk's running sum: tests/test_runtime_gdn_chunked.py has strong gates followed by weak ones),
so the logged u differ from what single-token decoding would compute at rounding level; the next
verify's fold folds whatever u was logged, exactly as before. Every tl.dot is IEEE fp32 (no TF32).
Tiles: the dots want every dim ≥ 16, so d_k is padded to BK ≥ 16 and the program's BV columns to a
BW ≥ 16 tile (masked lanes hold zeros and are never stored): any head dims and block_v work.
"""

import triton
import triton.language as tl

from dflash2.runtime.kernels.gdn_verify.kernel import _fold_rows, _fold_token

CHUNK_T = 16  # tokens per chunk: tl.dot's smallest M / K


@triton.jit
def _fold_pending(
    p_n,
    p_rec,
    stash_k,
    stash_g,
    log_u,
    i_n,
    i_h,
    i_hk,
    T,
    o_k,
    o_v,
    m_k,
    m_v,
    HK,
    H,
    DK,
    DV,
    NV,
    M: tl.constexpr,
    MP: tl.constexpr,
    STAGES: tl.constexpr,
    FMA: tl.constexpr,
):
    """The deferred commit on the program's (BK × BW) tile (gdn_recur_kernel's fold, same order): folded
    into ``rec``, the counts of the program's M block_v slices (at p_n, fewer past d_v) zeroed."""
    n = tl.load(p_n)  # the first slice's; all of a row's counts are equal
    if n > 0:
        m_h = m_k[:, None] & m_v[None, :]
        h = tl.load(p_rec, mask=m_h, other=0.0)  # loaded only when there is something to fold
        if STAGES > 0:
            for t in tl.range(0, n, num_stages=STAGES):
                fg, fk, fu = _fold_rows(
                    stash_k, stash_g, log_u, i_n, i_h, i_hk, t, T, o_k, o_v, m_k, m_v, HK, H, DK, DV
                )
                h = _fold_token(h, fg, fk, fu, FMA)
        else:
            for t in range(0, n):
                fg, fk, fu = _fold_rows(
                    stash_k, stash_g, log_u, i_n, i_h, i_hk, t, T, o_k, o_v, m_k, m_v, HK, H, DK, DV
                )
                h = _fold_token(h, fg, fk, fu, FMA)
        tl.store(p_rec, h, mask=m_h)  # the committed state, materialised once
        # consumed: a second verify without a commit folds nothing. The slices past d_v belong to the
        # next head's counts (M > 1 on a ragged d_v)
        o_m = tl.arange(0, MP)
        i_s = tl.program_id(0) * M + o_m
        tl.store(p_n + o_m, tl.zeros([MP], dtype=tl.int32), mask=(o_m < M) & (i_s < NV))


@triton.jit
def gdn_recur_chunk_kernel(
    q_in,  # (N, T, HK, DK) fp32, from gdn_prep_kernel (scaled by 1/sqrt(d_k))
    k_in,  # (N, T, HK, DK) fp32 (the log's k)
    v_in,  # (N, T, H, DV) fp32
    g_in,  # (N, T, H) fp32 log decays (the log's g)
    beta_in,  # (N, T, H) fp32
    rec,  # (N, H, DK, DV) fp32 recurrent state, (H, DK, DV) contiguous; written only by the fold
    scr,  # (N, H, DK, DV) fp32 contiguous scratch: the state between chunks (T > BT only; else unused)
    o,  # (N, T, H, DV) out, model dtype, contiguous
    log_u,  # (N, T, H, DV) fp32 out; holds the pending tokens' u until overwritten
    pend,  # (N, P) int32 pending counts, P = H·NV (column i_h·NV + j for block_v slice j of head i_h)
    stash_k,  # (N, T, HK, DK) fp32: the pending tokens' k, copied there by the deferred commit
    stash_g,  # (N, T, H) fp32: their g
    T,
    stride_rn,
    stride_pn,
    HK: tl.constexpr,
    H: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    NV: tl.constexpr,  # block_v slices per head: the pending counts' columns per head
    M: tl.constexpr,  # block_v slices per program (BV = M · block_v)
    MP: tl.constexpr,  # M rounded up to a power of two
    BK: tl.constexpr,  # ≥ max(DK, 16), a power of two
    KB: tl.constexpr,  # d_k rows per slice of S0: a power of two in [16, BK]
    BV: tl.constexpr,  # the program's value columns
    BW: tl.constexpr,  # ≥ max(BV, 16), a power of two: the tile holding them
    BT: tl.constexpr,  # tokens per chunk (CHUNK_T)
    STAGES: tl.constexpr,  # the fold loop: 0 plain, ≥ 1 tl.range's software pipeline
    FMA: tl.constexpr,  # the fold's update as one fused multiply-add (gdn_recur_kernel's FMA)
):
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    i_n = (i_nh // H).to(tl.int64)
    i_h = i_nh % H
    i_hk = i_h // (H // HK)
    o_k = tl.arange(0, BK)
    o_w = tl.arange(0, BW)
    o_v = i_v * BV + o_w
    m_k = o_k < DK
    m_v = (o_w < BV) & (o_v < DV)  # lanes past the program's BV columns belong to the next program
    head = i_h * DK * DV  # the (row, head) state's offset within a row
    p_n = pend + i_n * stride_pn + i_h * NV + i_v * M
    _fold_pending(
        p_n,
        rec + i_n * stride_rn + head + o_k[:, None] * DV + o_v[None, :],
        stash_k,
        stash_g,
        log_u,
        i_n,
        i_h,
        i_hk,
        T,
        o_k,
        o_v,
        m_k,
        m_v,
        HK,
        H,
        DK,
        DV,
        NV,
        M,
        MP,
        STAGES,
        FMA,
    )
    # every thread's fold is stored before any thread re-reads S0 below, and the fold's reads of the
    # old u are done before the new block's u is stored
    tl.debug_barrier()
    o_t = tl.arange(0, BT)
    o_kb = tl.arange(0, KB)
    causal = o_t[:, None] >= o_t[None, :]  # [t, s]: s ≤ t
    strict = o_t[:, None] > o_t[None, :]  # s < t: A's entries (its diagonal is the system's I)
    # the state the chunk starts from: S0 in rec for the first chunk, the carried S in scr after
    p_rec = rec + i_n * stride_rn + head
    p_scr = scr + i_n * (H * DK * DV) + head
    for t0 in range(0, T, BT):
        m_t = t0 + o_t < T  # tokens past T load zeros (k = q = v = g = β = 0): rows of zeros in every product
        tok = i_n * T + t0 + o_t
        p_src = tl.where(t0 == 0, p_rec, p_scr)
        # phase 1, over d_k in KB-row slices: KS0, QS0 (BT × BW) and KKᵀ, QKᵀ (BT × BT)
        ks = tl.zeros([BT, BW], dtype=tl.float32)
        qs = tl.zeros([BT, BW], dtype=tl.float32)
        kk = tl.zeros([BT, BT], dtype=tl.float32)
        qk = tl.zeros([BT, BT], dtype=tl.float32)
        for k0 in range(0, DK, KB):  # slices up to d_k, not the padded BK (the last may be partly padding)
            m_kb = k0 + o_kb < DK
            p_qk = (tok[:, None] * HK + i_hk) * DK + k0 + o_kb[None, :]
            m_tk = m_t[:, None] & m_kb[None, :]
            kc = tl.load(k_in + p_qk, mask=m_tk, other=0.0)  # (BT, KB)
            qc = tl.load(q_in + p_qk, mask=m_tk, other=0.0)
            p_s = p_src + (k0 + o_kb[:, None]) * DV + o_v[None, :]
            s0 = tl.load(p_s, mask=m_kb[:, None] & m_v[None, :], other=0.0)  # (KB, BW): masked lanes 0
            ks = tl.dot(kc, s0, ks, input_precision="ieee")  # S0ᵀk_t per row
            qs = tl.dot(qc, s0, qs, input_precision="ieee")  # S0ᵀq_t: independent of the solve
            kt = tl.trans(kc)
            kk = tl.dot(kc, kt, kk, input_precision="ieee")  # k_tᵀk_s
            qk = tl.dot(qc, kt, qk, input_precision="ieee")  # q_tᵀk_s
        # phase 2, the decays: D[t, s] = Σ_{s<r≤t} g_r, each entry its own segment's sum left to right
        # (the masked adds of 0 are exact), not G_t − G_s: after a strong early gate both G are large and
        # the difference loses |G|·2⁻²⁴. G_t = Σ_{r≤t} g_r; tail = D's last row and last = G_{BT-1}, the
        # same sums in the same order, for the carry
        D = tl.zeros([BT, BT], dtype=tl.float32)
        G = tl.zeros([BT], dtype=tl.float32)
        tail = tl.zeros([BT], dtype=tl.float32)
        last = 0.0
        for r in tl.static_range(BT):
            # token r's gate (0 past T; a clamped load, not a scalar mask)
            g_r = tl.load(g_in + (i_n * T + tl.minimum(t0 + r, T - 1)) * H + i_h)
            g_r = tl.where(t0 + r < T, g_r, 0.0)
            D += tl.where((o_t[None, :] < r) & (o_t[:, None] >= r), g_r, 0.0)
            G += tl.where(o_t >= r, g_r, 0.0)
            tail += tl.where(o_t < r, g_r, 0.0)
            last += g_r
        decay = tl.exp(D)  # ≤ 1 where s < t, exp(0) = 1 on and above the diagonal (masked below)
        gam = tl.exp(G)
        m_tv = m_t[:, None] & m_v[None, :]
        p_tv = (tok[:, None] * H + i_h) * DV + o_v[None, :]
        vc = tl.load(v_in + p_tv, mask=m_tv, other=0.0)  # (BT, BW)
        bc = tl.load(beta_in + tok * H + i_h, mask=m_t, other=0.0)  # (BT,)
        A = tl.where(strict, bc[:, None] * decay * kk, 0.0)  # strictly lower
        # (I + A) U = B by forward substitution, column by column: once row s of U is final (rows < s
        # done), it is subtracted from every later row at once. A's column s does not depend on U, so
        # each step's serial part is the one 16-row sum that extracts row s
        U = bc[:, None] * (vc - gam[:, None] * ks)  # B
        for s in tl.static_range(BT - 1):
            a_s = tl.sum(tl.where(o_t[None, :] == s, A, 0.0), 1)  # (BT,) A[:, s]: 0 in rows t ≤ s
            u_s = tl.sum(tl.where(o_t[:, None] == s, U, 0.0), 0)  # (BW,) U[s, :], final
            U = U - a_s[:, None] * u_s[None, :]
        P = tl.where(causal, qk * decay, 0.0)
        out = gam[:, None] * qs + tl.dot(P, U, input_precision="ieee")  # (BT, BW)
        tl.store(o + p_tv, out.to(o.dtype.element_ty), mask=m_tv)
        tl.store(log_u + p_tv, U, mask=m_tv)
        if t0 + BT < T:  # the next chunk starts from S after this one (prefill-length blocks only)
            w = tl.exp(tail)[:, None] * U  # (BT, BW): the decay from token s to the chunk's end
            el = tl.exp(last)
            for k0 in range(0, DK, KB):  # slices up to d_k, not the padded BK (the last may be partly padding)
                m_kb = k0 + o_kb < DK
                m_s = m_kb[:, None] & m_v[None, :]
                # (KB, BT): k rows of the slice, transposed by the addressing
                kt = tl.load(
                    k_in + (tok[None, :] * HK + i_hk) * DK + k0 + o_kb[:, None],
                    mask=m_t[None, :] & m_kb[:, None],
                    other=0.0,
                )
                sc = tl.load(p_src + (k0 + o_kb[:, None]) * DV + o_v[None, :], mask=m_s, other=0.0)
                sc = el * sc + tl.dot(kt, w, input_precision="ieee")
                # p_src is scr itself after the first chunk: every thread's reads of this slice are done
                # before any thread overwrites it
                tl.debug_barrier()
                tl.store(p_scr + (k0 + o_kb[:, None]) * DV + o_v[None, :], sc, mask=m_s)
            tl.debug_barrier()  # the next chunk reads what every thread stored


def launch_chunk_recur(
    q, k, v, g, beta, rec_state, o, log_u, fold, *, num_k_heads, block_v, chunk_block_v, block_k, stages, num_warps,
    fma=False,
):  # fmt: skip
    """gdn_recur_chunk_kernel on grid (d_v / chunk_block_v, N·H); tensors as in the kernel, fold = (pend,
    stash_k, stash_g) with the counts of block_v slices; chunk_block_v a multiple of block_v; block_k
    the d_k slice (rounded to a power of two in [16, d_k padded]); fma: the fold's update as gdn_recur_kernel's
    FMA does it."""
    N, T = o.shape[:2]
    H, DK, DV = rec_state.shape[1:]
    if chunk_block_v % block_v:
        raise ValueError(f"chunk_block_v {chunk_block_v} must be a multiple of block_v {block_v}")
    pend, stash_k, stash_g = fold
    bk = max(16, triton.next_power_of_2(DK))
    m = chunk_block_v // block_v
    # the carried state between chunks; a one-chunk block never touches it
    scr = rec_state.new_empty(rec_state.shape) if T > CHUNK_T else rec_state
    gdn_recur_chunk_kernel[(triton.cdiv(DV, chunk_block_v), N * H)](
        q,
        k,
        v,
        g,
        beta,
        rec_state,
        scr,
        o,
        log_u,
        pend,
        stash_k,
        stash_g,
        T,
        rec_state.stride(0),
        pend.stride(0),
        HK=num_k_heads,
        H=H,
        DK=DK,
        DV=DV,
        NV=triton.cdiv(DV, block_v),
        M=m,
        MP=triton.next_power_of_2(m),
        BK=bk,
        KB=min(bk, max(16, triton.next_power_of_2(block_k))),
        BV=chunk_block_v,
        BW=max(16, triton.next_power_of_2(chunk_block_v)),
        BT=CHUNK_T,
        STAGES=stages,
        FMA=fma,
        num_warps=num_warps,
        enable_fp_fusion=False,  # the fold must round as the commit kernel does: see gdn_replay/kernel.py
    )
