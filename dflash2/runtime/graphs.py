"""CUDA graphs of the decode loop's fixed-shape phases, and timing of those phases (docs/ARCHITECTURE.md §6).

A batch-1 decode step of a mid-size model is launch-bound when run eagerly: hundreds
of small kernels, each waiting for the CPU to issue it. A CUDA graph records a phase's
kernels once and replays them with one launch. The engine (engine.py) splits every
step into phases — AR: forward, accept, commit; speculative: draft, verify, accept,
commit — each a Python function that reads and writes only tensors at fixed addresses
(the caches and the loop buffers of one batch bucket), so each can be captured.

:class:`PhaseGraphs` decides per phase key (phase name, attended-length bucket, ...):
the first use runs eagerly (it warms up cuBLAS / Triton / lazy allocations and does
the step's real work), the second use captures and replays, every later use replays.
Capturing runs nothing, so no state is ever advanced twice and no warm-up touches the
caches. All graphs of an engine share one memory pool: phases replay one after the
other on one stream, so their temporaries may share memory.

:class:`PhaseTimer` records a CUDA event after each phase of each step (no host sync;
read once at the end), giving per-step times of draft / verify / accept / commit and
the gap the host loop adds between steps.
"""

from __future__ import annotations

import time
from collections import defaultdict
from itertools import pairwise

import torch

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


def batch_bucket(n: int, buckets=BATCH_BUCKETS) -> int:
    """The smallest bucket ≥ n (n itself beyond the largest): the batch size a graphed slot is allocated with."""
    return next((b for b in buckets if b >= n), n)


class PhaseGraphs:
    """Eager on a key's first use, captured on its second, replayed from then on (``enabled=False``: always eager).

    ``run(key, fn)``: fn() takes no arguments and returns nothing; it may allocate temporaries
    but its results must land in tensors that outlive it (the slot's buffers). ``generators``: the
    non-default CUDA generators the phases draw from; each graph registers them before capture
    (CUDA graphs refuse draws from an unregistered generator).
    """

    def __init__(self, enabled: bool, pool=None, generators=()):
        self.enabled = enabled
        self.pool = pool
        self.generators = tuple(generators)  # CUDA generators a phase may draw from (registered per graph)
        self.graphs: dict = {}
        self.seen: set = set()
        self.captures = 0

    def run(self, key, fn, graph: bool = True) -> None:
        if not (self.enabled and graph):
            fn()
            return
        g = self.graphs.get(key)
        if g is None:
            if key not in self.seen:  # first use: the real work, eagerly (warms every lazy init)
                self.seen.add(key)
                fn()
                return
            g = torch.cuda.CUDAGraph()
            for gen in self.generators:  # a replay then advances gen's offset as the eager draws would
                g.register_generator_state(gen)
            with torch.cuda.graph(g, pool=self.pool):
                fn()  # recorded, not run
            self.graphs[key] = g
            self.captures += 1
        g.replay()

    def __len__(self) -> int:
        return len(self.graphs)


class PhaseTimer:
    """Per-step phase times. ``begin_step()`` then ``done(name)`` after each phase; ``summary()`` at the end.

    CUDA: events on the current stream (read after the run, one sync); CPU: perf_counter.
    """

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.steps: list[list] = []  # per step: [(name, mark), ...], first name "begin"

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def begin_step(self) -> None:
        self.steps.append([("begin", self._mark())])

    def done(self, name: str) -> None:
        self.steps[-1].append((name, self._mark()))

    def _ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3

    def summary(self) -> dict[str, list[float]]:
        """{phase: ms per step, 'step': begin-to-begin ms (the last step: to its last phase), 'gap': host time
        between a step's last phase and the next step's first}."""
        if self.cuda:
            torch.cuda.synchronize()
        out: dict[str, list[float]] = defaultdict(list)
        for i, marks in enumerate(self.steps):
            for (_, a), (name, b) in pairwise(marks):
                out[name].append(self._ms(a, b))
            if i + 1 < len(self.steps):
                nxt = self.steps[i + 1][0][1]
                out["step"].append(self._ms(marks[0][1], nxt))
                out["gap"].append(self._ms(marks[-1][1], nxt))
            else:
                out["step"].append(self._ms(marks[0][1], marks[-1][1]))
        return dict(out)
