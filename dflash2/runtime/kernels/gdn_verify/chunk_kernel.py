"""The verify's chunked recurrence (``chunked=True``, ReplaySSM only; twin: chunked_reference.py).

``gdn_recur_chunk_kernel`` replaces kernel.py's ``gdn_recur_kernel`` after the same prep kernel,
on the same grid (d_v / BV, N·H) with the same per-program pending counts, so the deferred
commit's layout does not change. A program

1. folds the pending tokens into its state tile exactly as gdn_recur_kernel does (the same
   ``_fold_token`` in the same order, bit for bit the commit kernel's state), writes it back and
   zeroes its count;
2. computes the block's outputs and logged u from that state S0 with matrix products per chunk of
   BT = 16 tokens (the equations in chunked_reference.py): the decays γ_t / γ_s = exp of the log
   gates' sum over (s, t], each summed as its own segment, KS0 and QS0 (BT × BV), KKᵀ and QKᵀ
   (BT × BT), the unit-lower-triangular solve (I + A) U = B, then O = exp(G) ⊙ QS0 + (decay ⊙ QKᵀ)_{s≤t} U;
   blocks longer than one chunk (prefill) carry S to the next chunk with one more product.

Why: the sequential walk is T dependent steps, each waiting for a d_k-long cross-warp reduction
(hᵀk) before the next can start; at batch 1 that chain, not bandwidth, is the recurrence's time.
Here the d_k-long reductions are independent tl.dot products; what stays serial is the triangular
solve, by forward substitution over the BT rows of a (BT × BV) tile: 16-long sums within a warp
instead of 128-long ones across warps. Forward substitution, not an inverse by doubling
((I − A)(I + A²)(I + A⁴)(I + A⁸)): it is backward stable, while the powers of A can grow (entries up to
C(15, 7) when the keys align) and cancel in fp32.

Numerics: the same values up to fp32 rounding (the products sum in another order; each decay's log is
summed over its own segment, so its error scales with that segment's gates, not with the chunk's
running sum: tests/test_runtime_gdn_chunked.py has strong gates followed by weak ones), so the logged u
differ from what single-token decoding would compute at rounding level; the next verify's fold
folds whatever u was logged, exactly as before. Every tl.dot is IEEE fp32 (no TF32). Tiles: the
dots want every dim ≥ 16, so d_k is padded to BK ≥ 16 and the program's BV columns to a
BW ≥ 16 tile (masked lanes hold zeros and are never stored): any head dims and block_v work.
"""

import triton
import triton.language as tl

from dflash2.runtime.kernels.gdn_verify.kernel import _fold_rows, _fold_token

CHUNK_T = 16  # tokens per chunk: tl.dot's smallest M / K


@triton.jit
def _fold_pending(
    h,
    p_n,
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
    p_rec,
    m_h,
    HK,
    H,
    DK,
    DV,
    STAGES: tl.constexpr,
):
    """The deferred commit on the tile in registers (gdn_recur_kernel's fold, same order); returns h."""
    n = tl.load(p_n)
    if n > 0:
        if STAGES > 0:
            for t in tl.range(0, n, num_stages=STAGES):
                fg, fk, fu = _fold_rows(
                    stash_k, stash_g, log_u, i_n, i_h, i_hk, t, T, o_k, o_v, m_k, m_v, HK, H, DK, DV
                )
                h = _fold_token(h, fg, fk, fu)
        else:
            for t in range(0, n):
                fg, fk, fu = _fold_rows(
                    stash_k, stash_g, log_u, i_n, i_h, i_hk, t, T, o_k, o_v, m_k, m_v, HK, H, DK, DV
                )
                h = _fold_token(h, fg, fk, fu)
        tl.store(p_rec, h, mask=m_h)  # the committed state, materialised once
        tl.store(p_n, n * 0)  # consumed: a second verify without a commit folds nothing
    return h


@triton.jit
def gdn_recur_chunk_kernel(
    q_in,  # (N, T, HK, DK) fp32, from gdn_prep_kernel (scaled by 1/sqrt(d_k))
    k_in,  # (N, T, HK, DK) fp32 (the log's k)
    v_in,  # (N, T, H, DV) fp32
    g_in,  # (N, T, H) fp32 log decays (the log's g)
    beta_in,  # (N, T, H) fp32
    rec,  # (N, H, DK, DV) fp32 recurrent state, (H, DK, DV) contiguous; written only by the fold
    o,  # (N, T, H, DV) out, model dtype, contiguous
    log_u,  # (N, T, H, DV) fp32 out; holds the pending tokens' u until overwritten
    pend,  # (N, P) int32 pending counts, P = H·NV (column i_h·NV + i_v is this program's)
    stash_k,  # (N, T, HK, DK) fp32: the pending tokens' k, from gdn_prep_kernel
    stash_g,  # (N, T, H) fp32: their g
    T,
    stride_rn,
    stride_pn,
    HK: tl.constexpr,
    H: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,  # ≥ max(DK, 16), a power of two
    BV: tl.constexpr,  # the program's value columns (block_v)
    BW: tl.constexpr,  # ≥ max(BV, 16), a power of two: the tile holding them
    BT: tl.constexpr,  # tokens per chunk (CHUNK_T)
    STAGES: tl.constexpr,  # the fold loop: 0 plain, ≥ 1 tl.range's software pipeline
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
    m_h = m_k[:, None] & m_v[None, :]
    p_rec = rec + i_n * stride_rn + i_h * DK * DV + o_k[:, None] * DV + o_v[None, :]
    h = tl.load(p_rec, mask=m_h, other=0.0)  # masked lanes 0, and they stay 0
    p_n = pend + i_n * stride_pn + i_h * tl.num_programs(0) + i_v
    h = _fold_pending(
        h, p_n, stash_k, stash_g, log_u, i_n, i_h, i_hk, T, o_k, o_v, m_k, m_v, p_rec, m_h, HK, H, DK, DV, STAGES
    )
    # the fold's reads of the old u are done in every thread before the new block's u is stored
    tl.debug_barrier()
    o_t = tl.arange(0, BT)
    causal = o_t[:, None] >= o_t[None, :]  # [t, s]: s ≤ t
    for t0 in range(0, T, BT):
        m_t = t0 + o_t < T  # tokens past T load zeros (k = q = v = g = β = 0): rows of zeros in every product
        tok = i_n * T + t0 + o_t
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        qc = tl.load(q_in + (tok[:, None] * HK + i_hk) * DK + o_k[None, :], mask=m_tk, other=0.0)  # (BT, BK)
        kc = tl.load(k_in + (tok[:, None] * HK + i_hk) * DK + o_k[None, :], mask=m_tk, other=0.0)  # (BT, BK)
        vc = tl.load(v_in + (tok[:, None] * H + i_h) * DV + o_v[None, :], mask=m_tv, other=0.0)  # (BT, BW)
        gc = tl.load(g_in + tok * H + i_h, mask=m_t, other=0.0)  # (BT,)
        bc = tl.load(beta_in + tok * H + i_h, mask=m_t, other=0.0)
        G = tl.cumsum(gc, 0)  # log γ_t; padded tokens add 0, so G[BT-1] is the chunk's last real token's
        # log(γ_t / γ_s) = Σ_{s<r≤t} g_r summed as its own segment (a (BT, BT, BT) masked sum), not as
        # G_t − G_s: after a strong early gate both G are large and the difference loses |G|·2⁻²⁴
        seg = (o_t[None, None, :] > o_t[None, :, None]) & (o_t[None, None, :] <= o_t[:, None, None])  # [t, s, r]
        D = tl.sum(tl.where(seg, gc[None, None, :], 0.0), axis=2)  # (BT, BT)
        # exp(D) ≤ 1 where s ≤ t; elsewhere exp(0), masked below (no overflow on the way)
        decay = tl.exp(tl.where(causal, D, 0.0))  # (BT, BT)
        gam = tl.exp(G)
        ks = tl.dot(kc, h, input_precision="ieee")  # (BT, BW): S0ᵀk_t per row
        qs = tl.dot(qc, h, input_precision="ieee")  # S0ᵀq_t: independent of the solve
        kk = tl.dot(kc, tl.trans(kc), input_precision="ieee")  # (BT, BT) k_tᵀk_s
        qk = tl.dot(qc, tl.trans(kc), input_precision="ieee")  # q_tᵀk_s
        A = tl.where(o_t[:, None] > o_t[None, :], bc[:, None] * decay * kk, 0.0)  # strictly lower
        # (I + A) U = B by forward substitution: row t needs the final rows s < t only
        U = bc[:, None] * (vc - gam[:, None] * ks)  # B
        for t in tl.static_range(1, BT):
            a_t = tl.sum(tl.where(o_t[:, None] == t, A, 0.0), 0)  # (BT,) A[t, :]
            U = tl.where(o_t[:, None] == t, U - tl.sum(a_t[:, None] * U, 0)[None, :], U)
        P = tl.where(causal, qk * decay, 0.0)
        out = gam[:, None] * qs + tl.dot(P, U, input_precision="ieee")  # (BT, BW)
        p_tv = (tok[:, None] * H + i_h) * DV + o_v[None, :]
        tl.store(o + p_tv, out.to(o.dtype.element_ty), mask=m_tv)
        tl.store(log_u + p_tv, U, mask=m_tv)
        if t0 + BT < T:  # the next chunk starts from S after this one (prefill-length blocks only)
            last = tl.sum(tl.where(o_t == BT - 1, G, 0.0), 0)
            tail = tl.sum(tl.where(o_t[:, None] == BT - 1, D, 0.0), 0)  # (BT,) Σ_{s<r≤BT-1} g_r
            w = tl.exp(tail)[:, None] * U  # (BT, BW)
            h = tl.exp(last) * h + tl.dot(tl.trans(kc), w, input_precision="ieee")


def launch_chunk_recur(q, k, v, g, beta, rec_state, o, log_u, fold, *, num_k_heads, block_v, stages, num_warps):
    """gdn_recur_chunk_kernel on grid (d_v / block_v, N·H); tensors as in the kernel, fold = (pend,
    stash_k, stash_g)."""
    N, T = o.shape[:2]
    H, DK, DV = rec_state.shape[1:]
    pend, stash_k, stash_g = fold
    gdn_recur_chunk_kernel[(triton.cdiv(DV, block_v), N * H)](
        q,
        k,
        v,
        g,
        beta,
        rec_state,
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
        BK=max(16, triton.next_power_of_2(DK)),
        BV=block_v,
        BW=max(16, triton.next_power_of_2(block_v)),
        BT=CHUNK_T,
        STAGES=stages,
        num_warps=num_warps,
        enable_fp_fusion=False,  # the fold must round as the commit kernel does: see gdn_replay/kernel.py
    )
