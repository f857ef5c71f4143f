"""Bucketed prefill: short prompts padded to a bucket width, at fixed addresses, so a slot can graph its prefill.

Why (docs/ARCHITECTURE.md §6): decode steps are CUDA graphs, but the prefill ran eagerly, and for a short
prompt it is bound by the host, not the GPU: on an H200, at the trained pair's shape (random weights, 90M
hybrid target, 64 tokens), the prefill took 10–18 ms of wall for about 1.1 ms of kernels (≈130 kernel
launches, many Triton, plus hundreds of aten ops), once per generation, in AR and speculative decoding
alike. A graph replays all of it in one launch, but needs fixed shapes and addresses: the right-padded
prompt ids are padded further to a bucket width W and copied, with the lengths, into buffers the slot keeps
(:class:`PrefillBuffers`), and one graph per (slot, W, AR or speculative) runs the forward, the commit and,
speculative, the drafter's context append, leaving the last prompt token's logits in a slot buffer.

Padding is already in ``step.prefill``'s contract: row r commits its own lengths[r] tokens, so the padding
only writes K/V past the row's length (never read, overwritten later) and never enters a GDN state (the
fold takes lengths[r] tokens); the drafter's append keeps lengths[r] taps the same way. A padded prefill
therefore leaves the same state and logits as the unpadded one (bit for bit on the CPU:
tests/test_runtime_prefill.py); what padding costs is the padded tokens' compute, small while the prefill
is launch-bound.

Buckets: powers of two from 16 (16, 32, 64, ...). Why powers of two: the number of graphs per slot grows
with log2 of the longest graphed prompt (each graph keeps its own kernels and pool memory) and a prompt is
padded by less than 2×, which costs little where the prefill is launch-bound. Why 16 at the least: prompts
of up to 16 tokens run the Triton decode-attention kernel and longer ones SDPA (``cache.TRITON_MAX_T``),
and native GDN states store a state per position up to 16 tokens (``gdn_state.NATIVE_MAX_TOKENS``): with
16 a bucket boundary, padding never moves a prompt from one kernel to the other. (Multiples of 64 would pad
long prompts less but send a 10-token prompt through SDPA instead of the decode kernel.)

Shapes: Nb slot rows, P padded prompt width, W bucket width ≥ P, V vocabulary, K·d taps.
"""

from __future__ import annotations

import torch

from dflash2.runtime.step import prefill

MIN_BUCKET = 16  # = cache.TRITON_MAX_T = gdn_state.NATIVE_MAX_TOKENS: see the module docstring


def prefill_bucket(width: int, minimum: int = MIN_BUCKET) -> int:
    """The bucket of a prompt batch ``width`` tokens wide: the smallest power of two ≥ max(width, minimum)."""
    if width < 1:
        raise ValueError(f"prompt width {width} must be ≥ 1")
    return max(minimum, 1 << (width - 1).bit_length())


def pad_to_bucket(ids: torch.Tensor, width: int, pad_id: int = 0) -> torch.Tensor:
    """ids (N, P) right-padded prompts -> (N, width) with ``pad_id`` after column P (width ≥ P).

    The pad token is never committed (prefill's per-row lengths), so its value does not matter."""
    N, P = ids.shape
    if width < P:
        raise ValueError(f"bucket width {width} is narrower than the prompts ({P} tokens)")
    return torch.cat([ids, ids.new_full((N, width - P), pad_id)], dim=1) if width > P else ids


class PrefillBuffers:
    """One slot's fixed-address prefill inputs and output (made once per slot, eagerly: never inside a capture).

    lengths (Nb,) long, the rows' prompt lengths; logits (Nb, V) in the LM head's dtype, the last prompt
    token's logits of the latest prefill; per bucket width W: ids (Nb, W) long. What the phase reads after
    the host wrote it and what the host reads after the phase: nothing else needs a fixed address (the
    prompt's taps, written by the target and read by the drafter's append inside the same phase, are a
    temporary of it, in the graph pool when captured, instead of an (Nb, W, K·d) buffer kept per width).
    """

    def __init__(self, model, batch: int):
        head = model.lm_head.weight  # F.linear's output has its input's dtype, which is the head's
        self.lengths = torch.zeros(batch, dtype=torch.long, device=head.device)
        self.logits = torch.zeros(batch, head.shape[0], dtype=head.dtype, device=head.device)
        self._ids: dict[int, torch.Tensor] = {}

    @property
    def widths(self) -> list[int]:
        """The bucket widths this slot has prefilled at (one graph each when graphs are on)."""
        return sorted(self._ids)

    def load(self, ids: torch.Tensor, lengths: torch.Tensor, width: int) -> torch.Tensor:
        """Copy ids (Nb, P ≤ width), padded to ``width``, and lengths (Nb,) into the buffers; returns the ids buffer."""
        buf = self._ids.get(width)
        if buf is None:
            buf = self._ids[width] = torch.zeros(ids.shape[0], width, dtype=torch.long, device=ids.device)
        buf.copy_(pad_to_bucket(ids, width))
        self.lengths.copy_(lengths)
        return buf


def bucketed_prefill(slot, model, drafter, ids: torch.Tensor, lengths: torch.Tensor, width: int) -> torch.Tensor:
    """The prefill of ``slot`` (an engine Slot) at bucket ``width``, through the slot's PhaseGraphs.

    ids (Nb, P ≤ width) right-padded prompts, lengths (Nb,) long. drafter: the speculative path (its context
    gets the prompt's taps: ``drafter.append``), None for AR (no taps computed). Returns the last prompt
    token's logits (Nb, V): the slot's buffer, valid until its next prefill. With graphs enabled the phase
    ("prefill", width, speculative) runs eagerly on its first use, is captured on its second and replayed
    afterwards (graphs.PhaseGraphs); without, it always runs eagerly (the same padded computation: CPU tests).
    Inside it nothing reads a value back to the host and no shape depends on one: the per-row lengths stay on
    the device (the logits' gather, the commit, the append), and every shape follows (Nb, width).
    """
    if getattr(slot, "prefill", None) is None:
        slot.prefill = PrefillBuffers(model, slot.batch)
    bufs = slot.prefill
    tokens = bufs.load(ids, lengths, width)
    spec = drafter is not None

    def run() -> None:
        taps = None  # speculative: the prompt's taps (Nb, width, K·d), for the drafter's context
        if spec and slot.ctx.taps is not None:
            taps = slot.ctx.taps.new_empty(slot.batch, width, slot.ctx.taps.shape[-1])
        logits = prefill(model, slot.state, tokens, bufs.lengths, taps_out=taps, taps=spec)
        if spec:
            drafter.append(slot.ctx, taps, bufs.lengths)
        bufs.logits.copy_(logits)

    slot.graphs.run(("prefill", width, spec), run)
    return bufs.logits
