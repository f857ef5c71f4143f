"""Triton kernel of ReplaySSM's deferred commit, and its launcher (twin: reference.py's
``gdn_defer_commit``; public function: __init__.py's ``gdn_defer_commit_triton``).

A deferred commit does everything a commit does except the fold of the recurrent state, for every
GDN layer in one launch: for layer l and row r with n = n[r] accepted tokens,

* the conv window is rolled in place (new column w = column n + w of [old window | x_0 .. x_{T-1}]),
* the first n logged k and g rows are copied to the per-layer stash the next verify folds from,
* every one of the row's pending counts (one per recurrence program of the next verify) is set to n.

Why here and not in the next verify: that verify's programs read the window and the pending k / g
from many programs at once (every value head of a key head, every value slice), while its new block
overwrites the log. Done here, between the verifies, the window and the stash are read-only during
the verify, so the recurrence can fold before the prep kernel has finished (``pdl``) and nothing in
the verify races with anything (docs/ARCHITECTURE.md §5.5).

Grid (Hk, N, L): program (j, r, l) rolls one Hk-th of the row's channels, copies key head j's k and
the g of the value heads that read key head j, and writes one Hk-th of the counts.
"""

import triton
import triton.language as tl


@triton.jit
def gdn_defer_kernel(
    n_acc,  # (N,) integer: tokens accepted per row, 0..T
    pend,  # (L, N, P) int32 out: the pending counts
    conv,  # (L, N, C, KW-1) conv windows, model dtype, rolled in place
    x_log,  # (L, N, T, C) the verifies' pre-conv inputs
    log_k,  # (L, N, T, HK, DK) fp32
    log_g,  # (L, N, T, H) fp32
    stash_k,  # (L, N, T, HK, DK) fp32 out
    stash_g,  # (L, N, T, H) fp32 out
    T,
    C,
    P,
    stride_pl,
    stride_pn,
    stride_cl,
    stride_cn,
    stride_xl,
    stride_xn,
    stride_kl,
    stride_kn,
    stride_gl,
    stride_gn,
    HK: tl.constexpr,
    H: tl.constexpr,
    DK: tl.constexpr,
    KW: tl.constexpr,
    BCH: tl.constexpr,  # ≥ ceil(C / HK): this program's channels
    BW: tl.constexpr,  # ≥ KW-1
    BT: tl.constexpr,  # ≥ T
    BK: tl.constexpr,  # ≥ DK
    BG: tl.constexpr,  # ≥ H / HK
    BP: tl.constexpr,  # ≥ ceil(P / HK)
):
    j = tl.program_id(0)
    i_n = tl.program_id(1).to(tl.int64)
    i_l = tl.program_id(2).to(tl.int64)
    n = tl.load(n_acc + i_n).to(tl.int32)
    # the counts: every program of the next verify reads its own
    o_p = j * BP + tl.arange(0, BP)
    tl.store(pend + i_l * stride_pl + i_n * stride_pn + o_p, tl.zeros([BP], dtype=tl.int32) + n, mask=o_p < P)
    if n > 0:
        # the window: (channels, columns) of this program, column w from column n + w of [window | x]
        o_c = j * BCH + tl.arange(0, BCH)
        m_c = o_c < C
        o_w = tl.arange(0, BW)
        src = n + o_w
        in_window = src < KW - 1
        m_w = o_w < KW - 1
        conv_row = conv + i_l * stride_cl + i_n * stride_cn
        old = tl.load(
            conv_row + o_c[:, None] * (KW - 1) + src[None, :],
            mask=m_c[:, None] & (m_w & in_window)[None, :],
            other=0.0,
        )
        new = tl.load(
            x_log + i_l * stride_xl + i_n * stride_xn + (src - (KW - 1))[None, :] * C + o_c[:, None],
            mask=m_c[:, None] & (m_w & ~in_window)[None, :],
            other=0.0,
        )
        window = tl.where(in_window[None, :], old, new.to(old.dtype))
        # every thread has read the old columns before any overwrites them (a column is read by the
        # thread that writes column w − n, which need not be the same thread)
        tl.debug_barrier()
        tl.store(conv_row + o_c[:, None] * (KW - 1) + o_w[None, :], window, mask=m_c[:, None] & m_w[None, :])
        # the stash: the n pending tokens' k of key head j and g of its value heads
        o_t = tl.arange(0, BT)
        m_t = o_t < n
        o_k = tl.arange(0, BK)
        p_k = (o_t[:, None] * HK + j) * DK + o_k[None, :]
        m_k = m_t[:, None] & (o_k < DK)[None, :]
        k = tl.load(log_k + i_l * stride_kl + i_n * stride_kn + p_k, mask=m_k)
        tl.store(stash_k + i_l * stride_kl + i_n * stride_kn + p_k, k, mask=m_k)
        o_g = tl.arange(0, BG)
        p_g = o_t[:, None] * H + j * (H // HK) + o_g[None, :]
        m_g = m_t[:, None] & (o_g < H // HK)[None, :]
        g = tl.load(log_g + i_l * stride_gl + i_n * stride_gn + p_g, mask=m_g)
        tl.store(stash_g + i_l * stride_gl + i_n * stride_gn + p_g, g, mask=m_g)


def launch_defer(n, pend, conv, x_log, log_k, log_g, stash_k, stash_g):
    """Grid (Hk, N, L); tensors as in gdn_defer_kernel, each contiguous below its (layer, row) dims."""
    L, N, P = pend.shape
    T, C = x_log.shape[2:]
    HK, DK = log_k.shape[3:]
    H = log_g.shape[3]
    KW = conv.shape[-1] + 1
    gdn_defer_kernel[(HK, N, L)](
        n,
        pend,
        conv,
        x_log,
        log_k,
        log_g,
        stash_k,
        stash_g,
        T,
        C,
        P,
        pend.stride(0),
        pend.stride(1),
        conv.stride(0),
        conv.stride(1),
        x_log.stride(0),
        x_log.stride(1),
        log_k.stride(0),
        log_k.stride(1),
        log_g.stride(0),
        log_g.stride(1),
        HK=HK,
        H=H,
        DK=DK,
        KW=KW,
        BCH=triton.next_power_of_2(triton.cdiv(C, HK)),
        BW=triton.next_power_of_2(max(KW - 1, 1)),
        BT=triton.next_power_of_2(T),
        BK=triton.next_power_of_2(DK),
        BG=triton.next_power_of_2(H // HK),
        BP=triton.next_power_of_2(triton.cdiv(P, HK)),
        num_warps=4,
    )
