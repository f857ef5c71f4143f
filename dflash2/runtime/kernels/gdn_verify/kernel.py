"""Triton GDN verify kernels and their launcher (twin: reference.py; public function: __init__.py).

Two kernels per verify, because the recurrence is latency-bound:

1. ``gdn_prep_kernel``, grid (N, 2·Hk + H, ⌈T / BT⌉): one program per row, *head of channels* — a q
   head, a k head or a v head (d_k or d_v conv channels) — and chunk of BT tokens, so q, k and v
   are prepared by different programs side by side, none of them walking the three in sequence.
   For the chunk's tokens at once as (BT, ·) tiles: the depthwise causal conv over
   [conv window | x_1..x_T] + SiLU, then the L2 norm (q, k heads) or g and β from the raw
   projections (v heads), written as fp32 rows (k and g straight into the ReplaySSM log).
2. ``gdn_recur_kernel``, grid (d_v / BV, N·H): one program keeps its (d_k × BV) tile of
   the recurrent state in registers and walks the T tokens in order, so every token sees
   the state after the previous ones, exactly as single-token decoding would (fla's
   fused_recurrent layout). Each step is two reductions over d_k (hᵀk and hᵀq); the rows of
   the next two tokens are loaded before them so the loads' latency hides under the steps.
   ReplaySSM logs u, native rollback stores h after every token.

**The deferred commit (FOLD, ReplaySSM with a reserved log; docs/ARCHITECTURE.md §5.5).** A
commit does not fold: one launch for all layers (gdn_replay/defer_kernel.py) rolls each conv
window by the accepted n, copies the accepted tokens' logged k and g to a per-layer stash and
records n as a count per recurrence program. The next verify's recurrence kernel then folds
those n tokens — h ← h·exp(g_t); h ← h + k_t u_tᵀ, the commit kernel's operations in its order —
into the state tile it already holds in registers, writes the folded tile back once and zeroes
its count, then walks the new block. One state read and one write per step instead of two of
each, and no fold launch. What the fold reads is never written during the verify: the stash
(the new block's k and g go to the log), and the program's own (head, value slice) of the old u,
all read before its first new u is stored (a barrier between: its threads hold different
elements). So the fold needs nothing of the prep kernel's, and with ``pdl`` it runs while the prep
does. The prep kernel reads the window the commit rolled and never writes it.

Why not one kernel: a fused version picked token t's q/k/v/g/β out of the chunk's tiles
with masked sums — five more cross-warp reductions per token, which made the token loop
about three times longer than the round trip of the prepared rows through L2. The two kernels' bodies
are jit helpers (``_prep_chunk``, ``gdn_recur_program``) so that one_launch.py can run both kinds of
program in one grid (an option, slower at batch 1 on the H200; docs/BENCHMARKS.md, stop 22).
"""

import triton
import triton.language as tl


@triton.jit
def gdn_prep_kernel(
    x,  # (N, T, C) pre-conv q|k|v, model dtype, channels contiguous
    conv,  # (N, C, KW-1) conv window, model dtype (a deferred commit has rolled it already)
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
    x_log,  # (N, T, C) out (STORE_X): the log's x, this block's pre-conv inputs
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
    HK: tl.constexpr,
    H: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    KW: tl.constexpr,
    BC: tl.constexpr,  # ≥ max(DK, DV): one head of channels
    BT: tl.constexpr,  # tokens per chunk
    SQRT_DK: tl.constexpr,
    STORE_X: tl.constexpr,
    PDL: tl.constexpr,  # the recurrence is launched as a programmatic dependent: let it start now
):
    if PDL:
        # the recurrence kernel may launch once every prep program has passed here; before its gdc_wait
        # (which waits for this whole grid to finish and flush) it uses nothing this kernel writes
        tl.extra.cuda.gdc_launch_dependents()
    i_n = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)  # 0..HK-1: q head j; HK..2·HK-1: k head j-HK; then v head j-2·HK
    _prep_chunk(
        x, conv, w, a, b, A_log, dt_bias, q_out, k_out, v_out, g_out, beta_out, x_log, T,
        stride_xn, stride_xt, stride_cn, stride_cc, stride_an, stride_at, stride_bn, stride_bt, stride_ln,
        stride_lt, i_n, j, tl.program_id(2) * BT, HK, H, DK, DV, KW, BC, BT, SQRT_DK, STORE_X,
    )  # fmt: skip


@triton.jit
def _prep_chunk(
    x, conv, w, a, b, A_log, dt_bias, q_out, k_out, v_out, g_out, beta_out, x_log, T,
    stride_xn, stride_xt, stride_cn, stride_cc, stride_an, stride_at, stride_bn, stride_bt, stride_ln, stride_lt,
    i_n, j, t0, HK, H, DK, DV, KW, BC, BT, SQRT_DK, STORE_X,
):  # fmt: skip
    """gdn_prep_kernel's work on tokens t0 .. t0+BT-1 of row i_n for head of channels j (its arguments)."""
    is_v = j >= 2 * HK
    i_h = j - 2 * HK  # the value head (v programs only)
    i_hk = tl.where(j < HK, j, j - HK)  # the key head (q / k programs only)
    # channels of this head: q|k|v are concatenated, q and k heads of DK channels, v heads of DV
    base = tl.where(is_v, 2 * HK * DK + i_h * DV, j * DK)
    o_c = tl.arange(0, BC)
    m_c = o_c < tl.where(is_v, DV, DK)
    ch = base + o_c
    x_row = x + i_n * stride_xn
    conv_row = conv + i_n * stride_cn
    xl_row = x_log + i_n * stride_ln
    # gate parameters of the value head (q / k programs read head 0's and never use them: no scalar masks)
    h_gate = tl.maximum(i_h, 0)
    neg_A = -tl.exp(tl.load(A_log + h_gate).to(tl.float32))
    dt_b = tl.load(dt_bias + h_gate).to(tl.float32)
    o_t = t0 + tl.arange(0, BT)
    m_t = o_t < T
    tok = i_n * T + o_t  # (BT,) flat token index
    # SiLU(causal conv): token t reads columns t .. t+KW-1 of [window (KW-1) | x_0 .. x_{T-1}]
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for jj in tl.static_range(KW):
        col = o_t + jj
        in_window = col < KW - 1
        new = tl.load(
            x_row + (col - (KW - 1))[:, None] * stride_xt + ch[None, :],
            mask=(~in_window & m_t)[:, None] & m_c[None, :],
            other=0.0,
        )
        old = tl.load(
            conv_row + ch[None, :] * stride_cc + col[:, None],
            mask=in_window[:, None] & m_c[None, :],
            other=0.0,
        )
        w_j = tl.load(w + ch * KW + jj, mask=m_c, other=0.0).to(tl.float32)
        acc += w_j[None, :] * (old.to(tl.float32) + new.to(tl.float32))
    # the reference convolves in the model dtype and applies SiLU there: round twice as it does
    y = acc.to(x_row.dtype.element_ty).to(tl.float32)
    y = y / (1.0 + tl.exp(-y))
    y = y.to(x_row.dtype.element_ty).to(tl.float32)
    if STORE_X:  # the last tap's `new` is x_t itself: the log keeps the block for the next roll
        tl.store(xl_row + o_t[:, None] * stride_lt + ch[None, :], new, mask=m_t[:, None] & m_c[None, :])
    m_tc = m_t[:, None] & m_c[None, :]
    if is_v:
        tl.store(v_out + (tok[:, None] * H + i_h) * DV + o_c[None, :], y, mask=m_tc)
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
    else:
        y = y * tl.math.rsqrt(tl.sum(y * y, 1) + 1e-6)[:, None]
        p_qk = (tok[:, None] * HK + i_hk) * DK + o_c[None, :]
        if j < HK:
            tl.store(q_out + p_qk, y / SQRT_DK, mask=m_tc)
        else:
            tl.store(k_out + p_qk, y, mask=m_tc)


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
def _fold_rows(stash_k, stash_g, log_u, i_n, i_h, i_hk, t, T, o_k, o_v, m_k, m_v, HK, H, DK, DV):
    """Pending token t's g (scalar), k (BK,) and u (BV,) for value head i_h, clamped to T−1 like
    :func:`_token_rows` (the prefetch past the last pending token reads a row it never uses)."""
    tok = i_n * T + tl.minimum(t, T - 1)
    g = tl.load(stash_g + tok * H + i_h)
    k = tl.load(stash_k + (tok * HK + i_hk) * DK + o_k, mask=m_k, other=0.0)
    u = tl.load(log_u + (tok * H + i_h) * DV + o_v, mask=m_v, other=0.0)
    return g, k, u


@triton.jit
def _add_outer(h, k, u, FMA: tl.constexpr):
    """h + k uᵀ on the (BK, BV) state tile, the second state update: the one definition the walk, the fold
    and the commit kernel share, so that they round alike (FMA: one fused multiply-add per element)."""
    if FMA:
        return tl.fma(k[:, None], u[None, :], h)
    else:
        return h + k[:, None] * u[None, :]


@triton.jit
def _fold_token(h, g, k, u, FMA: tl.constexpr):
    """One pending token folded into the (BK, BV) state tile: the decay, then :func:`_add_outer`, the walk's
    order (gdn_replay_kernel folds with this too)."""
    return _add_outer(h * tl.exp(g), k, u, FMA)


@triton.jit
def _state_tile(rec, stride_rn, i_n, i_h, i_v, DK, DV, BK, BV):
    """The (BK, BV) tile of row i_n, value head i_h, value slice i_v of a (N, H, DK, DV) state: its d_k and d_v
    offsets and masks, the tile's mask and pointers -> (o_k, o_v, m_k, m_v, m_h, p_rec)."""
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < DK
    m_v = o_v < DV
    m_h = m_k[:, None] & m_v[None, :]
    p_rec = rec + i_n * stride_rn + i_h * DK * DV + o_k[:, None] * DV + o_v[None, :]
    return o_k, o_v, m_k, m_v, m_h, p_rec


@triton.jit
def _fold_pending(
    h, n, stash_k, stash_g, log_u, i_n, i_h, i_hk, T, o_k, o_v, m_k, m_v, HK, H, DK, DV, STAGES: tl.constexpr, FMA
):  # fmt: skip
    """The n pending tokens folded into the (BK, BV) tile h in order (STAGES ≥ 1: Triton's software pipeline
    loads their rows ahead); returns h. Two tokens per iteration, then the odd one out: the same updates in
    the same order, the loop's per-iteration cost shared (H200, 9B shape, batch 1, all 16 of 16 pending:
    17.1 -> 16.0 µs per layer; docs/BENCHMARKS.md stop 20). By four it was slower (17.1), and so was folding
    the last pending tokens inside the block loop's first iteration (stop 21)."""
    for t in tl.range(0, n - 1, 2, num_stages=STAGES):
        fg, fk, fu = _fold_rows(stash_k, stash_g, log_u, i_n, i_h, i_hk, t, T, o_k, o_v, m_k, m_v, HK, H, DK, DV)
        fg1, fk1, fu1 = _fold_rows(stash_k, stash_g, log_u, i_n, i_h, i_hk, t + 1, T, o_k, o_v, m_k, m_v, HK, H, DK, DV)
        h = _fold_token(_fold_token(h, fg, fk, fu, FMA), fg1, fk1, fu1, FMA)
    if n % 2 == 1:
        fg, fk, fu = _fold_rows(stash_k, stash_g, log_u, i_n, i_h, i_hk, n - 1, T, o_k, o_v, m_k, m_v, HK, H, DK, DV)
        h = _fold_token(h, fg, fk, fu, FMA)
    return h


@triton.jit
def _fold_ahead_program(
    rec, log_u, pend, stash_k, stash_g, T, stride_rn, stride_pn, i_v, i_nh, HK, H, DK, DV, BK, BV, STAGES, FMA
):  # fmt: skip
    """Another layer's pending fold for one (row, head, value slice) tile (``FOLD_NEXT`` in gdn_recur_kernel):
    the walk's fold of that layer's next verify, done here instead — the same tile, the same operations in
    the same order (bit for bit), the folded tile stored and the count zeroed, so that the next verify finds
    nothing pending. Reads that layer's stash and log u, writes its state and counts; nothing of this layer's."""
    NV = (DV + BV - 1) // BV
    i_n = (i_nh // H).to(tl.int64)
    i_h = i_nh % H
    i_hk = i_h // (H // HK)
    p_n = pend + i_n * stride_pn + i_h * NV + i_v
    n = tl.load(p_n)
    if n > 0:
        o_k, o_v, m_k, m_v, m_h, p_rec = _state_tile(rec, stride_rn, i_n, i_h, i_v, DK, DV, BK, BV)
        h = tl.load(p_rec, mask=m_h, other=0.0)
        h = _fold_pending(
            h, n, stash_k, stash_g, log_u, i_n, i_h, i_hk, T, o_k, o_v, m_k, m_v, HK, H, DK, DV, STAGES, FMA
        )
        tl.store(p_rec, h, mask=m_h)
        tl.store(p_n, n * 0)


@triton.jit
def _fma_pair(ax, ay, ap, bx, by, bp):
    """tl.reduce's combine for :func:`_dot_rows`. (x, y, p) is a product still to be taken, x·y (p = 0: an
    element of the tile), or a partial sum x (y = 1, p = 1). A partial sum takes the other side's product in one
    fused multiply-add, two partial sums add, two products are multiplied and added. The result is (s, 1, 1).

    It must be commutative bit for bit: in the butterfly over a warp's lanes, lane A computes
    combine(A, B) and lane B combine(B, A), and each goes on with its own copy of the sum. With
    fma(b.x, b.y, a.x·a.y) for two products (a thread holding one element along d_k, as small tiles do) the
    two copies can differ in the last bit, and then the u one lane logs is not the u another lane folds into
    its rows of the state: the exact fold breaks. Each case above is symmetric in a and b. The tags are
    compile-time constants (the tile's zeros, then the ones each combine returns), so the compiler keeps only
    the branch each combine can take: a thread's first two elements cost two multiplies and an add, every
    further element one fma, each butterfly step one add."""
    both = ax * ay + bx * by
    a_sum = tl.fma(bx, by, ax)
    b_sum = tl.fma(ax, ay, bx)
    s = tl.where(ap != 0, tl.where(bp != 0, ax + bx, a_sum), tl.where(bp != 0, b_sum, both))
    one = tl.full([], 1.0, tl.float32)
    return s, one, one


@triton.jit
def _dot_rows(h, w, FMA: tl.constexpr):
    """Σ_r h[r, :]·w[r] of a (BK, BV) tile and a (BK,) vector -> (BV,). FMA: each product taken into the
    running sum by a fused multiply-add (one instruction and one rounding per element instead of a multiply
    and an add), written out as a reduction whose combine is that fma (:func:`_fma_pair`), so the compiler
    has no contraction to decide and every specialisation of the kernel rounds alike; else tl.sum of the
    products."""
    if FMA:
        zero = tl.zeros(h.shape, dtype=tl.float32)
        s, _, _ = tl.reduce((h, tl.broadcast_to(w[:, None], h.shape), zero), 0, _fma_pair)
        return s
    else:
        return tl.sum(h * w[:, None], 0)


@triton.jit
def _verify_token(
    h, q, k, v, g, beta, t, i_n, i_h, T, o, log_u, states, o_k, o_v, m_v, m_h, H, DK, DV, NATIVE, SPLIT_OUT,
    FMA,
):  # fmt: skip
    """Block token t of one (row, head, value slice): the recurrence in single-token decode order, its
    output stored and its u logged (ReplaySSM) or the state after it stored (native); returns h."""
    h = h * tl.exp(g)
    if SPLIT_OUT:
        # o_t = (h + k uᵀ)ᵀq = hᵀq + (k·q) u: hᵀq no longer waits for u, so its sum over d_k runs beside
        # hᵀk's instead of after it (one dependent chain per token instead of two; o rounds differently,
        # the state and the log do not)
        hq = _dot_rows(h, q, FMA)
        kq = tl.sum(k * q, 0)
    u = (v - _dot_rows(h, k, FMA)) * beta
    h = _add_outer(h, k, u, FMA)
    out = hq + kq * u if SPLIT_OUT else _dot_rows(h, q, FMA)
    tok = i_n * T + t
    tl.store(o + (tok * H + i_h) * DV + o_v, out.to(o.dtype.element_ty), mask=m_v)
    if NATIVE:
        tl.store(states + ((tok * H + i_h) * DK + o_k[:, None]) * DV + o_v[None, :], h, mask=m_h)
    else:
        tl.store(log_u + (tok * H + i_h) * DV + o_v, u, mask=m_v)
    return h


@triton.jit
def gdn_recur_kernel(
    q_in,  # (N, T, HK, DK) fp32, from gdn_prep_kernel
    k_in,  # (N, T, HK, DK) fp32
    v_in,  # (N, T, H, DV) fp32
    g_in,  # (N, T, H) fp32
    beta_in,  # (N, T, H) fp32
    rec,  # (N, H, DK, DV) fp32 recurrent state, (H, DK, DV) contiguous; read only unless FOLD
    o,  # (N, T, H, DV) out, model dtype, contiguous
    log_u,  # (N, T, H, DV) fp32 out (ReplaySSM); FOLD: holds the pending tokens' u until overwritten
    states,  # (N, T, H, DK, DV) fp32 out (native rollback)
    pend,  # (N, P) int32 pending counts, P = H·NV (FOLD: column i_h·NV + i_v is this program's)
    stash_k,  # (N, T, HK, DK) fp32 (FOLD): the pending tokens' k, copied there by the deferred commit
    stash_g,  # (N, T, H) fp32 (FOLD): their g
    rec_next,  # FOLD_NEXT: the next layer's rec, log u, pending counts and stash (this layer's shapes)
    u_next,
    pend_next,
    stash_k_next,
    stash_g_next,
    T,
    stride_rn,
    stride_pn,
    NH,  # N·H: programs (·, i ≥ NH) of grid axis 1 fold the next layer ahead (FOLD_NEXT)
    HK: tl.constexpr,
    H: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    NATIVE: tl.constexpr,
    FOLD: tl.constexpr,
    STAGES: tl.constexpr,  # 0: rows prefetched two tokens ahead by hand; ≥ 1: tl.range's software pipeline
    SPLIT_OUT: tl.constexpr,  # (STAGES ≥ 1) o_t = hᵀq + (k·q) u_t: see the loop
    FMA: tl.constexpr,  # fused multiply-adds: the d_k sums (_dot_rows) and the state update (_fold_token)
    PDL: tl.constexpr,  # launched as a programmatic dependent of the prep kernel: gdc_wait before its outputs
    # (the fold reads only the stash and its own u, which the prep kernel does not touch: it runs before the wait)
    FOLD_NEXT: tl.constexpr,  # N·H more programs fold the next layer's pending commit: _fold_ahead_program
):
    i_nh = tl.program_id(1)
    ahead = False  # without FOLD_NEXT a compile-time False: the branch below is not compiled
    if FOLD_NEXT:
        ahead = i_nh >= NH
    if ahead:
        _fold_ahead_program(
            rec_next, u_next, pend_next, stash_k_next, stash_g_next, T, stride_rn, stride_pn, tl.program_id(0),
            i_nh - NH, HK, H, DK, DV, BK, BV, STAGES, FMA,
        )  # fmt: skip
    else:
        gdn_recur_program(
            q_in, k_in, v_in, g_in, beta_in, rec, o, log_u, states, pend, stash_k, stash_g, T, stride_rn, stride_pn,
            tl.program_id(0), i_nh, pend, 0, HK, H, DK, DV, BK, BV, NATIVE, FOLD, STAGES, SPLIT_OUT,
            FMA, 1 if PDL else 0,
        )  # fmt: skip


@triton.jit
def _await_prep(ready, target, SYNC: tl.constexpr):
    """Wait until the prep's outputs may be read. SYNC 0: nothing to wait for (they were written by an
    earlier launch); 1: gdc_wait (this is the prep kernel's programmatic dependent); 2: spin until the
    int32 counter at ``ready`` reaches ``target`` (the one-launch kernel: one_launch.py)."""
    if SYNC == 1:
        tl.extra.cuda.gdc_wait()
    elif SYNC == 2:
        # one thread polls with acquire semantics, then the barrier orders every thread's loads after it
        # (the release side: every prep thread's stores, a barrier, then one release increment)
        seen = tl.atomic_add(ready, 0, sem="acquire", scope="gpu")
        while seen < target:
            seen = tl.atomic_add(ready, 0, sem="acquire", scope="gpu")
        tl.debug_barrier()


@triton.jit
def gdn_recur_program(
    q_in, k_in, v_in, g_in, beta_in, rec, o, log_u, states, pend, stash_k, stash_g, T, stride_rn, stride_pn,
    i_v, i_nh, ready, ready_target, HK, H, DK, DV, BK, BV, NATIVE, FOLD, STAGES, SPLIT_OUT, FMA,
    SYNC: tl.constexpr,
):  # fmt: skip
    """gdn_recur_kernel's program (value slice i_v, row · head i_nh) on its arguments; SYNC (and ready,
    ready_target) say how it waits for the prep's outputs: :func:`_await_prep`."""
    NV = (DV + BV - 1) // BV  # value slices per head: the pending counts' columns per head
    i_n = (i_nh // H).to(tl.int64)  # int64: offsets into (N, T, H, DK, DV) outputs can pass 2^31
    i_h = i_nh % H
    i_hk = i_h // (H // HK)
    o_k, o_v, m_k, m_v, m_h, p_rec = _state_tile(rec, stride_rn, i_n, i_h, i_v, DK, DV, BK, BV)
    # masked lanes (BK > DK, BV > DV) load 0 and stay 0 through the recurrence
    h = tl.load(p_rec, mask=m_h, other=0.0)
    if STAGES > 0:
        # the same operations in the same order, the rows loaded inside the loops: Triton's pipeliner
        # issues the loads of the next STAGES-1 tokens ahead (asynchronous copies into shared memory,
        # read back in the layout the step uses, so no per-token layout conversion either)
        if FOLD:
            p_n = pend + i_n * stride_pn + i_h * NV + i_v
            n = tl.load(p_n)
            if n > 0:
                h = _fold_pending(
                    h, n, stash_k, stash_g, log_u, i_n, i_h, i_hk, T, o_k, o_v, m_k, m_v, HK, H, DK, DV, STAGES, FMA
                )
                tl.store(p_rec, h, mask=m_h)
                tl.store(p_n, n * 0)
            tl.debug_barrier()
        # the state tile is in hand and folded; everything below reads the prep's outputs
        _await_prep(ready, ready_target, SYNC)
        for t in tl.range(0, T, num_stages=STAGES):
            q_t, k_t, v_t, g_t, beta_t = _token_rows(
                q_in, k_in, v_in, g_in, beta_in, i_n, i_h, i_hk, t, T, o_k, o_v, m_k, m_v, HK, H, DK, DV
            )
            h = _verify_token(
                h,
                q_t,
                k_t,
                v_t,
                g_t,
                beta_t,
                t,
                i_n,
                i_h,
                T,
                o,
                log_u,
                states,
                o_k,
                o_v,
                m_v,
                m_h,
                H,
                DK,
                DV,
                NATIVE,
                SPLIT_OUT,
                FMA,
            )
    else:
        # every load that depends on nothing is issued up front, so their latencies overlap: the pending
        # count, the first two pending tokens' rows (stale rows if fewer are pending: loaded, never used)
        # and the first two block tokens' rows (the prep kernel's output; needed after the fold)
        if FOLD:
            p_n = pend + i_n * stride_pn + i_h * NV + i_v
            n = tl.load(p_n)
            fg_0, fk_0, fu_0 = _fold_rows(
                stash_k, stash_g, log_u, i_n, i_h, i_hk, 0, T, o_k, o_v, m_k, m_v, HK, H, DK, DV
            )
            fg_1, fk_1, fu_1 = _fold_rows(
                stash_k, stash_g, log_u, i_n, i_h, i_hk, 1, T, o_k, o_v, m_k, m_v, HK, H, DK, DV
            )
        if SYNC == 0:  # the block's first rows in flight during the fold (else they wait for the prep)
            q_0, k_0, v_0, g_0, beta_0 = _token_rows(
                q_in, k_in, v_in, g_in, beta_in, i_n, i_h, i_hk, 0, T, o_k, o_v, m_k, m_v, HK, H, DK, DV
            )
            q_1, k_1, v_1, g_1, beta_1 = _token_rows(
                q_in, k_in, v_in, g_in, beta_in, i_n, i_h, i_hk, 1, T, o_k, o_v, m_k, m_v, HK, H, DK, DV
            )
        if FOLD:
            if n > 0:
                # the deferred commit: gdn_replay_kernel's fold on the tile in registers, same operations in
                # the same order (bit for bit the state it would have written); two tokens prefetched
                for t in range(0, n):
                    fg_2, fk_2, fu_2 = _fold_rows(
                        stash_k, stash_g, log_u, i_n, i_h, i_hk, t + 2, T, o_k, o_v, m_k, m_v, HK, H, DK, DV
                    )
                    h = _fold_token(h, fg_0, fk_0, fu_0, FMA)
                    fg_0, fk_0, fu_0 = fg_1, fk_1, fu_1
                    fg_1, fk_1, fu_1 = fg_2, fk_2, fu_2
                tl.store(p_rec, h, mask=m_h)  # the committed state, materialised once
                tl.store(p_n, n * 0)  # consumed: a second verify without a commit folds nothing
            # the fold's reads of the old u are done in every thread before the new block's u is stored
            tl.debug_barrier()
        if SYNC != 0:  # the fold needed nothing of the prep's; the block does
            _await_prep(ready, ready_target, SYNC)
            q_0, k_0, v_0, g_0, beta_0 = _token_rows(
                q_in, k_in, v_in, g_in, beta_in, i_n, i_h, i_hk, 0, T, o_k, o_v, m_k, m_v, HK, H, DK, DV
            )
            q_1, k_1, v_1, g_1, beta_1 = _token_rows(
                q_in, k_in, v_in, g_in, beta_in, i_n, i_h, i_hk, 1, T, o_k, o_v, m_k, m_v, HK, H, DK, DV
            )
        for t in range(T):
            # the rows two tokens ahead first: their loads are in flight while this token's step runs
            q_2, k_2, v_2, g_2, beta_2 = _token_rows(
                q_in, k_in, v_in, g_in, beta_in, i_n, i_h, i_hk, t + 2, T, o_k, o_v, m_k, m_v, HK, H, DK, DV
            )
            h = _verify_token(
                h,
                q_0,
                k_0,
                v_0,
                g_0,
                beta_0,
                t,
                i_n,
                i_h,
                T,
                o,
                log_u,
                states,
                o_k,
                o_v,
                m_v,
                m_h,
                H,
                DK,
                DV,
                NATIVE,
                False,
                FMA,
            )
            q_0, k_0, v_0, g_0, beta_0 = q_1, k_1, v_1, g_1, beta_1
            q_1, k_1, v_1, g_1, beta_1 = q_2, k_2, v_2, g_2, beta_2


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
    x_log,
    fold,
    *,
    num_k_heads,
    native,
    store_x,
    block_v,
    stages,
    split_out,
    block_t,
    num_warps,
    prep_warps,
    fma=False,
    chunked=None,
    pdl=False,
    one_launch=False,
    fold_ahead=False,
    fold_next=None,
):
    """gdn_prep_kernel on grid (N, 2·Hk + H, ⌈T / block_t⌉), then gdn_recur_kernel on grid (d_v / BV, N·H).
    Tensors as in the kernels (conv_weight as (C, K)); prep = (q, k, v, g, β) fp32 buffers of the prep kernel's
    output shapes; x_log the log's x (written when store_x); fold = (pend, stash_k,
    stash_g), zero counts when nothing is pending; the unused output of the other mode may be any
    tensor (never touched). chunked (ReplaySSM): chunk_kernel.py's recurrence instead, a dict of
    launch_chunk_recur's chunk_block_v / block_k / num_warps (the fold's counts keep block_v's layout).
    pdl: the recurrence launched as a programmatic dependent of the prep (gdn_verify_triton's docstring).
    fma: the recurrence's d_k sums and state update as fused multiply-adds (gdn_verify_triton's docstring).
    one_launch (not with chunked): both as one kernel instead, one_launch.py (pdl does not apply).
    fold_ahead (sequential walk, stages ≥ 1; neither chunked nor one_launch): the recurrence compiled with its
    fold-ahead programs (FOLD_NEXT), which fold_next = (rec, u, pend, stash_k, stash_g) of the next layer, when
    given, runs: N·H more programs per value slice fold that layer's pending commit. A state keeps one setting
    for all its verifies, with or without a next layer, so that they all run one compiled walk."""
    if one_launch:
        from dflash2.runtime.kernels.gdn_verify.one_launch import launch_one_launch

        launch_one_launch(
            x, conv_state, conv_weight, rec_state, a, b, A_log, dt_bias, o, prep, log_u, states, x_log, fold,
            num_k_heads=num_k_heads, native=native, store_x=store_x, block_v=block_v, block_t=block_t,
            stages=stages, split_out=split_out, num_warps=num_warps, fma=fma,
        )  # fmt: skip
        return
    N, T, _ = x.shape
    H, DK, DV = rec_state.shape[1:]
    KW = conv_weight.shape[1]
    q, k, v, g, beta = prep
    pend, stash_k, stash_g = fold
    gdn_prep_kernel[(N, 2 * num_k_heads + H, triton.cdiv(T, block_t))](
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
        x_log,
        T,
        x.stride(0),
        x.stride(1),
        conv_state.stride(0),
        conv_state.stride(1),
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        x_log.stride(0),
        x_log.stride(1),
        HK=num_k_heads,
        H=H,
        DK=DK,
        DV=DV,
        KW=KW,
        BC=triton.next_power_of_2(max(DK, DV)),
        BT=block_t,
        SQRT_DK=float(DK) ** 0.5,
        STORE_X=store_x,
        PDL=bool(pdl),
        num_warps=prep_warps,
        enable_fp_fusion=False,  # round as the reference does (no fused multiply-adds)
    )
    if chunked:
        from dflash2.runtime.kernels.gdn_verify.chunk_kernel import launch_chunk_recur

        launch_chunk_recur(
            q, k, v, g, beta, rec_state, o, log_u, fold,
            num_k_heads=num_k_heads, block_v=block_v, stages=stages, fma=fma, **chunked,
        )  # fmt: skip
        return
    grid = (triton.cdiv(DV, block_v), N * H)
    if fold_next is None:  # any tensors: no program reads them (no fold-ahead program, or compiled out)
        fold_next = (rec_state, log_u, pend, stash_k, stash_g)
    elif fold_ahead:
        grid = (grid[0], 2 * N * H)
    else:
        raise ValueError("fold_next is run by the fold-ahead programs: it needs fold_ahead")
    gdn_recur_kernel[grid](
        q,
        k,
        v,
        g,
        beta,
        rec_state,
        o,
        log_u,
        states,
        pend,
        stash_k,
        stash_g,
        *fold_next,
        T,
        rec_state.stride(0),
        pend.stride(0),
        N * H,
        HK=num_k_heads,
        H=H,
        DK=DK,
        DV=DV,
        BK=triton.next_power_of_2(DK),
        BV=block_v,
        NATIVE=native,
        FOLD=True,  # always: see gdn_verify_triton (one compiled variant)
        STAGES=stages,
        SPLIT_OUT=split_out,
        FMA=fma,
        PDL=bool(pdl),
        FOLD_NEXT=bool(fold_ahead),
        num_warps=num_warps,
        enable_fp_fusion=False,  # fused multiply-adds only where written (FMA): see _fma_pair, gdn_replay/kernel.py
        **({"launch_pdl": True} if pdl else {}),  # only asked for on CUDA (the interpreter knows no such option)
    )
