"""Reference lossless speculative decoding with a DFlash block drafter (ARCHITECTURE.md §2.7, §4, §5).

Plain PyTorch over the HF target: the correctness reference that the Triton
runtime is tested against. One step, per sequence:

1. the drafter runs once over ``[anchor, MASK × (B-1)]`` at positions n .. n+B-1
   (its cache holds only context K/V, so nothing to crop afterwards) -> B-1 drafts;
2. the target verifies ``[anchor, d_1 .. d_{B-1}]`` in one forward with its cache;
3. acceptance (§4): T=0 the longest prefix with d_i == target argmax, plus the
   target's argmax after it; T>0 rejection sampling against the drafter's q;
4. commit anchor + accepted drafts to the target cache (crop attention KV,
   restore + replay GDN states: ``target_state``), append their target taps to
   the drafter's context, and the emitted bonus becomes the next anchor.

τ of a step = accepted + 1 (the bonus). Stops at EOS (kept, nothing after it) or
``max_new_tokens`` (the last step's tokens are truncated to fit).

Batching: the drafter runs batched (its ``ContextCache`` keeps per-row lengths);
the *target* keeps one HF cache per sequence and verifies row by row, because
rows accept different lengths and HF caches cannot hold ragged lengths (nor can
GDN states absorb padding). Cost: N target forwards (+ N replays on hybrids) per
step instead of one — fine for measuring τ and checking losslessness, not for
speed (that is the runtime's job).

Shapes: N rows, P prompt length, B block size, V vocab, K·d concatenated taps.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from dflash2.decoding.sampling import SamplingParams, greedy_accept, point_mass, rejection_accept, sample, warp_probs
from dflash2.decoding.target_state import rollback, snapshot
from dflash2.drafter.from_target import check_drafter_matches_target
from dflash2.drafter.model import ContextCache, DFlashDrafter
from dflash2.errors import DFlash2Error


# ------------------------------------------------------------------ proposers
class Proposer(Protocol):
    """What the decoder needs from a drafter (a DFlash drafter, or a test stub such as an oracle)."""

    block_size: int

    def add_context(self, taps: torch.Tensor, positions: torch.Tensor, num_valid: torch.Tensor) -> None:
        """taps (N, l, K·d) target features at positions (N, l); row n keeps the first num_valid[n]."""

    def propose(
        self,
        anchor_ids: torch.Tensor,
        anchor_pos: torch.Tensor,
        params: SamplingParams,
        generator: torch.Generator | None,
    ):
        """anchor_ids, anchor_pos (N,) -> (drafts (N, B-1) long, q (N, B-1, V) fp32 or None).

        q is the exact distribution each draft was drawn from (None = argmax drafts, a point mass)."""


class DFlashProposer:
    """A ``DFlashDrafter`` + its context cache, reading the target's frozen embedding and LM head."""

    def __init__(self, drafter: DFlashDrafter, target):
        check_drafter_matches_target(drafter.config, target)  # vocab / width / depth
        if list(target.target_layer_ids) != list(drafter.config.target_layer_ids):
            raise DFlash2Error(
                f"the drafter reads target layers {drafter.config.target_layer_ids} but the target taps "
                f"{target.target_layer_ids}; load the target with target_layer_ids="
                f"{drafter.config.target_layer_ids}"
            )
        self.drafter, self.target = drafter, target
        self.block_size = drafter.config.block_size
        self.cache = ContextCache()
        self._dtype = next(drafter.parameters()).dtype
        head_dtype = target.lm_head.weight.dtype
        self._lm_head = lambda h: target.lm_head(h.to(head_dtype))  # drafter may run in another dtype

    @torch.no_grad()
    def add_context(self, taps, positions, num_valid):
        c = self.drafter.fuse_context(taps.to(self._dtype))  # (N, l, d)
        self.cache.append(self.drafter, c, positions, num_valid)

    @torch.no_grad()
    def propose(self, anchor_ids, anchor_pos, params, generator):
        N, B = anchor_ids.shape[0], self.block_size
        ids = torch.full((N, B), self.drafter.config.mask_token_id, dtype=torch.long, device=anchor_ids.device)
        ids[:, 0] = anchor_ids  # block = [anchor, MASK × (B-1)]
        positions = anchor_pos[:, None] + torch.arange(B, device=anchor_ids.device)  # (N, B)
        embeds = self.drafter.embed_block(ids, self.target.embed_tokens).to(self._dtype)  # (N, B, d)
        hidden = self.drafter.draft_block(embeds, positions, self.cache)  # (N, B, d)
        if params.greedy:
            return self.drafter.drafted_tokens(hidden, self._lm_head, anchor_ids), None
        if self.drafter.candidate_selector is not None:
            # The selector's sampled path returns its own exact q (temperature applied over its
            # top-k candidates); top_k/top_p cannot be re-applied after the draw, and need not be
            # for losslessness: any exact q is lossless under rejection sampling.
            return self.drafter.drafted_tokens(hidden, self._lm_head, anchor_ids, params.temperature, generator)
        logits = self.drafter.block_logits(hidden[:, 1:], self._lm_head)  # (N, B-1, V) with the serving scales
        q = warp_probs(logits, params)  # same warp as the target's p
        return sample(q, generator), q


def as_proposer(drafter, target) -> Proposer:
    if isinstance(drafter, DFlashDrafter):
        return DFlashProposer(drafter, target)
    if hasattr(drafter, "propose") and hasattr(drafter, "add_context"):
        return drafter
    raise TypeError(f"drafter must be a DFlashDrafter or a Proposer, got {type(drafter).__name__}")


# ------------------------------------------------------------------ results
@dataclass
class SpecResult:
    """sequences[n]: generated ids of row n (prompt excluded; EOS kept, nothing after it).
    accepted[n]: accepted drafts per verify step of row n (τ of the step = value + 1; the
    last step's emitted tokens may have been truncated by EOS / max_new_tokens).
    steps[n]: verify steps of row n. block_size: B."""

    sequences: list[list[int]]
    accepted: list[list[int]]
    block_size: int
    steps: list[int] = field(init=False)

    def __post_init__(self):
        self.steps = [len(a) for a in self.accepted]

    @property
    def mean_tau(self) -> float:
        """Tokens per verify step including the bonus, over all rows' steps (nan without steps)."""
        steps = sum(self.steps)
        return sum(a + 1 for acc in self.accepted for a in acc) / steps if steps else float("nan")


# ------------------------------------------------------------------ helpers
def _rows(prompt_ids, device) -> list[torch.Tensor]:
    """(N, P) tensor or list of lists -> list of 1-D long tensors (each non-empty)."""
    if isinstance(prompt_ids, torch.Tensor):
        rows = list(prompt_ids[None] if prompt_ids.dim() == 1 else prompt_ids)
    else:
        rows = [torch.as_tensor(list(r), dtype=torch.long) for r in prompt_ids]
    if not rows:
        raise DFlash2Error("no prompts to decode; pass at least one prompt")
    if any(r.numel() == 0 for r in rows):
        raise DFlash2Error("a prompt is empty; every prompt needs at least one token")
    return [r.to(device=device, dtype=torch.long) for r in rows]


def _eos_set(eos_token_id) -> set[int]:
    if eos_token_id is None:
        return set()
    if isinstance(eos_token_id, int):
        return {eos_token_id}
    return {int(e) for e in eos_token_id}


def _finish(tokens: list[int], budget: int, eos: set[int]) -> tuple[list[int], bool]:
    """Cut a step's tokens after the first EOS and to the remaining budget; return (tokens, done)."""
    for j, t in enumerate(tokens):
        if t in eos:
            tokens = tokens[: j + 1]
            break
    tokens = tokens[:budget]
    return tokens, (len(tokens) == budget) or (bool(tokens) and tokens[-1] in eos)


def _choose(logits: torch.Tensor, params: SamplingParams, generator) -> torch.Tensor:
    """logits (..., V) -> token (...): argmax at T=0, else a draw from the warped p."""
    return logits.argmax(-1) if params.greedy else sample(warp_probs(logits, params), generator)


def _device(target) -> torch.device:
    return target.embed_tokens.weight.device


# ------------------------------------------------------------------ decoding
@torch.no_grad()
def greedy_generate(target, prompt_ids, max_new_tokens: int, eos_token_id=None) -> list[list[int]]:
    """The plain target baseline: KV-cached greedy decoding, one token per forward, row by row.

    prompt_ids (N, P) or a list of N id lists -> N lists of generated ids (EOS kept, then stop).
    """
    eos = _eos_set(eos_token_id)
    outs = []
    for ids in _rows(prompt_ids, _device(target)):
        out, gen = target(ids[None], use_cache=True), []
        cache = out.past_key_values
        while len(gen) < max_new_tokens:
            tok = int(out.logits[0, -1].argmax())
            gen.append(tok)
            if tok in eos or len(gen) == max_new_tokens:
                break
            out = target(torch.tensor([[tok]], device=ids.device), past_key_values=cache, use_cache=True)
            cache = out.past_key_values
        outs.append(gen)
    return outs


@torch.no_grad()
def speculative_generate(
    target,
    drafter,
    prompt_ids,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_token_id: int | Iterable[int] | None = None,
    generator: torch.Generator | None = None,
) -> SpecResult:
    """Lossless speculative decoding of ``target`` with ``drafter`` (a DFlashDrafter or a Proposer).

    prompt_ids: (N, P) long tensor or N lists of ids (lengths may differ).
    At temperature 0 the output equals :func:`greedy_generate` token for token; at
    T>0 every token follows the target's warped distribution (§4).
    """
    params = SamplingParams(float(temperature), int(top_k), float(top_p))
    if max_new_tokens < 0:
        raise DFlash2Error(f"max_new_tokens={max_new_tokens} must be >= 0")
    device = _device(target)
    rows = _rows(prompt_ids, device)
    N, eos = len(rows), _eos_set(eos_token_id)
    proposer = as_proposer(drafter, target)
    B = proposer.block_size
    seqs: list[list[int]] = [[] for _ in range(N)]
    accepted: list[list[int]] = [[] for _ in range(N)]
    if max_new_tokens == 0:
        return SpecResult(seqs, accepted, B)

    # ---- prefill: each row's cache, first token (the first anchor), taps of the prompt positions
    caches, taps, anchor, active = [], [], torch.zeros(N, dtype=torch.long, device=device), [True] * N
    for n, ids in enumerate(rows):
        out = target(ids[None], use_cache=True)
        caches.append(out.past_key_values)
        taps.append(out.taps[0])  # (P_n, K·d)
        anchor[n] = _choose(out.logits[0, -1], params, generator)
        seqs[n], done = _finish([int(anchor[n])], max_new_tokens, eos)
        active[n] = not done
    lengths = torch.tensor([r.numel() for r in rows], device=device)
    padded = torch.nn.utils.rnn.pad_sequence(taps, batch_first=True)  # (N, P_max, K·d)
    proposer.add_context(padded, torch.arange(padded.shape[1], device=device).expand(N, -1), lengths)
    pos = lengths.clone()  # (N,) position of each row's anchor

    # ---- speculative steps
    while any(active):
        drafts, q = proposer.propose(anchor, pos, params, generator)  # (N, B-1), (N, B-1, V) | None
        new_taps = padded.new_zeros(N, B, padded.shape[-1])
        n_new = torch.zeros(N, dtype=torch.long, device=device)
        for n in (i for i in range(N) if active[i]):
            block = torch.cat([anchor[n : n + 1], drafts[n]])[None]  # (1, B) = [anchor, d_1 .. d_{B-1}]
            snap = snapshot(caches[n], target.layer_types)  # GDN clones; just the length for attention
            out = target(block, past_key_values=caches[n], use_cache=True)
            a, nxt = _accept(out.logits[0], drafts[n], None if q is None else q[n], params, generator)
            accepted[n].append(a)
            emitted, done = _finish([*drafts[n, :a].tolist(), nxt], max_new_tokens - len(seqs[n]), eos)
            seqs[n] += emitted
            if done:  # finished rows are never touched again: skip their rollback
                active[n] = False
                continue
            rollback(target, caches[n], snap, block, keep=a + 1)  # cache = prefix + anchor + accepted
            new_taps[n, : a + 1] = out.taps[0, : a + 1]  # target features of the committed positions
            n_new[n] = a + 1
            anchor[n] = nxt
        if any(active):
            proposer.add_context(new_taps, pos[:, None] + torch.arange(B, device=device), n_new)
            pos = pos + n_new
    return SpecResult(seqs, accepted, B)


def _accept(
    logits: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor | None, params: SamplingParams, generator
) -> tuple[int, int]:
    """One row: logits (B, V) of the verify pass, drafts (B-1,), q (B-1, V) or None -> (accepted, next token)."""
    if params.greedy:
        a, nxt = greedy_accept(logits.argmax(-1), drafts)
    else:
        p = warp_probs(logits, params)  # (B, V)
        q = point_mass(drafts, p.shape[-1]) if q is None else q
        a, nxt = rejection_accept(p, q, drafts, generator)
    return int(a), int(nxt)  # the one host sync of the step
