"""The GDN verify as one kernel (``fused=True``): the prep of kernel.py folded into the recurrence.

Grid (d_v / BV, N·H), the recurrence's layout. Each program first loads its state tile and folds a
pending commit (the stash and its own u: nothing this launch writes), then prepares what its walk
reads: the conv + SiLU + L2 norm of its key head's q and k channels, the conv + SiLU of its own BV
value channels, and g, β of its value head, for a chunk of BT tokens as (BT, ·) tiles. It stores
them as fp32 rows (k and g into the log, x into the log's x), waits at a barrier for its own
stores, and walks the chunk's tokens reading the rows back, exactly as gdn_recur_kernel does.

Why one kernel: at batch 1 the two-kernel verify is a chain of prep (~5 µs on the H200 at the 9B
shape) → grid-wide wait → recurrence, and the fold could overlap only the prep's start. Here each
program's prep is the few loads and sums of its own head, with no kernel boundary and no wait for
other programs. The price: every value head and value slice of a key head (16 programs at the 9B
shape) computes that key head's q and k again, and they all store the same values to the same rows
(identical bytes: whichever store lands, a program reads back what it computed), about 8 KiB of
inputs per program, which only shows at large batches.

The rows go through global memory (L1 / L2) rather than being picked out of the (BT, ·) tiles:
taking row t of a register tile costs a cross-thread reduction per vector, which made an earlier
fused version three times slower (kernel.py's docstring).

The reductions of the prep (the q / k norm over d_k) run on tiles of the same shape whatever T is,
so a T-token verify and a 1-token decode through this kernel normalise every token bit for bit
alike; they do not match the two-kernel path's (another tile layout), so one GDNState uses one path
for every verify.
"""

import triton
import triton.language as tl

from dflash2.runtime.kernels.gdn_verify.kernel import (
    _conv_silu,
    _fold_rows,
    _fold_token,
    _gates,
    _token_rows,
    _verify_token,
)


@triton.jit
def gdn_fused_kernel(
    x,  # (N, T, C) pre-conv q|k|v, model dtype, channels contiguous
    conv,  # (N, C, KW-1) conv window, model dtype (read only)
    w,  # (C, KW) conv weight
    a,  # (N, T, H) in_proj_a output
    b,  # (N, T, H) in_proj_b output
    A_log,  # (H,)
    dt_bias,  # (H,)
    q_buf,  # (N, T, HK, DK) fp32 scratch: q rows (conv + SiLU + L2 norm, scaled by 1/sqrt(d_k))
    k_buf,  # (N, T, HK, DK) fp32 out: k rows (the ReplaySSM log's k)
    v_buf,  # (N, T, H, DV) fp32 scratch: v rows
    g_buf,  # (N, T, H) fp32 out: log decays (the ReplaySSM log's g)
    beta_buf,  # (N, T, H) fp32 scratch
    x_log,  # (N, T, C) out (STORE_X): the log's x
    rec,  # (N, H, DK, DV) fp32 recurrent state (written only by a fold)
    o,  # (N, T, H, DV) out, model dtype
    log_u,  # (N, T, H, DV) fp32 out (ReplaySSM); FOLD: holds the pending tokens' u until overwritten
    states,  # (N, T, H, DK, DV) fp32 out (native rollback)
    pend,  # (N, P) int32 pending counts, P = H·NV
    stash_k,  # (N, T, HK, DK) fp32: the pending tokens' k
    stash_g,  # (N, T, H) fp32: their g
    T,
    stride_xn,
    stride_xt,
    stride_cn,
    stride_cc,
    stride_an,
    stride_at,
    stride_bn,
    stride_bt,
    stride_ln,
    stride_lt,
    stride_rn,
    stride_pn,
    HK: tl.constexpr,
    H: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    KW: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    BT: tl.constexpr,
    SQRT_DK: tl.constexpr,
    NATIVE: tl.constexpr,
    STORE_X: tl.constexpr,
    STAGES: tl.constexpr,
    SPLIT_OUT: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    i_n = (i_nh // H).to(tl.int64)
    i_h = i_nh % H
    i_hk = i_h // (H // HK)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < DK
    m_v = o_v < DV
    m_h = m_k[:, None] & m_v[None, :]
    p_rec = rec + i_n * stride_rn + i_h * DK * DV + o_k[:, None] * DV + o_v[None, :]
    h = tl.load(p_rec, mask=m_h, other=0.0)
    # the deferred commit's fold first: it reads only the stash and this program's own old u
    p_n = pend + i_n * stride_pn + i_h * tl.num_programs(0) + i_v
    n = tl.load(p_n)
    if n > 0:
        for t in tl.range(0, n, num_stages=STAGES):
            fg, fk, fu = _fold_rows(stash_k, stash_g, log_u, i_n, i_h, i_hk, t, T, o_k, o_v, m_k, m_v, HK, H, DK, DV)
            h = _fold_token(h, fg, fk, fu)
        tl.store(p_rec, h, mask=m_h)
        tl.store(p_n, n * 0)
    # this program's channels: its key head's q and k, its own value slice
    ch_q = i_hk * DK + o_k
    ch_k = HK * DK + ch_q
    ch_v = 2 * HK * DK + i_h * DV + o_v
    x_row = x + i_n * stride_xn
    conv_row = conv + i_n * stride_cn
    xl_row = x_log + i_n * stride_ln
    neg_A = -tl.exp(tl.load(A_log + i_h).to(tl.float32))
    dt_b = tl.load(dt_bias + i_h).to(tl.float32)
    for t0 in range(0, T, BT):
        o_t = t0 + tl.arange(0, BT)
        m_t = o_t < T
        tok = i_n * T + o_t
        p_qk = (tok[:, None] * HK + i_hk) * DK + o_k[None, :]
        m_tk = m_t[:, None] & m_k[None, :]
        yq, xq = _conv_silu(x_row, conv_row, w, ch_q, m_k, o_t, m_t, stride_xt, stride_cc, KW, BT, BK)
        yq = yq * tl.math.rsqrt(tl.sum(yq * yq, 1) + 1e-6)[:, None]
        tl.store(q_buf + p_qk, yq / SQRT_DK, mask=m_tk)
        yk, xk = _conv_silu(x_row, conv_row, w, ch_k, m_k, o_t, m_t, stride_xt, stride_cc, KW, BT, BK)
        yk = yk * tl.math.rsqrt(tl.sum(yk * yk, 1) + 1e-6)[:, None]
        tl.store(k_buf + p_qk, yk, mask=m_tk)
        yv, xv = _conv_silu(x_row, conv_row, w, ch_v, m_v, o_t, m_t, stride_xt, stride_cc, KW, BT, BV)
        m_tv = m_t[:, None] & m_v[None, :]
        tl.store(v_buf + (tok[:, None] * H + i_h) * DV + o_v[None, :], yv, mask=m_tv)
        g, beta = _gates(a + i_n * stride_an, b + i_n * stride_bn, o_t, m_t, stride_at, stride_bt, i_h, neg_A, dt_b)
        tl.store(g_buf + tok * H + i_h, g, mask=m_t)
        tl.store(beta_buf + tok * H + i_h, beta, mask=m_t)
        if STORE_X:
            tl.store(xl_row + o_t[:, None] * stride_lt + ch_q[None, :], xq, mask=m_tk)
            tl.store(xl_row + o_t[:, None] * stride_lt + ch_k[None, :], xk, mask=m_tk)
            tl.store(xl_row + o_t[:, None] * stride_lt + ch_v[None, :], xv, mask=m_tv)
        # this program's stores are visible to all its threads before the walk reads them back (and the
        # fold's reads of the old u are done before the walk's first new u)
        tl.debug_barrier()
        for t in tl.range(t0, tl.minimum(t0 + BT, T), num_stages=STAGES):
            q_t, k_t, v_t, g_t, beta_t = _token_rows(
                q_buf, k_buf, v_buf, g_buf, beta_buf, i_n, i_h, i_hk, t, T, o_k, o_v, m_k, m_v, HK, H, DK, DV
            )
            h = _verify_token(
                h, q_t, k_t, v_t, g_t, beta_t, t, i_n, i_h, T, o, log_u, states,
                o_k, o_v, m_v, m_h, H, DK, DV, NATIVE, SPLIT_OUT,
            )  # fmt: skip


def launch_fused(
    x, conv_state, conv_weight, rec_state, a, b, A_log, dt_bias, o, prep, log_u, states, x_log, fold, *,
    num_k_heads, native, store_x, block_v, block_t, stages, split_out, num_warps,
):  # fmt: skip
    """gdn_fused_kernel on grid (d_v / BV, N·H); arguments as launch_verify's (prep: the row buffers the walk
    reads back; stages ≥ 1: the walk's and the fold's software pipeline)."""
    N, T, _ = x.shape
    H, DK, DV = rec_state.shape[1:]
    KW = conv_weight.shape[1]
    q, k, v, g, beta = prep
    pend, stash_k, stash_g = fold
    gdn_fused_kernel[(triton.cdiv(DV, block_v), N * H)](
        x, conv_state, conv_weight, a, b, A_log, dt_bias, q, k, v, g, beta, x_log,
        rec_state, o, log_u, states, pend, stash_k, stash_g, T,
        x.stride(0), x.stride(1), conv_state.stride(0), conv_state.stride(1),
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), x_log.stride(0), x_log.stride(1),
        rec_state.stride(0), pend.stride(0),
        HK=num_k_heads, H=H, DK=DK, DV=DV, KW=KW,
        BK=triton.next_power_of_2(DK), BV=block_v, BT=block_t, SQRT_DK=float(DK) ** 0.5,
        NATIVE=native, STORE_X=store_x, STAGES=max(stages, 1), SPLIT_OUT=split_out,
        num_warps=num_warps,
        enable_fp_fusion=False,  # round as the reference and the fold do
    )  # fmt: skip
