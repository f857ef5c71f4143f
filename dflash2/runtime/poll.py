"""The decode loop's one host read per step, taken a few steps late (docs/ARCHITECTURE.md §6).

The host needs two numbers to launch a step: whether any row is still active (else the
generation is over) and the longest committed row (how much of the caches attention reads,
rounded up to a bucket). Reading them right after a step makes the host wait for that step,
and the GPU then idles while the host launches the next one: about 0.3 ms of a 4.9 ms
Qwen3-8B AR step on an H200 (docs/BENCHMARKS.md). Instead each step's pair is copied into
page-locked host memory behind the step, and the host reads the pair of the step ``lag``
steps back, while the GPU still has the steps since then queued. Two consequences, both
safe:

* the longest row is known only as of that older step; every step commits at most T tokens
  per row, so ``known + T · (steps since)`` bounds it, and attention reads at most one
  bucket more than needed;
* the last ``lag`` steps of a generation run after every row has finished. Finished rows
  take part in a step but commit and emit nothing (engine.py), so those steps change no
  output; their draws at T>0 come after the last emitted token.

Where the pair is computed: inside the step's last phase (the engine's commit phase writes it into a slot
buffer at a fixed address with :func:`pair_of`, so with graphs a replay writes it), and the host only
queues that buffer's copy and an event record (:meth:`LaggedPoll.after_step_pair`). Why: computed
eagerly after the step, the pair's 4 small kernels (any, the cast, max, stack), each waiting for its
launch, and the copy made the time between the commit phase's end and the next step's first phase: about
18 µs per step on an H200 (the eval's PhaseTimer ``gap``; docs/BENCHMARKS.md, stop 16), on AR steps of
0.49 ms and speculative steps of 0.81 ms of a 90M target, plus their host launch cost every step. In the
graph the kernels count in the commit phase's time instead (not yet re-measured).
:meth:`LaggedPoll.after_step` keeps the eager computation for callers that hold no such buffer (tests).

``lag=0`` reads each step's pair right after it (the blocking poll). Shapes: Nb rows.
"""

from __future__ import annotations

from collections import deque

import torch


def pair_of(active: torch.Tensor, lengths: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """(any row active, longest row) of active (Nb,) bool and lengths (Nb,) long -> (2,) long on their
    device, written into ``out`` when given (the slot's buffer: the engine's commit phase, captured with it)."""
    return torch.stack([active.any().long(), lengths.max()], out=out)


class LaggedPoll:
    """(any row active, longest row) per step, read ``lag`` steps late; one per slot (its pinned buffers)."""

    def __init__(self, device: torch.device, lag: int):
        if lag < 0:
            raise ValueError(f"poll lag {lag} must be ≥ 0")
        self.lag = int(lag)
        self.cuda = device.type == "cuda"
        # a pinned pair per step in flight (+1: the one being written while the oldest is read)
        self._host = [torch.zeros(2, dtype=torch.long, pin_memory=self.cuda) for _ in range(self.lag + 2)]
        self._events = [torch.cuda.Event() for _ in self._host] if self.cuda else None
        self._pending: deque = deque()  # (step index, ring slot) of the pairs not read yet
        self.launched = 0  # steps launched in this generation
        self.known = 0  # the step whose pair `longest` is (0: before the first step)
        self.longest = 0

    def start(self, active: torch.Tensor, lengths: torch.Tensor) -> bool:
        """Before the first step (blocking: the prefill's pair): whether any row is active."""
        self._pending.clear()
        self.launched = self.known = 0
        any_active, self.longest = pair_of(active, lengths).tolist()
        return bool(any_active)

    def longest_bound(self, T: int) -> int:
        """An upper bound of the longest committed row when the next step runs (each step commits ≤ T)."""
        return self.longest + (self.launched - self.known) * T

    def after_step(self, active: torch.Tensor, lengths: torch.Tensor) -> bool:
        """:meth:`after_step_pair` of the pair of active (Nb,) bool and lengths (Nb,) long, computed here
        eagerly (a few kernels: callers without a pair buffer; the engine's loop computes it in its commit)."""
        return self.after_step_pair(pair_of(active, lengths))

    def after_step_pair(self, pair: torch.Tensor) -> bool:
        """Queue the pair of the step just launched ((2,) long on the device: :func:`pair_of`, as the step
        left it; it may be overwritten by later steps, as the copy is queued behind this one); read the
        oldest pair once more than ``lag`` are queued. Returns False once a read pair says that no row was
        active after its step (the generation is over), else True. On CUDA it launches no kernel: one
        copy into page-locked memory and an event record."""
        self.launched += 1
        i = self.launched % len(self._host)
        if self.cuda:
            self._host[i].copy_(pair, non_blocking=True)
            self._events[i].record()
        else:
            self._host[i].copy_(pair)
        self._pending.append((self.launched, i))
        if len(self._pending) <= self.lag:
            return True
        step, j = self._pending.popleft()
        any_active, self.longest = self._read(j)
        self.known = step
        return bool(any_active)

    def _read(self, j: int) -> list[int]:
        """The pair in ring slot j, once its copy has landed: the loop's one wait for the GPU per step."""
        if self.cuda:
            self._events[j].synchronize()
        return self._host[j].tolist()
