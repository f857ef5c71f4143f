"""GDN verify: T block outputs per row from the untouched state, logging what the commit needs.

:func:`gdn_verify_triton` (Triton, kernel.py) and its plain-PyTorch twin
:func:`~.reference.gdn_verify_reference` take the same arguments and return the same
(o, GDNLog); with ``chunked=True`` the recurrence is chunk_kernel.py's, twin
:func:`~.chunked_reference.gdn_verify_chunked_reference`. docs/ARCHITECTURE.md §5.5.
"""

from __future__ import annotations

import torch

from dflash2.runtime.kernels.gdn_log import (
    GDNLog,
    NextLayerFold,
    PendingFold,
    default_block_v,
    default_fma,
    new_log,
    recur_programs,
)

PREP_TOKENS = 16  # the prep kernel's tokens per chunk (see gdn_verify_triton)
NARROW_PREP_TOKENS = 4  # occupancy_block_t's choice when a block's prep would leave SMs idle
ONE_LAUNCH_PREP_TOKENS = 4  # one_launch: tokens per prep program (one warp each; see gdn_verify_triton)
PDL_MAX_ROWS = 1  # pdl=None turns pdl on up to this many rows (see gdn_verify_triton)
FOLD_AHEAD_MAX_ROWS = 1  # GDNState turns fold_ahead on up to this many rows on CUDA (see gdn_verify_triton)
DEFAULT_STAGES = 3  # ReplaySSM's recurrence: software-pipeline stages of its token loops (see gdn_verify_triton)
# the chunked recurrence's warps and d_k slice (chunk_kernel.py: 85 registers, no spills, compiled offline
# for sm_90a at the 9B shape; on the H200 still slower than the sequential walk at batch 1, docs/BENCHMARKS.md
# stops 16 and 24). Here, not imported from chunk_kernel.py: that module needs Triton
DEFAULT_CHUNK_WARPS = 4
DEFAULT_CHUNK_BLOCK_K = 16


def occupancy_block_t(batch: int, num_k_heads: int, num_v_heads: int, programs_wanted: int) -> int:
    """The prep kernel's tokens per program for a state of ``batch`` rows: PREP_TOKENS, or NARROW_PREP_TOKENS
    when a block verify's prep at PREP_TOKENS would run fewer than ``programs_wanted`` programs
    (batch · (2·Hk + H), one per row and head; GDNState passes the GPU's SM count). Why: at a small batch the
    prep is one latency chain of 16 tokens per head on few SMs, and the recurrence waits for it; four times as
    many programs of 4 tokens finish sooner. The L2 norm's summation order follows the tile's shape, so every
    verify of one state (decoding and blocks, both GDN modes) must run one chunk size; GDNState resolves it
    once, from its batch size. H200, 9B GDN shape (64 prep programs per row), block 16: docs/BENCHMARKS.md,
    stop 24."""
    if batch * (2 * num_k_heads + num_v_heads) < programs_wanted:
        return NARROW_PREP_TOKENS
    return PREP_TOKENS


def gdn_verify_triton(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    conv_weight: torch.Tensor,
    rec_state: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    num_k_heads: int,
    *,
    native: bool = False,
    out: GDNLog | None = None,
    fold: PendingFold | None = None,
    block_v: int | None = None,
    block_t: int | None = None,
    num_warps: int | None = None,
    prep_warps: int | None = None,
    stages: int | None = None,
    split_out: bool = False,
    fma: bool | None = None,
    pdl: bool | None = None,
    one_launch: bool = False,
    fold_ahead: bool = False,
    fold_next: NextLayerFold | None = None,
    chunked: bool = False,
    chunk_warps: int | None = None,
    chunk_block_v: int | None = None,
    chunk_block_k: int | None = None,
) -> tuple[torch.Tensor, GDNLog]:
    """Outputs of the T block tokens of every row from the untouched states, plus the commit log.

        x (N, T, C) pre-conv q|k|v projections (model dtype), C = 2·Hk·d_k + H·d_v;
        conv_state (N, C, K-1) model dtype; conv_weight (C, 1, K); rec_state (N, H, d_k, d_v) fp32;
        a, b (N, T, H) the in_proj_a / in_proj_b outputs; A_log, dt_bias (H,); num_k_heads Hk.
        Both states are only read (but see ``fold``). Returns o (N, T, H, d_v) in x's dtype and a
        :class:`GDNLog`: ReplaySSM k (N, T, Hk, d_k), u (N, T, H, d_v), g (N, T, H) fp32; native: states
        (N, T, H, d_k, d_v) fp32. The log keeps x itself (no copy), or, with ``out`` (a log of that
        layout, e.g. GDNState's reserved one for CUDA graphs), is written there, x stored by the kernel.

        fold (ReplaySSM, needs ``out``): a deferred commit of the previous verify, whose log ``out``
        still holds (same T), and which gdn_defer_commit_triton has applied to everything but the
        recurrent state: the conv window is rolled and the pending tokens' k / g are in fold.k / fold.g.
        Before verifying, those first fold.n[r] tokens (fold.k, fold.g, out.u) are folded into row r's
        rec_state *in place* — bit for bit what gdn_replay_triton(conv_state, rec_state, log, n,
        roll_conv=False) leaves for a log of those k / g and out.u — and the new block is verified from
        there; the counts are zeroed (a second call folds nothing). fold.n must have
        recur_programs(H, d_v, block_v) columns (the recurrence kernel's programs per row).
        block_v / block_t / num_warps / prep_warps: tile width over d_v, tokens per prep program (one
        program per chunk of block_t tokens), warps per recurrence / prep program. stages: the
        recurrence's token loops prefetch by hand two tokens ahead
        (0, native's default) or go through Triton's software pipeline of that many stages (ReplaySSM's
        default, DEFAULT_STAGES); the arithmetic, and so the rounding, is the same. split_out (with
        stages ≥ 1): o_t = hᵀq + (k·q) u_t, whose d_k sum no longer waits for u_t (outputs round
        differently; the state and the log do not).
        fma (sequential walk and fold; None = on, except under Triton's interpreter: gdn_log.default_fma):
        the recurrence's d_k sums hᵀk, hᵀq as chains of fused multiply-adds instead of a multiply and an add
        per element, and the state update h + k uᵀ as one (kernel.py's _dot_rows, _fold_token). Written out,
        not left to the compiler's contraction, which can round differently between specialisations of the
        kernel; the commit kernel must fold with the same setting (GDNState passes it; gdn_replay_triton's
        default is the same). Off: a multiply and an add per element, as before (outputs differ at fp32
        rounding). H200 figures: docs/BENCHMARKS.md, stops 23–24.
        pdl (CUDA, Hopper on; sequential walk only): the recurrence kernel is launched as a programmatic
    dependent of the prep kernel (``launch_pdl``), so it starts while the prep runs, loads its state tile, folds
    a pending commit, and waits (``gdc_wait``) only before its first read
    of the prep's outputs: the kernel boundary's drain and launch, the state load and the fold overlap the prep
    (same values: nothing it reads early is written by the prep). None (the default): on for ReplaySSM's
    sequential walk at one row (PDL_MAX_ROWS) on a GPU of compute capability ≥ 9; off for native, whose
    per-token state stores it slowed, and for more rows, where it did not pay (H200, per GDN layer, 3 of 16
    tokens accepted: 9B shape batch 1 ReplaySSM 18.0 -> 15.4 µs, native 23.6 -> 26.6; batch 8 53.2 -> 53.9;
    the small pair's shape, block 8, batch 1 10.3 -> 8.7, batch 8 13.7 -> 16.2; docs/BENCHMARKS.md).
    one_launch (sequential walk only; pdl then does not apply): prep and recurrence as one kernel whose
    recurrence programs wait, each for its own head's prep programs, on counters in global memory
    (one_launch.py): no kernel boundary and no grid-wide wait between them. Its prep programs take
    ONE_LAUNCH_PREP_TOKENS tokens each (block_t overrides) with the recurrence's warps, which changes the
    L2 norm's summation order against the two-kernel form: keep one setting for every verify of a model
    (GDNState does), or decoding and block verifies round differently. Off by default: on the H200 at the
    9B shape it was slower at batch 1 (ReplaySSM 0.6–1.1 µs, native ~5 µs per layer) and, in one run,
    faster for ReplaySSM at batch 8 (50.1 against 53.0 µs; docs/BENCHMARKS.md, stop 22).
    fold_ahead (ReplaySSM's sequential walk with stages ≥ 1; not with one_launch or chunked): the recurrence
    kernel is compiled with a second kind of program, which folds *another* layer's pending commit ahead of
    its verify: fold_next (a :class:`NextLayerFold`: that layer's state, log u, counts and stash, all of this
    layer's shapes and block length) adds N·H programs per value slice, each of which folds one tile of it
    exactly as that layer's own verify would (same operations, same order) and zeroes its count, so that
    verify finds nothing left to fold. Why: at one row the walk's 256 one-warp programs leave half the
    H200's schedulers idle, and a layer's fold of n pending tokens sits in its verify's critical path when
    it outlasts the prep; folded during the previous layer's walk it costs no time there (GDNState passes
    the next GDN layer; its first layer folds itself). Keep one fold_ahead setting for every verify of a
    state, fold_next or not (GDNState does): the walk is then one compiled kernel.
    All are tuning knobs (dflash2/runtime/bench_gdn.py).

        chunked (ReplaySSM; ignored by native, whose per-token states are the sequential walk's output):
        after the unchanged exact fold of the pending tokens, the block's o and u come from matrix
        products over chunks of 16 tokens and a 16 × 16 triangular solve (chunk_kernel.py, twin
        chunked_reference.py) instead of T dependent steps, each waiting for a d_k-long reduction — the
        chain that makes the batch-1 recurrence latency-bound. Same values up to fp32 rounding: o and the
        logged u differ from the sequential walk's (and from single-token decoding's) at rounding level;
        the log's layout and the next verify's fold do not change. Any head dims and block_v (tiles are
        padded to 16); split_out does not apply. Its own tuning knobs (num_warps / block_v stay the
        sequential walk's, which a one-token verify still runs, and the fold's count layout):
        chunk_warps (default 4), chunk_block_v (value columns per program, a multiple of block_v: each
        program folds and zeroes that many block_v slices' counts; default block_v) and chunk_block_k
        (d_k rows per slice of the state its products stream, rounded up to a power of two ≥ 16; default 16).
    """
    N, T, C = x.shape
    H, dk, dv = rec_state.shape[1:]
    K = conv_weight.shape[-1]
    if H % num_k_heads or 2 * num_k_heads * dk + H * dv != C:
        raise ValueError(f"x has {C} channels; expected 2·{num_k_heads}·{dk} + {H}·{dv} with Hk dividing H")
    if conv_state.shape != (N, C, K - 1) or a.shape != (N, T, H) or b.shape != (N, T, H):
        raise ValueError(f"shapes: conv_state {tuple(conv_state.shape)}, a {tuple(a.shape)}, b {tuple(b.shape)}")
    if rec_state.dtype != torch.float32:
        raise ValueError(f"the recurrent state must be fp32, got {rec_state.dtype}")
    # the kernel indexes channels, conv columns and (H, d_k, d_v) as contiguous
    x, a, b = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, a, b))
    if conv_state.stride(-1) != 1 or rec_state[0].stride() != (dk * dv, dv, 1):
        raise ValueError("conv_state needs contiguous columns and rec_state contiguous (H, d_k, d_v) per row")
    bv = block_v or default_block_v(dv)
    cbv = chunk_block_v or bv
    if chunked and cbv % bv:  # an argument error, before the device check: the same message on every device
        raise ValueError(f"chunk_block_v {cbv} must be a multiple of block_v {bv} (the pending counts' slices)")
    import triton  # here, not at import: the twins and GDNState's reference mode need no Triton

    from dflash2.runtime.kernels.gdn_verify.kernel import launch_verify
    from dflash2.runtime.kernels.triton_util import check_device, default_warps

    check_device(x, rec_state)
    o = torch.empty(N, T, H, dv, dtype=x.dtype, device=x.device)
    if out is None:
        dims = dict(num_k_heads=num_k_heads, num_v_heads=H, head_k_dim=dk, head_v_dim=dv)
        log = new_log(x, **dims, native=native)
    else:
        log = out
        if log.x.shape != x.shape or log.x.stride(-1) != 1:
            raise ValueError(f"out holds x of {tuple(log.x.shape)} (channels contiguous); x is {tuple(x.shape)}")
    if log.native != native:
        raise ValueError(f"out is a {'native' if log.native else 'ReplaySSM'} log; this verify writes the other")
    if fold is not None:
        if out is None or native:
            raise ValueError("a pending fold is folded from the ReplaySSM log it was logged in: pass it as out")
        if fold.n.shape != (N, recur_programs(H, dv, bv)) or fold.n.stride(-1) != 1:
            raise ValueError(f"fold.n {tuple(fold.n.shape)}: expected ({N}, {recur_programs(H, dv, bv)}) contiguous")
        if fold.k.shape != log.k.shape or fold.g.shape != log.g.shape:
            raise ValueError("fold.k / fold.g must have the log's k / g shapes")
    if fold_next is not None:
        if not fold_ahead or native or one_launch or chunked or stages == 0 or fold is None:
            raise ValueError(
                "fold_next is folded by ReplaySSM's fold-ahead programs: fold_ahead, the sequential walk, and this "
                "layer's own fold (reserved logs)"
            )
        # the kernel indexes the next layer's tensors with this layer's strides
        nf = fold_next.fold
        if fold_next.rec.shape != rec_state.shape or fold_next.rec.stride() != rec_state.stride():
            raise ValueError(f"fold_next.rec {tuple(fold_next.rec.shape)}: expected this layer's state layout")
        if fold_next.u.shape != log.u.shape or fold_next.u.stride() != log.u.stride():
            raise ValueError(f"fold_next.u {tuple(fold_next.u.shape)}: expected the log's u, {tuple(log.u.shape)}")
        if nf.n.shape != fold.n.shape or nf.n.stride() != fold.n.stride():
            raise ValueError(f"fold_next's counts {tuple(nf.n.shape)}: expected this layer's {tuple(fold.n.shape)}")
        if (nf.k.shape, nf.k.stride(), nf.g.shape, nf.g.stride()) != (
            fold.k.shape,
            fold.k.stride(),
            fold.g.shape,
            fold.g.stride(),
        ):
            raise ValueError("fold_next's stash must have this layer's stash layout")
    if T == 0 or N == 0:
        return o, log
    f32 = dict(dtype=torch.float32, device=x.device)
    # the prep kernel's rows; ReplaySSM's k and g go straight into the log
    k = torch.empty(N, T, num_k_heads, dk, **f32) if native else log.k
    g = torch.empty(N, T, H, **f32) if native else log.g
    prep = (
        torch.empty(N, T, num_k_heads, dk, **f32),
        k,
        torch.empty(N, T, H, dv, **f32),
        g,
        torch.empty(N, T, H, **f32),
    )
    # the other mode's output is never touched: any tensor will do
    u, states = (log.states, log.states) if native else (log.u, log.u)
    bk = triton.next_power_of_2(dk)
    # One compiled variant for every verify (see _no_fold): the q / k L2 norm and the recurrence's dot
    # products are cross-thread sums whose order follows the layout the compiler picks, and that
    # layout depends on the tile shape and on the code around it. On the H200 a (1, d) tile (single-
    # token decode) and a (16, d) tile (a block) rounded the norm differently, and so did the kernels
    # with and without the fold's extra loads. Same chunk shape, same code: every token is normalised
    # and folded bit for bit as decoding does it (the exact fold); the masked rows move no bytes.
    one_launch = bool(one_launch) and not (chunked and not native)  # chunked: its own form, any T
    bt = block_t or (ONE_LAUNCH_PREP_TOKENS if one_launch else PREP_TOKENS)
    if stages is None:
        # ReplaySSM: the pipelined loops (bit for bit the hand prefetch's results; H200, 9B shape: 25.9 ->
        # 22.9 µs per layer at batch 1, docs/BENCHMARKS.md). Native keeps the hand prefetch: at batch 64
        # its per-token state stores made the pipelined loop slower (849 -> 933 µs)
        stages = 0 if native else DEFAULT_STAGES
    if fold is None:
        fold = _no_fold(N, recur_programs(H, dv, bv), prep[1], prep[3])
    launch_verify(
        x,
        conv_state,
        conv_weight.reshape(C, K).contiguous(),
        rec_state,
        a,
        b,
        A_log.contiguous(),
        dt_bias.contiguous(),
        o,
        prep,
        u,
        states,
        log.x,
        (fold.n, fold.k, fold.g),
        num_k_heads=num_k_heads,
        native=native,
        store_x=out is not None,
        block_v=bv,
        block_t=bt,
        stages=stages,
        split_out=bool(split_out) and stages > 0,
        fma=default_fma(fma),
        pdl=(_pdl_by_default(x.device, N, native, chunked and T > 1) if pdl is None else bool(pdl))
        and x.is_cuda
        and not one_launch,
        one_launch=one_launch,
        fold_ahead=bool(fold_ahead) and not native and not one_launch and not (chunked and T > 1) and stages > 0,
        fold_next=(
            None
            if fold_next is None
            else (fold_next.rec, fold_next.u, fold_next.fold.n, fold_next.fold.k, fold_next.fold.g)
        ),
        # one token: the sequential walk is the cheaper one
        chunked=(
            dict(
                chunk_block_v=cbv,
                block_k=chunk_block_k or DEFAULT_CHUNK_BLOCK_K,
                num_warps=chunk_warps or DEFAULT_CHUNK_WARPS,
            )
            if chunked and not native and T > 1
            else None
        ),
        # registers: the recurrence's state tile (≤ ~64 fp32 per thread). The prep's (BT, d) conv tiles
        # are latency-bound at batch 1 (64 programs at the 9B shape for 132 SMs): 4 warps split each
        # program's loads four ways at no cost in occupancy; a first guess for the sweep to tune
        num_warps=num_warps or default_warps(bk * bv),
        prep_warps=prep_warps or 4,
    )
    return o, log


def _pdl_by_default(device: torch.device, rows: int, native: bool, chunked: bool) -> bool:
    """pdl=None: on for ReplaySSM's sequential walk of at most PDL_MAX_ROWS rows where griddepcontrol exists
    (CUDA, compute capability ≥ 9); the interpreter (CPU tensors) has no grid dependency control."""
    if native or chunked or rows > PDL_MAX_ROWS or device.type != "cuda":
        return False
    import triton.language as tl

    # older Triton (the package allows 3.0 on) has no grid dependency control
    return torch.cuda.get_device_capability(device)[0] >= 9 and hasattr(tl.extra.cuda, "gdc_wait")


_NO_PENDING: dict[tuple, torch.Tensor] = {}


def _no_fold(N: int, programs: int, k: torch.Tensor, g: torch.Tensor) -> PendingFold:
    """A fold of nothing, so that verifies without a pending commit run the fold's compiled variant too.

    Counts (N, programs) int32 zeros, kept per (device, shape) so that CUDA graphs capture a fixed
    address; no kernel writes a zero count (a program stores 0 only after folding n > 0). k / g stand
    in for the stash: with n = 0 nothing is folded; they are large enough for the two rows the hand-prefetch
    loop loads before it reads n (kernel.py), values it never uses (with pdl those loads may even overlap the
    prep kernel's writes of these very tensors: harmless, as they are discarded)."""
    key = (k.device, N, programs)
    zeros = _NO_PENDING.get(key)
    if zeros is None:
        zeros = torch.zeros(N, programs, dtype=torch.int32, device=k.device)
        # made inside a graph capture, its memset runs only in that graph's replays: not for sharing
        if not (k.is_cuda and torch.cuda.is_current_stream_capturing()):
            _NO_PENDING[key] = zeros
    return PendingFold(zeros, k, g)
