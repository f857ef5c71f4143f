"""CUDA graphs of the runtime target's fixed-shape steps (docs/ARCHITECTURE.md §6).

A batch-1 decode step of a small or mid-size model is launch-bound: hundreds of tiny
kernels, each waiting for the CPU to issue it. A CUDA graph records one step's kernels
once and replays them with a single launch. :class:`GraphedTarget` wraps a runtime
target and does that for every forward whose shape is fixed — the AR step (N, 1) and
the verify step (N, B) — keyed by (state, T, kv_len, taps buffer): one graph per batch
size (the state's, i.e. its batch bucket), block length and attended-cache bucket.
Prefill (variable length, ``logits_index``) and CPU tensors run eagerly.

What makes the forward capturable (increment 1's design): every cache lives at a fixed
address (KVCache, GDNState, lengths, the drafter's taps buffer), the step's metadata
is computed on the device from ``state.lengths``, and nothing reads back to the host.
The graph's inputs are a static token buffer (copied into before each replay) and
those caches; its outputs are the logits tensor allocated during capture (overwritten
by the next replay of the same graph: read it before then) and the taps written into
the caller's buffer. GDN layers log (k, u, g, x) for the commit into tensors allocated
during capture; after each replay the wrapper points ``state.gdn.logs`` back at them,
so ``state.commit(n)`` (eager) folds exactly what the replay computed.

Graphs live as long as their state (a weak-keyed cache): allocate states once per batch
bucket and reuse them to capture once.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from dflash2.runtime.models.base import ModelOutput

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


def batch_bucket(n: int, buckets=BATCH_BUCKETS) -> int:
    """The smallest bucket ≥ n (n itself beyond the largest): the batch size a graphed state is allocated with."""
    return next((b for b in buckets if b >= n), n)


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    tokens: torch.Tensor  # (N, T) long, static input
    logits: torch.Tensor  # (N, T, V), static output
    taps: torch.Tensor | None  # the caller's taps buffer, or one allocated in the graph's pool
    gdn_logs: list | None  # GDNLog per GDN layer, filled by each replay


class GraphedTarget:
    """A runtime target whose fixed-shape forwards are CUDA-graph replays; everything else is delegated.

    ``graphed(tokens, state, taps_out=..., kv_len=...)`` has the model's signature and result. A new
    (state, T, kv_len, taps buffer) is captured on first use (after ``warmup`` eager runs on a side
    stream, which write only past the committed lengths, as any forward does).
    """

    def __init__(self, model, *, warmup: int = 2):
        self.model, self.warmup = model, warmup
        self.captures = 0  # graphs captured so far (they are dropped with their states)
        self._graphs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # state -> {key: _Captured}

    def __getattr__(self, name):  # embed, lm_head, vocab_size, new_state, ...: the wrapped model's
        if name == "model":  # not set yet (copy / unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.model, name)

    @property
    def num_graphs(self) -> int:
        """Graphs alive now (those of states still referenced)."""
        return sum(len(v) for v in self._graphs.values())

    @torch.no_grad()
    def __call__(self, tokens, state, *, taps_out=None, logits_index=None, kv_len=None) -> ModelOutput:
        if not tokens.is_cuda or logits_index is not None:
            return self.model(tokens, state, taps_out=taps_out, logits_index=logits_index, kv_len=kv_len)
        taps_key = None if taps_out is None else (taps_out.data_ptr(), tuple(taps_out.shape), taps_out.stride())
        key = (tuple(tokens.shape), kv_len, taps_key)
        per_state = self._graphs.setdefault(state, {})
        step = per_state.get(key)
        if step is None:
            step = per_state[key] = self._capture(tokens, state, taps_out, kv_len)
        step.tokens.copy_(tokens)
        step.graph.replay()
        if step.gdn_logs is not None:
            state.gdn.logs = list(step.gdn_logs)  # the commit folds what this replay logged
        return ModelOutput(step.logits, step.taps)

    def _capture(self, tokens, state, taps_out, kv_len) -> _Captured:
        static = tokens.clone()
        # warm-up on a side stream (cuBLAS / SDPA workspaces are created outside the capture)
        side = torch.cuda.Stream(device=tokens.device)
        side.wait_stream(torch.cuda.current_stream(tokens.device))
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                self.model(static, state, taps_out=taps_out, kv_len=kv_len)
        torch.cuda.current_stream(tokens.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self.model(static, state, taps_out=taps_out, kv_len=kv_len)
        logs = list(state.gdn.logs) if state.gdn is not None else None
        self.captures += 1
        return _Captured(graph, static, out.logits, out.taps, logs)
