"""Triton GDN verify kernels and their launcher (twin: reference.py; public function: __init__.py).

Two kernels per verify, because the recurrence is latency-bound:

1. ``gdn_prep_kernel``, grid (N, H): everything that does not depend on the state, for all
   T block tokens at once as (BT, ·) tiles — the depthwise causal conv over
   [conv window | x_1..x_T] + SiLU, the q/k L2 norms, g and β from the raw projections —
   written as fp32 rows (k and g straight into the ReplaySSM log).
2. ``gdn_recur_kernel``, grid (d_v / BV, N·H): one program keeps its (d_k × BV) tile of
   the recurrent state in registers and walks the T tokens in order, so every token sees
   the state after the previous ones, exactly as single-token decoding would (fla's
   fused_recurrent layout). Each step is two reductions over d_k (hᵀk and hᵀq); the next
   token's q, k, v, g, β are loaded before them so the loads' latency hides under the
   step. The state in memory is only read: ReplaySSM logs u, native rollback stores h
   after every token.

Why not one kernel: a fused version picked token t's q/k/v/g/β out of the chunk's tiles
with masked sums — five more cross-warp reductions per token, which made the token loop
about three times longer than the round trip of the prepared rows through L2.
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
def gdn_prep_kernel(
    x,  # (N, T, C) pre-conv q|k|v, model dtype, channels contiguous
    conv,  # (N, C, KW-1) conv window, model dtype, read only
    w,  # (C, KW) conv weight
    a,  # (N, T, H) in_proj_a output
    b,  # (N, T, H) in_proj_b output
    A_log,  # (H,)
    dt_bias,  # (H,)
    q_out,  # (N, T, HK, DK) fp32 out: conv + SiLU + L2 norm, scaled by 1/sqrt(d_k)
    k_out,  # (N, T, HK, DK) fp32 out: conv + SiLU + L2 norm (the ReplaySSM log's k)
    v_out,  # (N, T, H, DV) fp32 out: conv + SiLU
    g_out,  # (N, T, H) fp32 out: log decay (the ReplaySSM log's g)
    beta_out,  # (N, T, H) fp32 out
    T,
    stride_xn,
    stride_xt,
    stride_cn,
    stride_cc,
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
    BDV: tl.constexpr,
    BT: tl.constexpr,
    SQRT_DK: tl.constexpr,
):
    i_n = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    i_hk = i_h // (H // HK)
    o_k = tl.arange(0, BK)
    o_v = tl.arange(0, BDV)
    m_k = o_k < DK
    m_v = o_v < DV
    x_row = x + i_n * stride_xn
    conv_row = conv + i_n * stride_cn
    neg_A = -tl.exp(tl.load(A_log + i_h).to(tl.float32))
    dt_b = tl.load(dt_bias + i_h).to(tl.float32)
    first_of_key_head = i_h % (H // HK) == 0  # one program per key head writes its q and k
    for t0 in range(0, T, BT):
        o_t = t0 + tl.arange(0, BT)
        m_t = o_t < T
        tok = i_n * T + o_t  # (BT,) flat token index
        v = _conv_silu_tile(
            x_row, conv_row, w, 2 * HK * DK + i_h * DV + o_v, m_v, o_t, T, stride_xt, stride_cc, KW, BT, BDV
        )
        tl.store(v_out + (tok[:, None] * H + i_h) * DV + o_v[None, :], v, mask=m_t[:, None] & m_v[None, :])
        if first_of_key_head:
            q = _conv_silu_tile(x_row, conv_row, w, i_hk * DK + o_k, m_k, o_t, T, stride_xt, stride_cc, KW, BT, BK)
            k = _conv_silu_tile(
                x_row, conv_row, w, HK * DK + i_hk * DK + o_k, m_k, o_t, T, stride_xt, stride_cc, KW, BT, BK
            )
            q = q * tl.math.rsqrt(tl.sum(q * q, 1) + 1e-6)[:, None] / SQRT_DK
            k = k * tl.math.rsqrt(tl.sum(k * k, 1) + 1e-6)[:, None]
            p_qk = (tok[:, None] * HK + i_hk) * DK + o_k[None, :]
            m_qk = m_t[:, None] & m_k[None, :]
            tl.store(q_out + p_qk, q, mask=m_qk)
            tl.store(k_out + p_qk, k, mask=m_qk)
        # g = -exp(A_log) · softplus(a + dt_bias): torch's softplus (threshold 20) with an accurate
        # log1p(e) = log(1+e) · e / ((1+e) − 1) (plain log(1+e) loses the small decays' digits)
        z = tl.load(a + i_n * stride_an + o_t * stride_at + i_h, mask=m_t, other=0.0).to(tl.float32) + dt_b
        e = tl.exp(tl.minimum(z, 20.0))  # clamped: no inf / nan in the branch tl.where drops
        one_e = 1.0 + e
        soft = tl.log(one_e) * (e / tl.where(one_e == 1.0, 1.0, one_e - 1.0))
        g = neg_A * tl.where(z > 20.0, z, tl.where(one_e == 1.0, e, soft))
        tl.store(g_out + tok * H + i_h, g, mask=m_t)
        # β = sigmoid(b) rounded to the model dtype, as the reference computes it there
        b_t = tl.load(b + i_n * stride_bn + o_t * stride_bt + i_h, mask=m_t, other=0.0).to(tl.float32)
        beta = (1.0 / (1.0 + tl.exp(-b_t))).to(b.dtype.element_ty).to(tl.float32)
        tl.store(beta_out + tok * H + i_h, beta, mask=m_t)


@triton.jit
def _token_rows(q_in, k_in, v_in, g_in, beta_in, i_n, i_h, i_hk, t, T, o_k, o_v, m_k, m_v, HK, H, DK, DV):
    """Token t's prepared q, k (BK,), v (BV,), g, β of one (row, head); t ≥ T reads token T−1 again
    (the prefetch past the last token: loaded, never used; a clamp, not a mask, so no scalar masks)."""
    tok = i_n * T + tl.minimum(t, T - 1)
    q = tl.load(q_in + (tok * HK + i_hk) * DK + o_k, mask=m_k, other=0.0)
    k = tl.load(k_in + (tok * HK + i_hk) * DK + o_k, mask=m_k, other=0.0)
    v = tl.load(v_in + (tok * H + i_h) * DV + o_v, mask=m_v, other=0.0)
    g = tl.load(g_in + tok * H + i_h)
    beta = tl.load(beta_in + tok * H + i_h)
    return q, k, v, g, beta


@triton.jit
def gdn_recur_kernel(
    q_in,  # (N, T, HK, DK) fp32, from gdn_prep_kernel
    k_in,  # (N, T, HK, DK) fp32
    v_in,  # (N, T, H, DV) fp32
    g_in,  # (N, T, H) fp32
    beta_in,  # (N, T, H) fp32
    rec,  # (N, H, DK, DV) fp32 recurrent state, (H, DK, DV) contiguous, read only
    o,  # (N, T, H, DV) out, model dtype, contiguous
    log_u,  # (N, T, H, DV) fp32 out (ReplaySSM)
    states,  # (N, T, H, DK, DV) fp32 out (native rollback)
    T,
    stride_rn,
    HK: tl.constexpr,
    H: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
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
    # masked lanes (BK > DK, BV > DV) load 0 and stay 0 through the recurrence
    h = tl.load(rec + i_n * stride_rn + i_h * DK * DV + o_k[:, None] * DV + o_v[None, :], mask=m_h, other=0.0)
    q_t, k_t, v_t, g_t, beta_t = _token_rows(
        q_in, k_in, v_in, g_in, beta_in, i_n, i_h, i_hk, 0, T, o_k, o_v, m_k, m_v, HK, H, DK, DV
    )
    for t in range(T):
        # the next token's rows first: their loads are in flight while this token's step runs
        q_n, k_n, v_n, g_n, beta_n = _token_rows(
            q_in, k_in, v_in, g_in, beta_in, i_n, i_h, i_hk, t + 1, T, o_k, o_v, m_k, m_v, HK, H, DK, DV
        )
        # the recurrence, in single-token decode order (replay repeats the first and third lines)
        h = h * tl.exp(g_t)
        u_t = (v_t - tl.sum(h * k_t[:, None], 0)) * beta_t
        h = h + k_t[:, None] * u_t[None, :]
        out = tl.sum(h * q_t[:, None], 0)
        tok = i_n * T + t
        tl.store(o + (tok * H + i_h) * DV + o_v, out.to(o.dtype.element_ty), mask=m_v)
        if NATIVE:
            tl.store(states + ((tok * H + i_h) * DK + o_k[:, None]) * DV + o_v[None, :], h, mask=m_h)
        else:
            tl.store(log_u + (tok * H + i_h) * DV + o_v, u_t, mask=m_v)
        q_t, k_t, v_t, g_t, beta_t = q_n, k_n, v_n, g_n, beta_n


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
    prep,
    log_u,
    states,
    *,
    num_k_heads,
    native,
    block_v,
    block_t,
    num_warps,
    prep_warps,
):
    """gdn_prep_kernel on grid (N, H), then gdn_recur_kernel on grid (d_v / BV, N·H). Tensors as in
    the kernels (conv_weight as (C, K)); prep = (q, k, v, g, β) fp32 buffers of the prep kernel's
    output shapes; the unused output of the other mode may be any tensor (never touched)."""
    N, T, _ = x.shape
    H, DK, DV = rec_state.shape[1:]
    q, k, v, g, beta = prep
    BK = triton.next_power_of_2(DK)
    gdn_prep_kernel[(N, H)](
        x,
        conv_state,
        conv_weight,
        a,
        b,
        A_log,
        dt_bias,
        q,
        k,
        v,
        g,
        beta,
        T,
        x.stride(0),
        x.stride(1),
        conv_state.stride(0),
        conv_state.stride(1),
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        HK=num_k_heads,
        H=H,
        DK=DK,
        DV=DV,
        KW=conv_weight.shape[1],
        BK=BK,
        BDV=triton.next_power_of_2(DV),
        BT=block_t,
        SQRT_DK=float(DK) ** 0.5,
        num_warps=prep_warps,
        enable_fp_fusion=False,  # round as the reference does (no fused multiply-adds)
    )
    gdn_recur_kernel[(triton.cdiv(DV, block_v), N * H)](
        q,
        k,
        v,
        g,
        beta,
        rec_state,
        o,
        log_u,
        states,
        T,
        rec_state.stride(0),
        HK=num_k_heads,
        H=H,
        DK=DK,
        DV=DV,
        BK=BK,
        BV=block_v,
        NATIVE=native,
        num_warps=num_warps,
        enable_fp_fusion=False,  # the fold must round as verify does: see gdn_replay/kernel.py
    )
