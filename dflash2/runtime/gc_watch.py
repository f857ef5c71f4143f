"""Timing Python's cyclic garbage collections while a measurement runs.

Why: decode steps of ~0.5 ms on an H200 showed rare single steps of 200–320 ms (docs/BENCHMARKS.md, stops
17–18). A full (generation 2) collection walking the heap of a process holding torch, transformers and
Hydra is the suspect; ``gc.callbacks`` says when each collection starts and stops, so the harness can put
the longest one beside the longest step instead of guessing.
"""

from __future__ import annotations

import gc
import time
from contextlib import contextmanager


class CollectionLog:
    """Per generation, how many collections ran and their wall time, filled in by ``gc.callbacks``.

    ``stats`` is updated in place (``{"gen0": {"collections": n, "total_ms": t, "max_ms": m}, "gen1": ...,
    "gen2": ...}``): a results dict holding it reads the figures as they stand when it is written."""

    def __init__(self) -> None:
        self.stats = {f"gen{g}": {"collections": 0, "total_ms": 0.0, "max_ms": 0.0} for g in range(3)}
        self._start: float | None = None

    def __call__(self, phase: str, info: dict) -> None:
        # runs inside the interpreter's collection: arithmetic on a few numbers, nothing that can raise
        if phase == "start":
            self._start = time.perf_counter()
        elif phase == "stop" and self._start is not None:
            ms = (time.perf_counter() - self._start) * 1e3
            entry = self.stats[f"gen{min(int(info.get('generation', 2)), 2)}"]
            entry["collections"] += 1
            entry["total_ms"] += ms
            entry["max_ms"] = max(entry["max_ms"], ms)
            self._start = None


@contextmanager
def collections_logged():
    """Yields a :class:`CollectionLog` that counts and times every collection made inside the block."""
    log = CollectionLog()
    gc.callbacks.append(log)
    try:
        yield log
    finally:
        gc.callbacks.remove(log)
