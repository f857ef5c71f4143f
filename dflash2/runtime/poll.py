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

``lag=0`` reads each step's pair right after it (the blocking poll). Shapes: Nb rows.
"""

from __future__ import annotations

from collections import deque

import torch


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
        any_active, self.longest = torch.stack([active.any().long(), lengths.max()]).tolist()
        return bool(any_active)

    def longest_bound(self, T: int) -> int:
        """An upper bound of the longest committed row when the next step runs (each step commits ≤ T)."""
        return self.longest + (self.launched - self.known) * T

    def after_step(self, active: torch.Tensor, lengths: torch.Tensor) -> bool:
        """Queue the pair of the step just launched (active (Nb,) bool, lengths (Nb,) long, on the device);
        read the oldest pair once more than ``lag`` are queued. Returns False once a read pair says that
        no row was active after its step (the generation is over), else True."""
        self.launched += 1
        i = self.launched % len(self._host)
        pair = torch.stack([active.any().long(), lengths.max()])
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
