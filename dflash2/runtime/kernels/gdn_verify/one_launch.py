"""The GDN verify in one launch: prep and recurrence programs in one grid, synchronised per head.

kernel.py's two kernels, fused by role rather than by code: the programs holding the first ``n_prep``
tickets (below; one per row, head of channels and chunk of BT tokens) run :func:`_prep_chunk` and
announce their rows; the others run :func:`gdn_recur_program`, each waiting only for the prep programs
of its own (row, value head) instead of for the whole prep grid. What the two-kernel form pays at one
row and this one does not: the kernel boundary (the prep grid's drain, the recurrence's launch) and the
grid-wide wait, and the fold of a pending commit starts with the launch instead of when the dependent
launch does.

The synchronisation, in an int32 buffer ``sync`` that is all zeros between launches:

* ``sync[0]`` hands out roles. Every program takes a ticket (an atomic increment) and ticket order, not
  program id, decides its role: the first ``n_prep`` tickets prep. A program that waits therefore waits
  only on programs that already hold a ticket, i.e. are running, so the grid cannot deadlock however the
  hardware schedules it or however few of its programs fit on the GPU at once.
* ``sync[2 + row·H + h]`` counts the prep chunks done for value head h of the row: a q or a k program
  adds 1 to each of its key head's H/Hk value heads, a v program to its own, after every thread's stores
  (a barrier, then one release increment). A recurrence program polls its counter with acquire
  semantics until it reaches 3 · chunks, then reads the rows.
* ``sync[1]`` counts finished recurrence programs; the last one zeroes the buffer for the next launch
  (every prep program has released by then: each is awaited by some recurrence program).

Same arithmetic as the two kernels, so the rounding rules do not change; the prep runs with the
recurrence's warps and its own chunk length (``BT``), which sets the L2 norm's summation order: every
verify of a configuration, one token or a block, must use the same (gdn_verify_triton keeps them fixed).
"""

import torch
import triton
import triton.language as tl

from dflash2.runtime.kernels.gdn_verify.kernel import _prep_chunk, gdn_recur_program


@triton.jit
def gdn_verify_one_launch_kernel(
    x, conv, w, a, b, A_log, dt_bias,  # as gdn_prep_kernel's
    q_buf, k_buf, v_buf, g_buf, beta_buf, x_log,  # the prep's outputs (gdn_prep_kernel's q_out ... x_log)
    rec, o, log_u, states, pend, stash_k, stash_g,  # as gdn_recur_kernel's
    sync,  # (2 + N·H,) int32: tickets, finished recurrence programs, per (row, value head) prep counts
    T, n_prep, n_recur,
    stride_xn, stride_xt, stride_cn, stride_cc, stride_an, stride_at, stride_bn, stride_bt, stride_ln, stride_lt,
    stride_rn, stride_pn,
    HK: tl.constexpr, H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, KW: tl.constexpr,
    BC: tl.constexpr, BT: tl.constexpr, SQRT_DK: tl.constexpr, STORE_X: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, NATIVE: tl.constexpr, STAGES: tl.constexpr, SPLIT_OUT: tl.constexpr,
    FMA: tl.constexpr, BS: tl.constexpr,  # the reset's tile over sync
):  # fmt: skip
    ticket = tl.atomic_add(sync, 1, sem="relaxed", scope="gpu")
    chunks = tl.cdiv(T, BT)
    if ticket < n_prep:
        per_row = (2 * HK + H) * chunks
        i_n = (ticket // per_row).to(tl.int64)
        j = (ticket % per_row) // chunks  # the head of channels: gdn_prep_kernel's program_id(1)
        t0 = (ticket % chunks) * BT
        _prep_chunk(
            x, conv, w, a, b, A_log, dt_bias, q_buf, k_buf, v_buf, g_buf, beta_buf, x_log, T,
            stride_xn, stride_xt, stride_cn, stride_cc, stride_an, stride_at, stride_bn, stride_bt, stride_ln,
            stride_lt, i_n, j, t0, HK, H, DK, DV, KW, BC, BT, SQRT_DK, STORE_X,
        )  # fmt: skip
        tl.debug_barrier()  # every thread's rows stored before the release below
        ready_row = sync + 2 + i_n * H
        if j < 2 * HK:  # a q or k head: every value head of its key head reads it
            i_hk = tl.where(j < HK, j, j - HK)
            for r in tl.static_range(H // HK):
                tl.atomic_add(ready_row + i_hk * (H // HK) + r, 1, sem="release", scope="gpu")
        else:
            tl.atomic_add(ready_row + (j - 2 * HK), 1, sem="release", scope="gpu")
    else:
        NV = (DV + BV - 1) // BV
        i_r = ticket - n_prep
        i_nh = i_r // NV
        gdn_recur_program(
            q_buf, k_buf, v_buf, g_buf, beta_buf, rec, o, log_u, states, pend, stash_k, stash_g, T, stride_rn,
            stride_pn, i_r % NV, i_nh, sync + 2 + i_nh, 3 * chunks, HK, H, DK, DV, BK, BV, NATIVE, True, STAGES,
            SPLIT_OUT, FMA, 2,
        )  # fmt: skip
        finished = tl.atomic_add(sync + 1, 1, sem="acq_rel", scope="gpu")
        if finished == n_recur - 1:  # the last program: nobody reads the counters any more
            size = 2 + n_recur // NV  # N·H counters
            for s0 in range(0, size, BS):
                o_s = s0 + tl.arange(0, BS)
                tl.store(sync + o_s, tl.zeros([BS], dtype=tl.int32), mask=o_s < size)


_SYNC: dict[tuple, torch.Tensor] = {}


def sync_buffer(device: torch.device, counters: int) -> torch.Tensor:
    """A zeroed int32 buffer of at least 2 + ``counters`` entries for the one-launch kernel, which leaves
    it zeroed. Kept per (device, power-of-two size) and never freed, so a CUDA graph that captured one keeps
    a valid address; one made during a capture is not kept (its zeroing runs only in that graph's replays).
    Verifies that run concurrently on two streams of one device must not share it (they would be handed
    each other's tickets): this runtime verifies on one stream at a time."""
    size = triton.next_power_of_2(2 + counters)
    key = (device.type, device.index, size)
    buf = _SYNC.get(key)
    if buf is None:
        buf = torch.zeros(size, dtype=torch.int32, device=device)
        if not (buf.is_cuda and torch.cuda.is_current_stream_capturing()):
            _SYNC[key] = buf
    return buf


def launch_one_launch(
    x, conv_state, conv_weight, rec_state, a, b, A_log, dt_bias, o, prep, log_u, states, x_log, fold,
    *, num_k_heads, native, store_x, block_v, block_t, stages, split_out, num_warps, fma=False,
):  # fmt: skip
    """launch_verify's arguments (kernel.py), one kernel: grid n_prep + n_recur programs of num_warps warps,
    n_prep = N · (2·Hk + H) · ceil(T / block_t), n_recur = N · H · ceil(d_v / block_v)."""
    N, T, _ = x.shape
    H, DK, DV = rec_state.shape[1:]
    KW = conv_weight.shape[1]
    q, k, v, g, beta = prep
    pend, stash_k, stash_g = fold
    n_prep = N * (2 * num_k_heads + H) * triton.cdiv(T, block_t)
    n_recur = N * H * triton.cdiv(DV, block_v)
    sync = sync_buffer(x.device, N * H)
    gdn_verify_one_launch_kernel[(n_prep + n_recur,)](
        x, conv_state, conv_weight, a, b, A_log, dt_bias, q, k, v, g, beta, x_log,
        rec_state, o, log_u, states, pend, stash_k, stash_g, sync,
        T, n_prep, n_recur,
        x.stride(0), x.stride(1), conv_state.stride(0), conv_state.stride(1), a.stride(0), a.stride(1),
        b.stride(0), b.stride(1), x_log.stride(0), x_log.stride(1), rec_state.stride(0), pend.stride(0),
        HK=num_k_heads, H=H, DK=DK, DV=DV, KW=KW, BC=triton.next_power_of_2(max(DK, DV)), BT=block_t,
        SQRT_DK=float(DK) ** 0.5, STORE_X=store_x, BK=triton.next_power_of_2(DK), BV=block_v, NATIVE=native,
        STAGES=stages, SPLIT_OUT=split_out, FMA=fma, BS=256,
        num_warps=num_warps,
        enable_fp_fusion=False,  # both halves round as their two-kernel forms do (kernel.py)
    )  # fmt: skip
