"""The runtime's decoding loops: plain AR decode and lossless speculative decode (docs/ARCHITECTURE.md §4, §6).

Both take a batch of N prompts of any lengths and run every row in the same tensors:

    prefill      one forward of the right-padded prompts; row r commits its own length
                 (short prompts: optionally padded to a bucket and run as a CUDA graph, prefill.py)
    per step     [draft]  verify  accept  commit          (phases; step.py, drafter.py)

Rows are ragged throughout: lengths live on the device, each row advances by its own
accepted count inside the same step (KV: a length update; GDN: replay of n[r] tokens;
drafter context: the taps of those positions), and rows that finished (EOS or their
token budget) keep taking part in the fixed-shape forwards but commit and emit
nothing, so they never stall the others. The step has no loop over rows and reads
one small tensor back per step (whether any row is active, and the longest row,
which picks how much of the caches attention reads), on CUDA one step late so that
the host never waits for the step it just launched (poll.py). That pair is computed
inside the step's commit phase, into a slot buffer (captured with the phase), so the host
launches no kernel between steps, only the pair's copy: computed eagerly after the step,
its few kernels made most of the ~18 µs per step between steps on an H200 (poll.py).

:class:`Decoder` keeps, per batch bucket, a *slot*: the target's caches, the drafter
context and every loop buffer (last token, counts, budgets, EOS ids, output, step
log) at fixed addresses, reused by every generation of that bucket. Each phase is a
function of the slot alone, so with ``graphs=True`` (CUDA) each is captured once per
(bucket, phase, attended-length bucket) and replayed afterwards (graphs.py); with
``prefill_graph_tokens`` > 0 (by default 64 with graphs) so is the prefill of prompts up to
that width, per (bucket, prompt-width bucket). A batch of N rows runs in the slot of
``batch_bucket(N)``; the padding rows are inactive from the start. T>0 phases are
captured too: on CUDA they draw from the Decoder's own generator, registered with every
graph (a replay advances it as the eager call would), and seeded once per generation
from the caller's generator; their hand-overs (the warped p, the drafts' q) live in slot
buffers at fixed addresses. Each phase's key carries the sampling parameters, which a
graph bakes in.

:func:`generate_ar` / :func:`generate_spec` are one-generation conveniences over a
fresh eager Decoder. Shapes: N rows (Nb in the slot), P_max longest prompt, B block,
V vocabulary.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable
from contextlib import contextmanager

import torch

from dflash2.decoding.decoder import SpecResult
from dflash2.decoding.sampling import SamplingParams, warp_probs
from dflash2.errors import DFlash2Error
from dflash2.runtime.drafter import RuntimeDrafter
from dflash2.runtime.graphs import BATCH_BUCKETS, PhaseGraphs, batch_bucket
from dflash2.runtime.kernels.accept import greedy_accept
from dflash2.runtime.kernels.sampled_accept import sampled_accept
from dflash2.runtime.poll import LaggedPoll, pair_of
from dflash2.runtime.prefill import bucketed_prefill, prefill_bucket
from dflash2.runtime.sampling import Proposal, accept_noise
from dflash2.runtime.side_stream import SideStream
from dflash2.runtime.step import choose, emit, prefill

KV_BUCKET = 64  # eager: attention reads the caches up to the longest row rounded up to this
GRAPH_KV_BUCKET = 256  # graphs: one capture per bucket, so coarser (the extra cache read is small)
EOS_SLOTS = 16  # EOS ids a slot holds (padded with -1, which matches no token)


def pad_prompts(prompts, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, P) tensor or N id lists -> right-padded ids (N, P_max) long and lengths (N,) long, on ``device``."""
    if isinstance(prompts, torch.Tensor):
        rows = [r.tolist() for r in (prompts[None] if prompts.dim() == 1 else prompts)]
    else:
        rows = [[int(t) for t in r] for r in prompts]
    if not rows:
        raise DFlash2Error("no prompts to decode; pass at least one prompt")
    if any(not r for r in rows):
        raise DFlash2Error("a prompt is empty; every prompt needs at least one token")
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.long)
    return ids.to(device), torch.tensor([len(r) for r in rows], dtype=torch.long, device=device)


def _kv_len(longest: int, T: int, max_len: int, bucket: int = KV_BUCKET) -> int:
    """Cache positions a T-token step must attend: longest committed row + T, rounded up to a bucket."""
    return min(max_len, -(-(longest + T) // bucket) * bucket)


class Slot:
    """What one batch bucket of Nb rows keeps between generations (all at fixed addresses).

    state / ctx: target caches and drafter context; token (Nb,) the last emitted token (the next
    input / anchor); nxt (Nb,) the AR step's choice; count / limit (Nb,) emitted tokens and budget;
    active (Nb,) bool; commit_n (Nb,) tokens the step commits; eos (EOS_SLOTS,) ids (-1 = none);
    out (Nb, W) emitted tokens; drafts (Nb, B-1), argmax (Nb, B) of the verify; log (S, 3, Nb)
    per step (was active, accepted drafts, emitted) with its device counter ``step`` (1,);
    poll_pair (2,) (any row active, longest row) after the latest commit, the loop's poll (poll.py);
    prefill: the bucketed prefill's buffers (prefill.PrefillBuffers), made on its first use.
    """

    def __init__(self, model, drafter, Nb: int, max_len: int, graphs: PhaseGraphs, poll_lag: int = 0):
        device = model.embed.weight.device
        self.poll = LaggedPoll(device, poll_lag)  # the loop's host read (poll.py)
        B = drafter.block_size if drafter is not None else 1
        self.batch, self.max_len, self.graphs = Nb, max_len, graphs
        self.state = model.new_state(Nb, max_len)
        self.ctx = drafter.new_context(Nb, max_len) if drafter is not None else None
        if self.state.gdn is not None:
            self.state.gdn.reserve(1)
            self.state.gdn.reserve(B)
        z = dict(dtype=torch.long, device=device)
        self.token, self.nxt, self.count = (torch.zeros(Nb, **z) for _ in range(3))
        self.limit, self.commit_n = torch.zeros(Nb, **z), torch.zeros(Nb, **z)
        self.active = torch.zeros(Nb, dtype=torch.bool, device=device)
        self.eos = torch.full((EOS_SLOTS,), -1, **z)
        self.out = torch.zeros(Nb, max_len + B + 1, **z)  # W ≥ count + B always
        self.no_drafts = torch.zeros(Nb, 0, **z)
        self.drafts = torch.zeros(Nb, B - 1, **z)
        self.argmax = torch.zeros(Nb, B, **z)
        self.log = torch.zeros(max_len + 1, 3, Nb, **z)
        self.step = torch.zeros(1, **z)
        self.poll_pair = torch.zeros(2, **z)  # written by every commit phase, copied to the host by the poll
        self.proposal = self.probs = None  # T>0 hand-over between phases, in buffers of `keep`
        self.prefill = None  # prefill.PrefillBuffers, made by the first bucketed prefill
        self._kept: dict[tuple, torch.Tensor] = {}

    def keep(self, name: str, t: torch.Tensor | None) -> torch.Tensor | None:
        """t copied into this slot's buffer for (name, shape, dtype), made on first use and kept for the
        slot's life, so that a phase's result sits at one address whichever graph or eager call produced
        it and a captured consumer reads it there (a graph of another shape keeps its own buffer alive).
        None stays None."""
        if t is None:
            return None
        key = (name, tuple(t.shape), t.dtype)
        if key not in self._kept:
            self._kept[key] = torch.empty_like(t)
        return self._kept[key].copy_(t)

    def reset(self, max_new_tokens: int, eos: list[int]) -> None:
        """Empty caches and counters for a new generation (K/V past the lengths is never read: not cleared)."""
        self.state.lengths.zero_()
        if self.state.gdn is not None:
            self.state.gdn.reset()
        if self.ctx is not None:
            self.ctx.lengths.zero_()
        self.count.zero_()
        self.step.zero_()
        self.limit.fill_(max_new_tokens)
        self.eos.fill_(-1)
        if eos:
            self.eos[: len(eos)] = torch.tensor(eos, dtype=torch.long)


def _eos_list(eos_token_id) -> list[int]:
    if eos_token_id is None:
        return []
    ids = eos_token_id.tolist() if isinstance(eos_token_id, torch.Tensor) else eos_token_id
    ids = [int(ids)] if isinstance(ids, int) else [int(e) for e in ids]
    if len(ids) > EOS_SLOTS:
        raise DFlash2Error(f"{len(ids)} EOS ids; the runtime holds at most {EOS_SLOTS}")
    return ids


# torch builds whose CUDA graphs cannot register a generator (older than 2.5) run sampling phases eagerly
GRAPHED_SAMPLING = hasattr(torch.cuda.CUDAGraph, "register_generator_state")


def _graphable(params: SamplingParams) -> bool:
    return params.greedy or GRAPHED_SAMPLING


def _key(params: SamplingParams) -> tuple:
    """What of the sampling parameters a captured phase bakes in (part of its graph key)."""
    return ("greedy",) if params.greedy else (params.temperature, params.top_k, params.top_p)


@contextmanager
def collector_paused(pause: bool = True):
    """Python's cyclic garbage collector off inside (when ``pause``), back to its previous state after.

    Why: the host launches each step about one step ahead of the GPU (poll.py), so any host pause
    longer than a step — a full collection walks every tracked object, torch's and transformers'
    included — leaves the GPU idle and lands in that step's time. Reference counting still frees
    everything without cycles; a decode loop makes few cycles, and they are collected afterwards."""
    was_enabled = gc.isenabled()
    if pause:
        gc.disable()
    try:
        yield
    finally:
        if pause and was_enabled:
            gc.enable()


@contextmanager
def heap_frozen(freeze: bool = True):
    """Inside (when ``freeze``): one full collection, then every object the cyclic GC tracks moved to its
    permanent generation (``gc.freeze``), so later collections walk only what is made afterwards. Yields the
    number of objects this call froze (0 when off).

    After: ``gc.unfreeze()`` when the heap had no frozen objects before; when it had (the interpreter or a
    caller froze some: on the H200 image the count was already non-zero when eval.speedup started, and the
    first version of this function then froze nothing), the objects frozen here stay frozen, because
    unfreezing would also thaw the caller's. Then whatever of them ends up in a reference cycle is never
    collected: harmless for a command that exits (eval.speedup), a leak in a process that loads models over
    and over.

    Why (a harness setting, like a server freezing its heap after start-up): with the models, transformers
    and Hydra loaded, a full collection walks every tracked object. On an H200 decode loops of ~0.5 ms
    steps had single steps of 4–320 ms with the collector on, and none over 0.51 ms (AR) / 0.82 ms (spec)
    with it paused, where one run lost ~0.3 s outside its steps instead (docs/BENCHMARKS.md, stops 17–18):
    collections are the suspect, not yet proven. Frozen objects are never collected: freeze after loading,
    not around code that makes garbage cycles to be freed."""
    if not freeze:
        yield 0
        return
    before = gc.get_freeze_count()
    gc.collect()
    gc.freeze()
    try:
        yield gc.get_freeze_count() - before
    finally:
        if before == 0:
            gc.unfreeze()


# prompts up to this many tokens are prefilled as CUDA graphs by default (with graphs on): the buckets 16, 32, 64
DEFAULT_PREFILL_GRAPH_TOKENS = 64


def default_prefill_graph_tokens(graphs: bool, value: int | None = None) -> int:
    """A Decoder's prefill_graph_tokens: ``value`` when given, else :data:`DEFAULT_PREFILL_GRAPH_TOKENS` with
    graphs and 0 (eager) without them: without graphs the padded prefill runs eagerly, paying the padding's
    work and saving no launches."""
    if value is not None:
        return int(value)
    return DEFAULT_PREFILL_GRAPH_TOKENS if graphs else 0


class Decoder:
    """AR and speculative decoding of one runtime target (and drafter) with reusable per-bucket slots.

    model: a runtime target (``load_model``); drafter: a RuntimeDrafter, a DFlashDrafter or its folder,
    or None (AR only). max_len: positions a slot holds (prompt + new tokens + a block must fit).
    graphs: capture the phases as CUDA graphs (default: on CUDA devices). pad: run N rows in the slot of
    ``batch_bucket(N)`` (default: with graphs; eagerly a slot of exactly N rows wastes no work).
    poll_lag: steps between a step and the host's read of its (any active, longest row) (poll.py;
    default 1 on CUDA, so the host never waits for the step it just launched, 0 on the CPU).
    prefill_graph_tokens: 0 = the prefill runs eagerly at the prompts' own width; > 0 = a batch whose
    padded prompt width P is ≤ this is padded to ``prefill.prefill_bucket(P)`` (a power of two ≥ 16; it
    must fit in max_len) and prefilled as a phase of its own, keyed by that width: captured and replayed
    like the step phases when graphs are on, run eagerly (the same padded computation) when they are off;
    None (the default) = :data:`DEFAULT_PREFILL_GRAPH_TOKENS` with graphs, 0 without. Why: a short
    prompt's eager prefill is bound by its launches (prefill.py); on the H200 the graphed prefill of a
    64-token prompt took a generation's time outside its steps from 19.5 to 2.9 ms (docs/BENCHMARKS.md,
    stop 16). Cost: the padded tokens' compute, and in native GDN mode (the ablation) a prompt of
    < 16 tokens padded to 16 stores 16 per-position states per GDN layer during its prefill.
    gc_pause: the decode loop runs with Python's cyclic garbage collector off (:func:`collector_paused`).
    Off by default until measured; note the switch is process-wide (other threads' collections wait too)
    and the collection it defers runs after the loop, inside the generation's wall time.
    overlap_context: a speculative verify writes the drafter's context K/V of its block on a side stream as
    soon as the target's last tapped layer's output is stored (by the next layer's first norm, models/base.py
    ``_tap``), beside the remaining layers (:class:`SideStream`, joined inside the verify phase); False = in
    line at that point, before the remaining layers. The same values either way.
    Attributes set by callers: ``timer`` (a :class:`~dflash2.runtime.graphs.PhaseTimer` or None) and
    ``on_step`` (called with the slot after each step: progress bars, tests).
    """

    def __init__(
        self,
        model,
        drafter=None,
        *,
        max_len: int,
        graphs: bool | None = None,
        pad: bool | None = None,
        buckets=BATCH_BUCKETS,
        poll_lag: int | None = None,
        prefill_graph_tokens: int | None = None,
        gc_pause: bool = False,
        overlap_context: bool = True,
    ):
        if drafter is not None and not hasattr(drafter, "propose"):  # a DFlashDrafter or its folder
            drafter = RuntimeDrafter(drafter, model)
        self.model, self.drafter, self.max_len = model, drafter, int(max_len)
        self.device = model.embed.weight.device
        cuda = self.device.type == "cuda"
        self.graphs = cuda if graphs is None else bool(graphs)
        if self.graphs and not cuda:
            raise DFlash2Error("graphs=True needs a CUDA target; pass graphs=False (or None) on the CPU")
        self.buckets = buckets
        # the host reads a step's (any active, longest) this many steps late (poll.py): on CUDA one step, so
        # that the GPU always has the next step queued; on the CPU nothing runs ahead of the host anyway
        self.poll_lag = (1 if cuda else 0) if poll_lag is None else int(poll_lag)
        self.pad = self.graphs if pad is None else bool(pad)
        prefill_graph_tokens = default_prefill_graph_tokens(self.graphs, prefill_graph_tokens)
        if prefill_graph_tokens < 0:
            raise DFlash2Error(f"prefill_graph_tokens={prefill_graph_tokens} must be ≥ 0 (0 = eager prefill)")
        self.prefill_graph_tokens = int(prefill_graph_tokens)
        self.gc_pause = bool(gc_pause)
        # the drafter's context K/V beside the verify's last target layers (_verify); False: in line, before them
        self.side = SideStream(self.device, enabled=bool(overlap_context))
        self.kv_bucket = GRAPH_KV_BUCKET if self.graphs else KV_BUCKET
        self._pool = torch.cuda.graph_pool_handle() if self.graphs else None
        # T>0 on CUDA: one generator of the Decoder's, seeded per generation from the caller's (see
        # _sampling_generator), registered with every graph so that captured draws advance it
        self._rng = torch.Generator(device=self.device) if cuda else None
        self.slots: dict[int, Slot] = {}
        self.timer = None
        self.on_step = None

    @property
    def captures(self) -> int:
        """Graphs captured so far, over all slots."""
        return sum(s.graphs.captures for s in self.slots.values())

    # ------------------------------------------------------------------ slots
    def slot(self, N: int) -> Slot:
        """The slot of N rows: its batch bucket when padding (padding rows stay inactive), else exactly N."""
        Nb = batch_bucket(N, self.buckets) if self.pad else N
        if Nb not in self.slots:
            graphs = PhaseGraphs(self.graphs, self._pool, generators=() if self._rng is None else (self._rng,))
            self.slots[Nb] = Slot(self.model, self.drafter, Nb, self.max_len, graphs, self.poll_lag)
        return self.slots[Nb]

    def _begin(self, prompts, max_new_tokens: int, eos_token_id, extra: int):
        if max_new_tokens < 0:
            raise DFlash2Error(f"max_new_tokens={max_new_tokens} must be >= 0")
        ids, lengths = pad_prompts(prompts, self.device)
        N, P = ids.shape
        if P + max_new_tokens + extra > self.max_len:
            raise DFlash2Error(
                f"prompt ({P}) + max_new_tokens ({max_new_tokens}) + {extra} exceeds the decoder's max_len "
                f"{self.max_len}; build the Decoder with a larger max_len"
            )
        s = self.slot(N)
        if s.batch > N:  # padding rows: a one-token prompt, inactive from the first token on
            ids = torch.cat([ids, ids.new_zeros(s.batch - N, P)])
            lengths = torch.cat([lengths, lengths.new_ones(s.batch - N)])
        s.reset(max_new_tokens, _eos_list(eos_token_id))
        return s, ids, lengths, N

    def _sampling_generator(self, params, generator):
        """The generator a generation's draws come from. On the CPU (and at T=0): the caller's. On CUDA
        at T>0: the Decoder's own, reseeded now from one draw of the caller's generator (or of the
        default one): graphs can only replay draws from a generator registered at capture, so every
        phase, eager or replayed, uses that one; one host read per generation, before its steps."""
        if params.greedy or self._rng is None:
            return generator
        dev = generator.device if generator is not None else self.device
        seed = torch.randint(0, 2**62, (1,), generator=generator, device=dev)
        self._rng.manual_seed(int(seed))
        return self._rng

    def _prefill_width(self, P: int) -> int | None:
        """The bucket width a prompt batch P tokens wide is prefilled at, or None: eagerly at its own width
        (bucketing off, P over the limit, or a bucket that would not fit in the slot's max_len)."""
        if not 0 < P <= self.prefill_graph_tokens:
            return None
        width = prefill_bucket(P)
        return width if width <= self.max_len else None

    def _prefill(self, s: Slot, ids: torch.Tensor, lengths: torch.Tensor, spec: bool) -> torch.Tensor:
        """Prefill of ids (Nb, P) with lengths (Nb,) into the slot -> the last prompt token's logits (Nb, V).

        spec: the drafter's context gets the prompt's taps (AR computes none). Bucketed (prefill.py) when
        :meth:`_prefill_width` gives a width, else eagerly at width P."""
        width = self._prefill_width(ids.shape[1])
        if width is not None:
            return bucketed_prefill(s, self.model, self.drafter if spec else None, ids, lengths, width)
        if not spec:
            return prefill(self.model, s.state, ids, lengths, taps=False)
        # the prompt's taps go to a buffer of their own (variable length), then into the context
        taps = None if s.ctx.taps is None else s.ctx.taps.new_empty(s.batch, ids.shape[1], s.ctx.taps.shape[-1])
        logits = prefill(self.model, s.state, ids, lengths, taps_out=taps)
        self.drafter.append(s.ctx, taps, lengths)
        return logits

    def _first_token(self, s: Slot, logits, N: int, params, generator) -> None:
        """The prefill's token is emitted; rows that are done (budget 1, EOS) or padding are inactive."""
        token = choose(logits, params, generator)  # (Nb,)
        s.count.copy_(emit(s.out, s.count, token[:, None], torch.ones_like(token)))
        done = (s.count >= s.limit) | (token[:, None] == s.eos).any(-1)
        s.active.copy_(~done & (torch.arange(s.batch, device=token.device) < N))
        s.token.copy_(token)

    def _phase(self, s: Slot, key, fn, name: str, graph: bool = True) -> None:
        s.graphs.run(key, fn, graph)
        if self.timer is not None:
            self.timer.done(name)

    def _loop(self, s: Slot, T: int, step_fn) -> None:
        """Steps until no row is active. The host's one read per step is (any row active, longest row) of the
        step ``poll_lag`` steps back (poll.py): attention reads up to a bound of the longest row, and the last
        ``poll_lag`` steps run with every row finished (they commit and emit nothing). A step's pair is the
        slot's ``poll_pair``, written by its commit phase (its last phase; ``step_fn`` must end with one);
        the host only queues its copy. With ``gc_pause`` the cyclic garbage collector is off meanwhile
        (:func:`collector_paused`)."""
        with collector_paused(self.gc_pause):
            go = s.poll.start(s.active, s.state.lengths)
            while go:
                if self.timer is not None:
                    self.timer.begin_step()
                step_fn(_kv_len(s.poll.longest_bound(T), T, self.max_len, self.kv_bucket))
                if self.on_step is not None:
                    self.on_step(s)
                go = s.poll.after_step_pair(s.poll_pair)

    # ------------------------------------------------------------------ phases (functions of the slot)
    def _commit(self, s: Slot, T: int, spec: bool) -> None:
        """Rollback / commit: keep commit_n[r] of the T block tokens (target lengths, GDN replay, drafter context),
        then the step's poll pair (any row active, longest row) into ``s.poll_pair`` (poll.py).

        ReplaySSM's GDN fold is deferred into the next verify (the logs are the slot's reserved ones):
        between steps the slot's GDN states lag by one commit; the end of a generation flushes. The pair is
        computed here, in the step's last phase (graphed at every T: it draws nothing, so it is not subject to
        _graphable), so a replay writes it and the host launches nothing for it; active is final since the accept."""
        if s.state.gdn is not None:
            s.state.gdn.use_static(T)  # what the last T-token verify logged, at its fixed addresses
        s.state.commit(s.commit_n)
        if spec:  # the context K/V were written during the verify (_verify): the rows keep commit_n of them
            s.ctx.lengths += s.commit_n
        pair_of(s.active, s.state.lengths, out=s.poll_pair)

    def _ar_forward(self, s: Slot, kv_len: int, params, generator) -> None:
        # taps=False: plain AR needs no drafter features (they were 5 extra launches per step at the pair's shape)
        logits = self.model(s.token[:, None], s.state, kv_len=kv_len, taps=False).logits[:, 0]  # (Nb, V)
        s.nxt.copy_(choose(logits, params, generator))

    def _ar_accept(self, s: Slot) -> None:
        # an AR step is a greedy verify step with no drafts (whatever chose nxt); the fed token (the previous
        # one) enters the caches even when the row finishes now (kernels/accept.py: one launch on CUDA)
        greedy_accept(
            s.nxt[:, None], s.no_drafts, s.eos, s.active, s.count, s.limit, s.out, s.commit_n, s.token,
            commit_finishing=True,
        )  # fmt: skip

    def _draft(self, s: Slot, kv_len: int, params, generator, argmax_drafts: bool) -> None:
        proposal = self.drafter.propose(s.ctx, s.token, params, generator, kv_len=kv_len, argmax_drafts=argmax_drafts)
        s.drafts.copy_(proposal.tokens)
        if not params.greedy:  # q at fixed addresses: the captured accept reads it there
            q = [s.keep(f"q_{name}", getattr(proposal, name)) for name in ("ids", "probs", "dense")]
            s.proposal = Proposal(s.drafts, *q)

    def _verify(self, s: Slot, kv_len: int, params) -> None:
        block = torch.cat([s.token[:, None], s.drafts], dim=1)  # (Nb, B) = [anchor, d_1 .. d_P]
        written = []

        def write_context(taps):
            # the drafter's context K/V of all B positions need only the taps, not the acceptance (the commit
            # advances the lengths): on a side stream from the last tapped layer's output on (the model calls this
            # once the next norm has stored it into the taps), beside the target's remaining layers and LM head
            # (at batch 1 both chains are latency-bound small kernels). Only from the context's own taps buffer:
            # a buffer the forward allocated (a context without one) would be a main-stream temporary, freed
            # while the side stream may still read it, so that runs in line
            if taps is s.ctx.taps:
                self.side.fork(lambda: self.drafter.write_context(s.ctx, taps))
            else:
                self.drafter.write_context(s.ctx, taps)
            written.append(True)

        logits = self.model(block, s.state, taps_out=s.ctx.taps, kv_len=kv_len, on_taps=write_context).logits
        if not written:
            raise DFlash2Error("the target wrote no taps: the drafter's context needs them (set_taps)")
        if params.greedy:
            s.argmax.copy_(logits.argmax(-1))
        else:
            s.probs = s.keep("p", warp_probs(logits, params))
        self.side.join()  # before the phase ends: a captured graph must join every fork

    def _accept(self, s: Slot, params, generator) -> None:
        if params.greedy:  # the same bookkeeping as below, in place (kernels/accept.py: one launch on CUDA)
            greedy_accept(
                s.argmax, s.drafts, s.eos, s.active, s.count, s.limit, s.out, s.commit_n, s.token,
                log=s.log, step=s.step,
            )  # fmt: skip
            s.step.add_(1)
            return
        # T>0: rejection sampling and the same bookkeeping (kernels/sampled_accept.py: two launches on CUDA after
        # the step's draws, made here in torch in the unfused order so that the generator advances alike)
        u, race = accept_noise(s.probs, s.drafts.shape[1], generator)
        sampled_accept(
            s.probs, s.proposal, u, race, s.eos, s.active, s.count, s.limit, s.out, s.commit_n, s.token,
            log=s.log, step=s.step,
        )  # fmt: skip
        s.step.add_(1)

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate_ar(
        self,
        prompts,
        max_new_tokens: int,
        eos_token_id: int | Iterable[int] | None = None,
        *,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        generator: torch.Generator | None = None,
    ) -> list[list[int]]:
        """Plain autoregressive decoding, one token per row per forward. Returns N lists of new ids."""
        params = SamplingParams(float(temperature), int(top_k), float(top_p))
        s, ids, lengths, N = self._begin(prompts, max_new_tokens, eos_token_id, 1)
        if max_new_tokens == 0:
            return [[] for _ in range(N)]
        generator = self._sampling_generator(params, generator)
        self._first_token(s, self._prefill(s, ids, lengths, spec=False), N, params, generator)
        how = _key(params)

        def step(kv_len: int) -> None:
            fwd = lambda: self._ar_forward(s, kv_len, params, generator)  # noqa: E731
            self._phase(s, ("ar_forward", kv_len, how), fwd, "verify", graph=_graphable(params))
            self._phase(s, ("ar_accept",), lambda: self._ar_accept(s), "accept")
            self._phase(s, ("commit", 1), lambda: self._commit(s, 1, False), "commit")

        self._loop(s, 1, step)
        s.state.flush()  # the committed GDN states, materialised for whoever reads the slot next
        return self._sequences(s, N)

    @torch.no_grad()
    def generate_spec(
        self,
        prompts,
        max_new_tokens: int,
        eos_token_id: int | Iterable[int] | None = None,
        *,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        generator: torch.Generator | None = None,
        argmax_drafts: bool = False,
    ) -> SpecResult:
        """Lossless speculative decoding. At T=0 the output equals :meth:`generate_ar` token for token;
        at T>0 every token follows the target's warped distribution. argmax_drafts: at T>0 draft the
        T=0 drafts and verify them as point masses."""
        if self.drafter is None:
            raise DFlash2Error("this Decoder has no drafter; build it with Decoder(model, drafter, ...)")
        params = SamplingParams(float(temperature), int(top_k), float(top_p))
        B = self.drafter.block_size
        s, ids, lengths, N = self._begin(prompts, max_new_tokens, eos_token_id, B)
        if max_new_tokens == 0:
            return SpecResult([[] for _ in range(N)], [[] for _ in range(N)], [[] for _ in range(N)], B)
        logits = self._prefill(s, ids, lengths, spec=True)
        generator = self._sampling_generator(params, generator)
        self._first_token(s, logits, N, params, generator)
        how, graphable = _key(params), _graphable(params)

        def step(kv_len: int) -> None:
            draft = lambda: self._draft(s, kv_len, params, generator, argmax_drafts)  # noqa: E731
            self._phase(s, ("draft", kv_len, how, argmax_drafts), draft, "draft", graph=graphable)
            self._phase(s, ("verify", kv_len, how), lambda: self._verify(s, kv_len, params), "verify", graph=graphable)
            # accept reads the drafts' q, whose shape depends on argmax_drafts (a point mass has k = 1)
            accept = lambda: self._accept(s, params, generator)  # noqa: E731
            self._phase(s, ("accept", how, argmax_drafts), accept, "accept", graph=graphable)
            self._phase(s, ("commit", B), lambda: self._commit(s, B, True), "commit")

        self._loop(s, B, step)
        s.state.flush()
        return SpecResult(self._sequences(s, N), *self._per_row_steps(s, N), B)

    @staticmethod
    def _sequences(s: Slot, N: int) -> list[list[int]]:
        return [row[:n] for row, n in zip(s.out[:N].tolist(), s.count[:N].tolist())]

    @staticmethod
    def _per_row_steps(s: Slot, N: int) -> tuple[list[list[int]], list[list[int]]]:
        """The step log (S, 3, Nb) -> per row, the accepted drafts (before any EOS / budget cut) and the
        tokens emitted (after it) of each step it took part in, as ``SpecResult`` keeps them (one read)."""
        steps = s.log[: int(s.step)].tolist()
        accepted = [[acc[r] for was, acc, _ in steps if was[r]] for r in range(N)]
        emitted = [[emit[r] for was, _, emit in steps if was[r]] for r in range(N)]
        return accepted, emitted


def _decoder_for(model, drafter, prompts, max_new_tokens: int, extra: int, graphs: bool) -> Decoder:
    """A one-generation Decoder sized for these prompts."""
    rows = prompts.tolist() if isinstance(prompts, torch.Tensor) else prompts
    rows = [rows] if rows and not isinstance(rows[0], (list, tuple)) else rows
    width = max((len(r) for r in rows), default=1)
    return Decoder(model, drafter, max_len=width + max(max_new_tokens, 0) + extra, graphs=graphs)


def generate_ar(
    model,
    prompts,
    max_new_tokens: int,
    eos_token_id: int | Iterable[int] | None = None,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    graphs: bool = False,
) -> list[list[int]]:
    """Plain autoregressive decoding with the runtime target (a one-off :class:`Decoder`).

    prompts: (N, P) long tensor or N id lists (lengths may differ). Returns N lists of generated
    ids (prompt excluded; EOS kept, nothing after it). T=0 is greedy; T>0 samples the warped p.
    """
    dec = _decoder_for(model, None, prompts, max_new_tokens, 1, graphs)
    return dec.generate_ar(
        prompts, max_new_tokens, eos_token_id, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator
    )


def generate_spec(
    model,
    drafter,
    prompts,
    max_new_tokens: int,
    eos_token_id: int | Iterable[int] | None = None,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    argmax_drafts: bool = False,
    graphs: bool = False,
) -> SpecResult:
    """Lossless speculative decoding of ``model`` with ``drafter`` (a one-off :class:`Decoder`).

    drafter: a :class:`~dflash2.runtime.drafter.RuntimeDrafter` (or any object with its
    ``block_size``, ``new_context``, ``append``, ``write_context`` and ``propose``), or a ``DFlashDrafter`` / drafter
    folder, wrapped in one. Returns a ``dflash2.decoding.SpecResult``; see :meth:`Decoder.generate_spec`.
    """
    if not hasattr(drafter, "propose"):
        drafter = RuntimeDrafter(drafter, model)
    dec = _decoder_for(model, drafter, prompts, max_new_tokens, drafter.block_size, graphs)
    return dec.generate_spec(
        prompts,
        max_new_tokens,
        eos_token_id,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        generator=generator,
        argmax_drafts=argmax_drafts,
    )
