"""Gated DeltaNet states with verify / commit (ReplaySSM, docs/ARCHITECTURE.md §5).

A GDN layer carries two states per row: the short causal conv's window
(the last K-1 pre-conv inputs) and the recurrent state h (H, d_k, d_v) in fp32.
Per token, after the conv + SiLU and the q/k L2 norms (HF / fla semantics):

    h ← exp(g_t) · h                 g_t = -exp(A_log) · softplus(a_t + dt_bias)  (log decay, fp32)
    u_t = β_t · (v_t − hᵀ k_t)       β_t = sigmoid(b_t)
    h ← h + k_t u_tᵀ
    o_t = hᵀ q_t / sqrt(d_k)

Speculative decoding verifies T tokens per row and keeps only n[r] of them, so the
state must end up as if exactly n[r] tokens had been fed. Instead of writing T
states and picking one, :meth:`GDNState.verify` computes the T outputs from the
*untouched* state and logs (k_t, u_t, g_t) and the T pre-conv inputs;
:meth:`GDNState.commit` folds the first n[r] logged tokens into the state with the
same two updates in the same order (the "exact fold": u_t already holds the
correction term, so replay needs no hᵀk and is not sequential in anything but h),
and the new conv window is the last K-1 columns of ``[old window | x_1 .. x_n]``.

Three implementations of the same two steps, chosen by ``mode`` (§5.5), plus ``"auto"``:

* ``"auto"`` (the default of runtime models): ``"replay"`` for states on a CUDA device (with Triton
  importable), ``"reference"`` elsewhere: on CPU tensors the kernels only run in Triton's
  interpreter, which is far slower than the plain loop (:func:`resolve_gdn_mode`);
* ``"reference"``: plain PyTorch (kernels/gdn_verify/reference.py, kernels/gdn_replay/reference.py;
  a Python loop over T), the oracle the kernels are tested against; runs anywhere;
* ``"replay"``: the Triton ReplaySSM kernels (verify fused with conv + SiLU, L2 norms and gates;
  commit = exact fold + conv roll; with reserved logs the fold is *deferred* into the next verify: below);
* ``"native"``: the native-rollback ablation: the verify kernel stores the full state after every
  position and the commit copies row r's state at n[r]. Forwards longer than ``native_max_tokens``
  (prefill) log for a fold instead: T full states of a long prompt would not fit.

Triton modes on CPU tensors need Triton's interpreter (kernels/triton_util.py).

**Deferred commit (``"replay"`` with reserved logs, i.e. the engine's decode steps).** A commit
does not fold: one launch for all layers (kernels/gdn_replay/defer_kernel.py) rolls each conv
window by n, copies the accepted tokens' logged k and g to a per-layer stash and records n (device
tensors at fixed addresses); the next verify of each layer folds those n tokens into the state
tile it holds in registers anyway, writes the state back once, and then verifies its block
(kernels/gdn_verify/kernel.py). Why: at batch 1 the fold was a third latency-bound launch per
layer that re-read and re-wrote the whole state (docs/BENCHMARKS.md, issue 14); and with the
window and the stash settled before the verify, nothing the fold reads is written during it, so
the fold can overlap the verify's prep kernel (``pdl``). The consequence: between a commit and the
next verify, ``rec`` lags behind by the pending fold. Whatever reads it there must call
:meth:`GDNState.flush` first (it folds with the commit kernel, bit for bit what the next verify
would have done; idempotent); the engine does at the end of every generation, and ``reset`` drops
a pending fold. Unreserved logs (ad-hoc calls) and ``commit(n, defer=False)`` (prefill) are folded
at once, as in the other modes: a fresh log has no fixed address a captured verify could find it
at, and a prefill's first decode verify may be a captured graph of another block length.

Shapes: N rows, T block tokens, C conv channels (2·Hk·d_k + H·d_v), K conv kernel,
Hk key heads, H value heads (Hk divides H), L_g GDN layers.
"""

from __future__ import annotations

import torch

from dflash2.runtime.kernels.gdn_log import (
    GDNLog,
    NextLayerFold,
    PendingFold,
    default_block_v,
    new_log,
    occupancy_block_v,
    recur_programs,
)
from dflash2.runtime.kernels.gdn_replay.reference import gdn_replay
from dflash2.runtime.kernels.gdn_verify import FOLD_AHEAD_MAX_ROWS, occupancy_block_t
from dflash2.runtime.kernels.gdn_verify.reference import gdn_gates, gdn_verify

GDN_MODES = ("reference", "replay", "native")  # what a state runs
GDN_MODE_CHOICES = ("auto", *GDN_MODES)  # what callers may ask for
# Native mode stores per-position states only for verifies of at most this many tokens (a block);
# longer forwards (prefill) log for a fold.
NATIVE_MAX_TOKENS = 16

__all__ = [
    "GDN_MODES",
    "GDN_MODE_CHOICES",
    "NATIVE_MAX_TOKENS",
    "GDNLog",
    "GDNState",
    "PendingFold",
    "gdn_gates",
    "gdn_replay",
    "gdn_verify",
    "resolve_gdn_mode",
]


def resolve_gdn_mode(mode: str, device) -> str:
    """The concrete mode a state on ``device`` runs for ``mode``; ValueError for an unknown one.

    ``"auto"`` is ``"replay"`` on CUDA when Triton imports and ``"reference"`` otherwise: the Triton
    kernels run on CPU tensors only in the interpreter (seconds per verify), and the plain loop is the
    one implementation that needs nothing. Explicit modes are returned as they are.
    """
    if mode not in GDN_MODE_CHOICES:
        raise ValueError(f"GDN mode {mode!r}: expected one of {GDN_MODE_CHOICES}")
    if mode != "auto":
        return mode
    from dflash2.runtime.kernels import available

    return "replay" if torch.device(device).type == "cuda" and available() else "reference"


class GDNState:
    """Conv + recurrent states of all GDN layers of a target, with verify / commit.

    conv: (L_g, N, C, K-1) model dtype; rec: (L_g, N, H, d_k, d_v) fp32. Both are
    preallocated and updated in place (static addresses, CUDA-graph friendly); zeros
    = the empty prefix, as HF starts. ``verify(slot, ...)`` is called once per layer
    per forward and keeps that layer's log until ``commit(n)`` consumes all of them (in replay mode
    with reserved logs the commit is deferred into the next verify: module docstring, :meth:`flush`).
    mode: 'reference' | 'replay' | 'native', or 'auto' (by the device: module docstring); kernel_options: block_v /
    block_t / num_warps / prep_warps / stages / split_out / fma / pdl / fold_ahead / chunked / chunk_warps /
    chunk_block_v / chunk_block_k, gdn_verify_triton's keywords (tuning; ``chunked=True``: ReplaySSM's verify
    computes the block with matrix products instead of a serial walk, equal to fp32 rounding, §5.5, the chunk_*
    knobs its tile and warps;
    the commit kernel takes only block_v / num_warps / fma; block_v and block_t left out on CUDA =
    :func:`occupancy_block_v` and :func:`occupancy_block_t` at this batch size and the GPU's SM count, resolved
    here into kernel_options; fold_ahead left out = on for ReplaySSM's walk on CUDA at up to FOLD_AHEAD_MAX_ROWS
    rows, resolved here into ``fold_ahead``: each layer's verify then folds the next GDN layer's pending
    commit); defer: whether replay mode defers commits of reserved logs (default True; False commits with the
    fold kernel at once, the layout before the deferred commit, for comparisons).
    """

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        *,
        conv_dim: int,
        conv_kernel: int,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        mode: str = "reference",
        native_max_tokens: int = NATIVE_MAX_TOKENS,
        kernel_options: dict | None = None,
        defer: bool = True,
    ):
        mode = resolve_gdn_mode(mode, device)
        self.conv = torch.zeros(num_layers, batch_size, conv_dim, conv_kernel - 1, dtype=dtype, device=device)
        self.rec = torch.zeros(
            num_layers, batch_size, num_v_heads, head_k_dim, head_v_dim, dtype=torch.float32, device=device
        )
        self.num_k_heads, self.head_k_dim = num_k_heads, head_k_dim
        self.mode, self.native_max_tokens = mode, native_max_tokens
        self.kernel_options = dict(kernel_options or {})
        if (
            mode in ("replay", "native")
            and "block_v" not in self.kernel_options
            and torch.device(device).type == "cuda"
        ):
            # at a small batch: narrower value slices, so that the recurrence's programs fill the SMs
            sms = torch.cuda.get_device_properties(torch.device(device)).multi_processor_count
            self.kernel_options["block_v"] = occupancy_block_v(batch_size, num_v_heads, head_v_dim, sms)
            if "block_t" not in self.kernel_options and not self.kernel_options.get("one_launch"):
                # and shorter prep chunks when a block's prep would run fewer programs than SMs; once per state,
                # so that all its verifies round alike (occupancy_block_t). one_launch picks its own
                self.kernel_options["block_t"] = occupancy_block_t(batch_size, num_k_heads, num_v_heads, sms)
            if self.kernel_options.get("chunked") and "chunk_block_v" not in self.kernel_options:
                # the chunked recurrence keeps its own tile (its chunk_block_v defaults to block_v, and a narrow
                # one pads each program's 16-wide tile and repeats the per-program work the wide tile amortises)
                self.kernel_options["chunk_block_v"] = default_block_v(head_v_dim)
        self.fold_ahead = self._fold_ahead_setting(mode, batch_size, device)
        self.logs: list[GDNLog | None] = [None] * num_layers
        self._static: dict[int, list[GDNLog]] = {}  # T -> per-layer logs at fixed addresses (reserve)
        self.defer = bool(defer)
        # The deferred commit (replay mode, reserved logs), per reserved T, at fixed addresses: the pending
        # counts (L_g, N, P) int32, one per program of the verify's recurrence kernel, and the (k, g) stash of
        # the pending tokens (L_g, N, T, ...), which the commit fills for every layer. Per T because a pending fold can
        # only be folded from the log of its own length, and a flush must know which log that is even when
        # CUDA graphs replayed the commits (no Python runs then).
        self._pend: dict[int, torch.Tensor] = {}
        self._stash: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._stacked: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # T -> the logs' (x, k, g)
        # Host-side hints of what may be pending: the T of the last deferred commit made in Python (exact
        # for eager use), and every T whose commit was captured into a CUDA graph (its replays defer
        # commits no Python sees: flush() always folds those T's counts, which are 0 if nothing is pending).
        self._deferred: int | None = None
        self._captured: set[int] = set()

    def options_ran(self) -> dict:
        """kernel_options as the verifies run them: the given and resolved ones, plus ``fold_ahead: True`` where
        this state folds ahead (for records: results.json, the bench's rows)."""
        return dict(self.kernel_options, **({"fold_ahead": True} if self.fold_ahead else {}))

    def _fold_ahead_setting(self, mode: str, batch_size: int, device) -> bool:
        """The verifies' fold_ahead (kernel_options' if given), resolved once per state, so that every verify
        runs one compiled walk: else on for ReplaySSM's sequential walk on CUDA at up to FOLD_AHEAD_MAX_ROWS rows.
        Off where there is no such walk (native, one_launch, chunked, the hand-prefetch loop of stages 0). Why one
        row: there the walk leaves most schedulers idle; from two rows on the fold-ahead programs would share
        schedulers with the walk, and they read and write every state tile once more (docs/BENCHMARKS.md)."""
        o = self.kernel_options
        if mode != "replay" or o.get("one_launch") or o.get("chunked") or o.get("stages") == 0:
            return False
        asked = o.get("fold_ahead")
        if asked is not None:
            return bool(asked)
        return torch.device(device).type == "cuda" and batch_size <= FOLD_AHEAD_MAX_ROWS

    def _native(self, T: int) -> bool:
        """Whether a T-token verify stores per-position states (native mode, short enough)."""
        return self.mode == "native" and self.native_max_tokens >= T

    def reserve(self, T: int) -> None:
        """Preallocate the logs of T-token verifies: later verifies of T tokens write into them.

        Why: a captured verify graph and a captured commit graph must meet at the same addresses,
        whichever verify graph (one per attended-length bucket) ran last. (Native mode reserves the
        T per-position states: that memory is the ablation's cost.)
        """
        if T in self._static:
            return
        L, N, C = self.conv.shape[:3]
        H, dk, dv = self.rec.shape[2:]
        xs = torch.zeros(L, N, T, C, dtype=self.conv.dtype, device=self.conv.device)
        if self._native(T):
            dims = dict(num_k_heads=self.num_k_heads, num_v_heads=H, head_k_dim=dk, head_v_dim=dv)
            self._static[T] = [new_log(xs[i], **dims, native=True, alloc=torch.zeros) for i in range(L)]
            return
        # ReplaySSM: each field stacked over the layers, so that the deferred commit treats all layers in
        # one launch; the per-layer logs are views
        f32 = dict(dtype=torch.float32, device=self.rec.device)
        ks, us, gs = (torch.zeros(L, N, T, *s, **f32) for s in ((self.num_k_heads, dk), (H, dv), (H,)))
        self._static[T] = [GDNLog(x=xs[i], k=ks[i], u=us[i], g=gs[i]) for i in range(L)]
        self._stacked[T] = (xs, ks, gs)
        if self.mode == "replay":  # the deferred commit's counts and stash, at fixed addresses too
            self._stash[T] = (torch.zeros_like(ks), torch.zeros_like(gs))
            P = recur_programs(H, dv, self.kernel_options.get("block_v"))
            self._pend[T] = torch.zeros(L, N, P, dtype=torch.int32, device=self.rec.device)

    def use_static(self, T: int) -> None:
        """Point the logs a commit folds at the reserved T-token logs (what the last T-token verify wrote)."""
        self.logs = list(self._static[T])

    def reset(self) -> None:
        """Empty prefix for every row (zero states), as a new generation starts; a pending fold is dropped."""
        self.conv.zero_()
        self.rec.zero_()
        self.logs = [None] * len(self.logs)
        for pend in self._pend.values():
            pend.zero_()
        self._deferred = None

    def _commit_options(self) -> dict:
        """The kernel options the commit kernel takes (block_t and prep_warps only tune the verify; fma changes how
        the verify's walk updates the state, so the commit's fold must do the same)."""
        return {k: v for k, v in self.kernel_options.items() if k in ("block_v", "num_warps", "fma")}

    def _defers(self, T: int) -> bool:
        """Whether commits of T-token verifies are deferred (and those verifies fold a pending commit)."""
        return self.mode == "replay" and self.defer and T in self._static

    def flush(self) -> None:
        """Materialise ``rec``: fold a pending (deferred) commit now, with the commit kernel (``conv`` was
        rolled by the deferred commit itself).

        Bit for bit what the next verify would have folded (the same operations on the same values).
        A no-op without a pending commit, and idempotent: the counts are zeroed. Call it before reading
        the states anywhere but in verify (the engine does at the end of every generation). Eager: it
        launches kernels (none when nothing can be pending), so not inside a graph capture. Where
        commits were captured into CUDA graphs it always folds those block lengths' counts: their
        replays are invisible to Python, and rows with a count of 0 are left untouched.
        """
        lengths = set(self._captured)
        if self._deferred is not None:
            lengths.add(self._deferred)
        if not lengths:
            return
        from dflash2.runtime.kernels.gdn_replay import gdn_replay_triton

        opts = self._commit_options()
        for T in sorted(lengths):
            pend, (stash_k, stash_g) = self._pend[T], self._stash[T]
            n = pend[:, :, 0].contiguous()  # (L_g, N): the counts are equal across a row's programs
            for slot, log in enumerate(self._static[T]):
                # the deferred commit rolled the windows already: fold the states only (n = 0: untouched)
                pending = GDNLog(x=log.x, k=stash_k[slot], u=log.u, g=stash_g[slot])
                gdn_replay_triton(self.conv[slot], self.rec[slot], pending, n[slot], roll_conv=False, **opts)
            pend.zero_()
        self._deferred = None

    def verify(
        self,
        slot: int,
        x: torch.Tensor,
        conv_weight: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        A_log: torch.Tensor,
        dt_bias: torch.Tensor,
    ) -> torch.Tensor:
        """Layer ``slot``: x (N, T, C) pre-conv, conv_weight (C, 1, K), a / b (N, T, H) the raw gate
        projections, A_log / dt_bias (H,) -> o (N, T, H, d_v) in x's dtype. The states are only read,
        but for a deferred commit, which is folded into them first; the log goes to the reserved
        addresses when T was reserved."""
        T = x.shape[1]
        static = self._static.get(T)
        out = None if static is None else static[slot]
        if self._deferred is not None and (self._deferred != T or not self._defers(T)):
            self._flush_here()  # a commit of another block length is pending: this verify cannot fold it
        if self.mode == "reference":
            g, beta = gdn_gates(a, b, A_log, dt_bias)
            o, log = gdn_verify(
                x, self.conv[slot], conv_weight, self.rec[slot], g, beta, self.num_k_heads, self.head_k_dim
            )
            if out is not None:  # copy into the fixed addresses (small: T tokens of one layer)
                for dst, src in zip((out.x, out.k, out.u, out.g), (log.x, log.k, log.u, log.g)):
                    dst.copy_(src)
                log = out
            self.logs[slot] = log
            return o
        from dflash2.runtime.kernels.gdn_verify import gdn_verify_triton  # Triton only where it runs

        fold = fold_next = None
        if self._defers(T):  # always, so that a captured verify is the same kernel whether a fold is pending
            fold = PendingFold(self._pend[T][slot], *(t[slot] for t in self._stash[T]))
            if self.fold_ahead and slot + 1 < len(self.logs):
                # the next GDN layer's pending commit, folded during this walk (its verify then finds none)
                nxt = slot + 1
                fold_next = NextLayerFold(
                    self.rec[nxt], static[nxt].u, PendingFold(self._pend[T][nxt], *(t[nxt] for t in self._stash[T]))
                )
        o, self.logs[slot] = gdn_verify_triton(
            x,
            self.conv[slot],
            conv_weight,
            self.rec[slot],
            a,
            b,
            A_log,
            dt_bias,
            self.num_k_heads,
            native=self._native(T),
            out=out,
            fold=fold,
            fold_next=fold_next,
            **dict(self.kernel_options, fold_ahead=self.fold_ahead),
        )
        return o

    def _flush_here(self) -> None:
        """flush() from inside verify, refused while a CUDA graph is being captured: the fold would be
        recorded into the graph and replayed with whatever counts a later step leaves."""
        if self.rec.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"a deferred GDN commit of a {self._deferred}-token block is pending while a verify of another "
                "length is captured; flush() the state before capturing"
            )
        self.flush()

    def commit(self, n: torch.Tensor, defer: bool = True) -> None:
        """Fold n[r] tokens of the last verify into row r of every layer; n (N,) long in [0, T].

        In replay mode with the reserved logs of a T-token verify the fold is deferred: one kernel for all
        layers records n in the pending counts, rolls the conv windows and copies the n tokens' k / g to
        the stash (gdn_defer_commit_triton), and the next T-token verify folds the recurrent state, or
        :meth:`flush`. ``defer=False`` folds at once whatever the logs (a prefill: the first decode
        verify, possibly a captured graph, may have another block length and could not fold it)."""
        if any(log is None for log in self.logs):
            raise RuntimeError("GDNState.commit without a verify of every GDN layer since the last commit")
        T = self.logs[0].x.shape[1]
        if defer and self._defers(T) and all(log is res for log, res in zip(self.logs, self._static[T])):
            from dflash2.runtime.kernels.gdn_replay import gdn_defer_commit_triton

            # one launch: every layer's counts, conv windows rolled, and the pending k / g to the stash
            gdn_defer_commit_triton(n, self._pend[T], self.conv, *self._stacked[T], *self._stash[T])
            self._deferred = T
            if self.rec.is_cuda and torch.cuda.is_current_stream_capturing():
                self._captured.add(T)  # replays of this graph defer commits that flush() must find
            self.logs = [None] * len(self.logs)
            return
        if self.mode == "reference":
            for slot, log in enumerate(self.logs):
                conv, rec = gdn_replay(self.conv[slot], self.rec[slot], log, n)
                self.conv[slot].copy_(conv)
                self.rec[slot].copy_(rec)
        else:
            from dflash2.runtime.kernels.gdn_replay import gdn_replay_triton

            opts = self._commit_options()
            for slot, log in enumerate(self.logs):
                gdn_replay_triton(self.conv[slot], self.rec[slot], log, n, **opts)
        self.logs = [None] * len(self.logs)

    def log_bytes(self) -> int:
        """Bytes of speculative state the pending logs hold (all layers, all rows): what the
        verify → commit round trip keeps beyond the committed states — with the deferred commit also
        its counts and the stash of the logs' block length (kept until the next verify)."""
        held = sum(log.nbytes() for log in self.logs if log is not None)
        T = next((log.x.shape[1] for log in self.logs if log is not None), None)
        if T is not None and self._defers(T):
            held += sum(t.numel() * t.element_size() for t in (self._pend[T], *self._stash[T]))  # all layers
        return held
