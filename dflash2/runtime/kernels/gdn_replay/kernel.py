"""Triton GDN commit kernel and its launcher (twin: reference.py; public function: __init__.py).

Grid (d_v / BV, N·H), the verify kernel's layout: each program owns the (d_k × BV) tile of
row n, value head h of the recurrent state, which it updates in place, and 1/(NV·H) of the
row's conv channels, whose window it rolls in place (every program reads only what it
writes, so in-place is race-free across programs; a barrier orders it within one). Rows
with n = 0 return at once. ``ROLL=False`` folds the state only (a flush after a deferred
commit, which rolled the window itself: defer_kernel.py).

ReplaySSM folds the n logged tokens: h ← exp(g_t)·h; h ← h + k_t u_tᵀ, the verify kernel's
two state updates on the same fp32 values. Both kernels are compiled without FMA
contraction (``enable_fp_fusion=False``): otherwise the compiler may fuse differently
where verify also reads the decayed state and replay does not, and the fold would drift
by an ulp from what verify / decoding computed. Both fold with the verify kernel's own
``_fold_token`` (with ``FMA``, the verify's ``fma`` option, the second update is one explicit fused
multiply-add). Native rollback copies the state verify stored after token n.
"""

import triton
import triton.language as tl

from dflash2.runtime.kernels.gdn_verify.kernel import _fold_token, _state_tile


@triton.jit
def _logged(log_k, log_u, log_g, tok, i_h, i_hk, o_k, o_v, m_k, m_v, HK, H, DK, DV):
    """Flat token tok's logged g (scalar), k (BK,) and u (BV,) for value head i_h."""
    g = tl.load(log_g + tok * H + i_h)
    k = tl.load(log_k + (tok * HK + i_hk) * DK + o_k, mask=m_k, other=0.0)
    u = tl.load(log_u + (tok * H + i_h) * DV + o_v, mask=m_v, other=0.0)
    return g, k, u


@triton.jit
def gdn_replay_kernel(
    rec,  # (N, H, DK, DV) fp32 recurrent state, updated in place; (H, DK, DV) contiguous
    conv,  # (N, C, KW-1) conv window, updated in place
    x,  # (N, T, C) the verify's pre-conv inputs
    log_k,  # (N, T, HK, DK) fp32 (ReplaySSM)
    log_u,  # (N, T, H, DV) fp32 (ReplaySSM)
    log_g,  # (N, T, H) fp32 (ReplaySSM)
    states,  # (N, T, H, DK, DV) fp32 (native rollback)
    n_acc,  # (N,) tokens to commit per row, 0..T
    T,
    C,
    stride_rn,
    stride_cn,
    stride_cc,
    stride_xn,
    stride_xt,
    HK: tl.constexpr,
    H: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    KW: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    BC: tl.constexpr,
    BW: tl.constexpr,
    NATIVE: tl.constexpr,
    ROLL: tl.constexpr,  # roll the conv window too (False: a deferred commit rolled it already)
    FMA: tl.constexpr,  # the update as one fused multiply-add (the verify kernel's FMA: _fold_token)
):
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    i_n = (i_nh // H).to(tl.int64)
    i_h = i_nh % H
    i_hk = i_h // (H // HK)
    n = tl.load(n_acc + i_n).to(tl.int32)
    if n > 0:
        o_k, o_v, m_k, m_v, m_h, p_rec = _state_tile(rec, stride_rn, i_n, i_h, i_v, DK, DV, BK, BV)
        if NATIVE:
            p_s = states + (((i_n * T + n - 1) * H + i_h) * DK + o_k[:, None]) * DV + o_v[None, :]
            h = tl.load(p_s, mask=m_h, other=0.0)
        else:
            h = tl.load(p_rec, mask=m_h, other=0.0)
            g_t, k_t, u_t = _logged(log_k, log_u, log_g, i_n * T, i_h, i_hk, o_k, o_v, m_k, m_v, HK, H, DK, DV)
            for t in range(0, n):
                # the next token's log first (clamped to the last of the block: loaded, unused), so its
                # loads are in flight during this token's update: the fold is latency-bound at batch 1
                g_n, k_n, u_n = _logged(
                    log_k,
                    log_u,
                    log_g,
                    i_n * T + tl.minimum(t + 1, T - 1),
                    i_h,
                    i_hk,
                    o_k,
                    o_v,
                    m_k,
                    m_v,
                    HK,
                    H,
                    DK,
                    DV,
                )
                h = _fold_token(h, g_t, k_t, u_t, FMA)
                g_t, k_t, u_t = g_n, k_n, u_n
        tl.store(p_rec, h, mask=m_h)
    if ROLL & (n > 0):
        # conv window: new column j = column n + j of [old window (KW-1) | x_0 .. x_{T-1}]
        o_c = (i_v * H + i_h) * BC + tl.arange(0, BC)
        m_c = o_c < C
        o_w = tl.arange(0, BW)
        src = n + o_w
        in_window = src < KW - 1
        m_w = o_w < KW - 1
        conv_row = conv + i_n * stride_cn
        old = tl.load(
            conv_row + o_c[:, None] * stride_cc + src[None, :],
            mask=m_c[:, None] & (m_w & in_window)[None, :],
            other=0.0,
        )
        new = tl.load(
            x + i_n * stride_xn + (src - (KW - 1))[None, :] * stride_xt + o_c[:, None],
            mask=m_c[:, None] & (m_w & ~in_window)[None, :],
            other=0.0,
        )
        window = tl.where(in_window[None, :], old, new.to(old.dtype))
        # every thread's reads of the old columns before any thread overwrites them (column w is read by
        # the thread that writes column w − n, which need not be the same thread)
        tl.debug_barrier()
        tl.store(conv_row + o_c[:, None] * stride_cc + o_w[None, :], window, mask=m_c[:, None] & m_w[None, :])


def launch_replay(
    conv_state, rec_state, x, log_k, log_u, log_g, states, n, *, num_k_heads, native, block_v, num_warps,
    roll_conv=True, fma=False,
):  # fmt: skip
    """Grid (d_v / BV, N·H); tensors as in gdn_replay_kernel; the other mode's logs may be any tensor; fma: the
    update as the verify kernel's ``fma`` does it."""
    N, T, C = x.shape
    H, DK, DV = rec_state.shape[1:]
    KW = conv_state.shape[-1] + 1
    nv = triton.cdiv(DV, block_v)
    gdn_replay_kernel[(nv, N * H)](
        rec_state,
        conv_state,
        x,
        log_k,
        log_u,
        log_g,
        states,
        n,
        T,
        C,
        rec_state.stride(0),
        conv_state.stride(0),
        conv_state.stride(1),
        x.stride(0),
        x.stride(1),
        HK=num_k_heads,
        H=H,
        DK=DK,
        DV=DV,
        KW=KW,
        BK=triton.next_power_of_2(DK),
        BV=block_v,
        BC=triton.next_power_of_2(triton.cdiv(C, nv * H)),  # each of a row's NV·H programs rolls BC channels
        BW=triton.next_power_of_2(max(KW - 1, 1)),
        NATIVE=native,
        ROLL=roll_conv,
        FMA=fma,
        num_warps=num_warps,
        enable_fp_fusion=False,
    )
