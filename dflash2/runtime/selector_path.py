"""The DFlash2 candidate selector's paths with the per-position gathers hoisted out of the walk.

``CandidateSelector.greedy_path`` / ``sample_path`` walk the P drafted positions one after the
other (each edge score needs the token chosen before it) and at every position gather the
successor codebook rows of its k candidates, the predecessor row of the chosen token (after
gathering that token's id) and cast the pair term to fp32 before adding the unary term. Only
the choice depends on the previous position, so :class:`SelectorWalk` gathers the successor rows
of all positions and the predecessor rows of all candidates once, and a step of the walk is: the
chosen predecessor's row, the pair term, the score, the choice. The scores are the same float
operations on the same operands, bit for bit (tests/test_runtime_drafter.py, against the
reference decoder; tests/test_runtime_draft_math.py against the selector's own paths):

* the hidden projection stays one GEMM per position, as in ``edge_scores``: a GEMM over all
  positions at once may round differently (its row count changes the kernel);
* ``unary + pair`` lets type promotion cast the pair term to fp32 inside the add, the same
  exact conversion as ``pair.float()``.

Shapes: N rows, P drafted positions, k candidates, r selector rank, d hidden, V vocab.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dflash2.runtime.kernels import use_triton
from dflash2.runtime.kernels.selector import selector_walk
from dflash2.runtime.kernels.selector_sample import selector_sample_walk
from dflash2.runtime.kernels.topk import topk_rows
from dflash2.runtime.sampling import Proposal, sample


class SelectorWalk:
    """The selector's edge scores over one block, position by position.

    selector: a ``CandidateSelector``; hidden (N, P, d) the drafted hidden states; cand_ids (N, P, k)
    long / unary (N, P, k) fp32 = ``selector.candidates(logits)`` of the raw drafter logits; anchor (N,)
    long, the predecessor of position 0.
    """

    def __init__(self, selector, hidden: torch.Tensor, cand_ids: torch.Tensor, unary: torch.Tensor, anchor):
        self.selector, self.hidden = selector, hidden
        self.cand_ids, self.unary = cand_ids, unary
        self.succ = selector.successor_codebook[self.cand_ids]  # (N, P, k, r)
        self.pred_rows = selector.predecessor_codebook[self.cand_ids]  # (N, P, k, r): candidates as predecessors
        self.pred = selector.predecessor_codebook[anchor][:, None]  # (N, 1, r): the anchor's row

    @property
    def positions(self) -> int:
        return self.cand_ids.shape[1]

    def scores(self, pos: int) -> torch.Tensor:
        """Edge scores (N, k) fp32 from the chosen predecessor to the candidates of position pos."""
        sl = slice(pos, pos + 1)
        hh = self.selector.hidden_projection(self.hidden[:, sl])  # (N, 1, r)
        pair = torch.einsum("npr,npkr->npk", self.pred * hh, self.succ[:, sl])  # (N, 1, k)
        return (self.unary[:, sl] + pair)[:, 0]

    def choose(self, pos: int, choice: torch.Tensor) -> None:
        """Candidate ``choice`` (N,) long of position pos becomes the next position's predecessor."""
        if pos + 1 < self.positions:
            r = self.pred_rows.shape[-1]
            self.pred = self.pred_rows[:, pos].gather(1, choice[:, None, None].expand(-1, 1, r))

    def tokens(self, choices: list[torch.Tensor]) -> torch.Tensor:
        """The candidate ids of per-position choices (P of (N,) long) -> (N, P) long."""
        return self.cand_ids.gather(-1, torch.stack(choices, dim=1)[..., None])[..., 0]


def block_candidates(selector, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``selector.candidates(logits)``: cand_ids (N, P, k) long and unary (N, P, k) fp32 from logits (N, P, V).
    Where the kernels run, the top-k is the two-stage kernel (kernels/topk.py: ``torch.topk`` on a few
    vocabulary-long rows costs more than the drafter's GEMMs); it lists equal logits by index, where
    ``torch.topk``'s order is unspecified, so an exact tie may draft the other candidate."""
    if use_triton(logits):
        raw, cand_ids = topk_rows(logits, selector.top_k)
        return cand_ids, selector.unary(raw)
    return selector.candidates(logits)


@torch.no_grad()
def selector_greedy_path(selector, hidden: torch.Tensor, logits: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
    """``selector.greedy_path(hidden, logits, anchor)``: tokens (N, P) long. Bit for bit on the CPU; on CUDA
    (kernels on) the walk is two Triton launches (the pair tables, then the walk) after one GEMM of all
    positions' hidden projections."""
    return greedy_walk(selector, hidden, *block_candidates(selector, logits), anchor)


def greedy_walk(selector, hidden, cand_ids, unary, anchor) -> torch.Tensor:
    """The greedy walk from the candidates: :func:`~dflash2.runtime.kernels.selector.selector_walk` (one GEMM
    and two launches) where the kernels run, else the eager walk (one GEMM per position, as ``edge_scores``)."""
    if use_triton(hidden):
        hh = selector.hidden_projection(hidden)  # (N, P, r)
        return selector_walk(hh, cand_ids, unary, anchor, selector.predecessor_codebook, selector.successor_codebook)
    walk = SelectorWalk(selector, hidden, cand_ids, unary, anchor)
    choices = []
    for pos in range(walk.positions):
        choices.append(walk.scores(pos).argmax(-1))  # ties: the first maximum, the higher drafter logit
        walk.choose(pos, choices[-1])
    return walk.tokens(choices)


@torch.no_grad()
def selector_sample_sparse(selector, hidden, logits, anchor, temperature: float, generator=None) -> Proposal:
    """The selector's T>0 path with q kept sparse over its k candidates.

    hidden (N, P, d), logits (N, P, V) fp32, anchor (N,). Same draws in the same order as
    ``CandidateSelector.sample_path`` (position by position from softmax(edge scores / T) given the
    sampled predecessor), whose dense q is this proposal's ``densify``: bit for bit on the CPU; on CUDA
    (kernels on) the walk is two Triton launches (kernels/selector_sample.py: the pair tables, then the walk)
    after the same draws and one GEMM of all positions' hidden projections, its q the exact law of its own draws.
    """
    cand_ids, unary = block_candidates(selector, logits)
    if use_triton(hidden):
        # the races first, P draws of (N, k) in the order the walk below draws them (the generator advances
        # alike), then one GEMM of all positions' hidden projections and two launches for the walk
        N, P, k = cand_ids.shape
        fresh = [torch.empty(N, k, dtype=torch.float32, device=logits.device) for _ in range(P)]
        races = torch.stack([r.exponential_(1, generator=generator) for r in fresh])  # (P, N, k)
        hh, pcb, scb = selector.hidden_projection(hidden), selector.predecessor_codebook, selector.successor_codebook
        tokens, probs = selector_sample_walk(hh, cand_ids, unary, anchor, pcb, scb, temperature, races)
        return Proposal(tokens, cand_ids, probs)
    walk = SelectorWalk(selector, hidden, cand_ids, unary, anchor)
    choices, probs = [], []
    for pos in range(walk.positions):
        prob = F.softmax(walk.scores(pos) / temperature, dim=-1)  # (N, k)
        choices.append(sample(prob, generator))  # torch.multinomial's draw, without its sync
        walk.choose(pos, choices[-1])
        probs.append(prob)
    return Proposal(walk.tokens(choices), walk.cand_ids, torch.stack(probs, 1))
