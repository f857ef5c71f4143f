"""Triton GDN verify kernel and its launcher (twin: reference.py; public function: __init__.py).

One program per (row n, value head h, slice of BV value dims) keeps its (d_k × BV) tile
of the recurrent state in registers and walks the T block tokens in order, so every
token sees the state after the previous ones, exactly as single-token decoding would
(fla's fused_recurrent layout: grid (d_v / BV, N·H), state tile in registers).

Tokens go in chunks of BT (the whole block at T ≤ 16). Per chunk, everything that does
not depend on the state is computed for all BT tokens at once, as (BT, ·) tiles: the
depthwise causal conv over [conv window | x_1..x_T] + SiLU for the program's q, k and v
channels, the q/k L2 norms, g and β from the raw projections. The sequential part then
only picks token t's row out of those tiles (a masked sum: exact) and runs the
recurrence, so no load waits inside the token loop. The state in memory is only read:
ReplaySSM logs (k, u, g), native rollback stores h after every token.

The programs of a key head's value heads / value slices each recompute its q/k conv
(cheap next to a separate kernel's round trip through memory).
"""

import triton
import triton.language as tl


@triton.jit
def _conv_silu_tile(
    x_row, conv_row, w, ch, m, o_t, T, stride_xt, stride_cc, KW: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr
):
    """(BT, BC) SiLU(causal conv) of channels ch (BC,) at block tokens o_t (BT,); rows ≥ T are 0.

    Token t reads columns t .. t+KW-1 of [conv window (KW-1 columns) | x_0 .. x_{T-1}].
    """
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(KW):
        col = o_t + j
        in_window = col < KW - 1  # an old input (conv state), else a block input (x)
        old = tl.load(
            conv_row + ch[None, :] * stride_cc + col[:, None], mask=in_window[:, None] & m[None, :], other=0.0
        )
        new = tl.load(
            x_row + (col - (KW - 1))[:, None] * stride_xt + ch[None, :],
            mask=(~in_window & (o_t < T))[:, None] & m[None, :],
            other=0.0,
        )
        w_j = tl.load(w + ch * KW + j, mask=m, other=0.0).to(tl.float32)
        acc += w_j[None, :] * (old.to(tl.float32) + new.to(tl.float32))
    # the reference convolves in the model dtype and applies SiLU there: round twice as it does
    y = acc.to(x_row.dtype.element_ty).to(tl.float32)
    y = y / (1.0 + tl.exp(-y))
    return y.to(x_row.dtype.element_ty).to(tl.float32)


@triton.jit
def gdn_verify_kernel(
    x,  # (N, T, C) pre-conv q|k|v, model dtype, channels contiguous
    conv,  # (N, C, KW-1) conv window, model dtype, read only
    w,  # (C, KW) conv weight
    rec,  # (N, H, DK, DV) fp32 recurrent state, (H, DK, DV) contiguous, read only
    a,  # (N, T, H) in_proj_a output
    b,  # (N, T, H) in_proj_b output
    A_log,  # (H,)
    dt_bias,  # (H,)
    o,  # (N, T, H, DV) out, model dtype, contiguous
    log_k,  # (N, T, HK, DK) fp32 out (ReplaySSM)
    log_u,  # (N, T, H, DV) fp32 out (ReplaySSM)
    log_g,  # (N, T, H) fp32 out (ReplaySSM)
    states,  # (N, T, H, DK, DV) fp32 out (native rollback)
    T,
    stride_xn,
    stride_xt,
    stride_cn,
    stride_cc,
    stride_rn,
    stride_an,
    stride_at,
    stride_bn,
    stride_bt,
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
):
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    i_n = (i_nh // H).to(tl.int64)  # int64: offsets into (N, T, H, DK, DV) outputs can pass 2^31
    i_h = i_nh % H
    i_hk = i_h // (H // HK)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < DK
    m_v = o_v < DV
    m_h = m_k[:, None] & m_v[None, :]
    ch_q = i_hk * DK + o_k
    ch_k = HK * DK + i_hk * DK + o_k
    ch_v = 2 * HK * DK + i_h * DV + o_v
    x_row = x + i_n * stride_xn
    conv_row = conv + i_n * stride_cn
    # masked lanes (BK > DK, BV > DV) load 0 and stay 0 through the recurrence
    h = tl.load(rec + i_n * stride_rn + i_h * DK * DV + o_k[:, None] * DV + o_v[None, :], mask=m_h, other=0.0)
    neg_A = -tl.exp(tl.load(A_log + i_h).to(tl.float32))
    dt_b = tl.load(dt_bias + i_h).to(tl.float32)
    # the k log is per key head (one program of each key head's group writes it), g once per head
    first_v = i_v == 0
    log_k_here = first_v & (i_h % (H // HK) == 0)
    for t0 in range(0, T, BT):
        o_t = t0 + tl.arange(0, BT)
        m_t = o_t < T
        q = _conv_silu_tile(x_row, conv_row, w, ch_q, m_k, o_t, T, stride_xt, stride_cc, KW, BT, BK)
        k = _conv_silu_tile(x_row, conv_row, w, ch_k, m_k, o_t, T, stride_xt, stride_cc, KW, BT, BK)
        v = _conv_silu_tile(x_row, conv_row, w, ch_v, m_v, o_t, T, stride_xt, stride_cc, KW, BT, BV)
        q = q * tl.math.rsqrt(tl.sum(q * q, 1) + 1e-6)[:, None] / SQRT_DK
        k = k * tl.math.rsqrt(tl.sum(k * k, 1) + 1e-6)[:, None]
        # g = -exp(A_log) · softplus(a + dt_bias): torch's softplus (threshold 20) with an accurate
        # log1p(e) = log(1+e) · e / ((1+e) − 1) (plain log(1+e) loses the small decays' digits)
        z = tl.load(a + i_n * stride_an + o_t * stride_at + i_h, mask=m_t, other=0.0).to(tl.float32) + dt_b
        e = tl.exp(tl.minimum(z, 20.0))  # clamped: no inf / nan in the branch tl.where drops
        one_e = 1.0 + e
        soft = tl.log(one_e) * (e / tl.where(one_e == 1.0, 1.0, one_e - 1.0))
        g = neg_A * tl.where(z > 20.0, z, tl.where(one_e == 1.0, e, soft))
        # β = sigmoid(b) rounded to the model dtype, as the reference computes it there
        b_t = tl.load(b + i_n * stride_bn + o_t * stride_bt + i_h, mask=m_t, other=0.0).to(tl.float32)
        beta = (1.0 / (1.0 + tl.exp(-b_t))).to(b.dtype.element_ty).to(tl.float32)
        out = tl.zeros([BT, BV], dtype=tl.float32)
        u_log = tl.zeros([BT, BV], dtype=tl.float32)
        for t in range(t0, tl.minimum(t0 + BT, T)):
            row = o_t == t
            q_t = tl.sum(tl.where(row[:, None], q, 0.0), 0)
            k_t = tl.sum(tl.where(row[:, None], k, 0.0), 0)
            v_t = tl.sum(tl.where(row[:, None], v, 0.0), 0)
            g_t = tl.sum(tl.where(row, g, 0.0), 0)
            beta_t = tl.sum(tl.where(row, beta, 0.0), 0)
            # the recurrence, in single-token decode order (replay repeats the first and third lines)
            h = h * tl.exp(g_t)
            u_t = (v_t - tl.sum(h * k_t[:, None], 0)) * beta_t
            h = h + k_t[:, None] * u_t[None, :]
            out = tl.where(row[:, None], tl.sum(h * q_t[:, None], 0)[None, :], out)
            if NATIVE:
                p_s = states + (((i_n * T + t) * H + i_h) * DK + o_k[:, None]) * DV + o_v[None, :]
                tl.store(p_s, h, mask=m_h)
            else:
                u_log = tl.where(row[:, None], u_t[None, :], u_log)
        tok = i_n * T + o_t  # (BT,) flat token index
        m_tv = m_t[:, None] & m_v[None, :]
        tl.store(o + (tok[:, None] * H + i_h) * DV + o_v[None, :], out.to(o.dtype.element_ty), mask=m_tv)
        if not NATIVE:
            tl.store(log_u + (tok[:, None] * H + i_h) * DV + o_v[None, :], u_log, mask=m_tv)
            if first_v:
                tl.store(log_g + tok * H + i_h, g, mask=m_t)
            if log_k_here:
                tl.store(log_k + (tok[:, None] * HK + i_hk) * DK + o_k[None, :], k, mask=m_t[:, None] & m_k[None, :])


def launch_verify(
    x,
    conv_state,
    conv_weight,
    rec_state,
    a,
    b,
    A_log,
    dt_bias,
    o,
    log_k,
    log_u,
    log_g,
    states,
    *,
    num_k_heads,
    native,
    block_v,
    block_t,
    num_warps,
):
    """Grid (d_v / BV, N·H). Tensors as in gdn_verify_kernel (conv_weight as (C, K)); the unused
    outputs of the other mode may be any tensor (never touched)."""
    N, T, _ = x.shape
    H, DK, DV = rec_state.shape[1:]
    grid = (triton.cdiv(DV, block_v), N * H)
    gdn_verify_kernel[grid](
        x,
        conv_state,
        conv_weight,
        rec_state,
        a,
        b,
        A_log,
        dt_bias,
        o,
        log_k,
        log_u,
        log_g,
        states,
        T,
        x.stride(0),
        x.stride(1),
        conv_state.stride(0),
        conv_state.stride(1),
        rec_state.stride(0),
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        HK=num_k_heads,
        H=H,
        DK=DK,
        DV=DV,
        KW=conv_weight.shape[1],
        BK=triton.next_power_of_2(DK),
        BV=block_v,
        BT=block_t,
        SQRT_DK=float(DK) ** 0.5,
        NATIVE=native,
        num_warps=num_warps,
        enable_fp_fusion=False,  # the fold must round as verify does: see gdn_replay/kernel.py
    )
