"""DFlash2 candidate selector (ARCHITECTURE.md §3.2).

The drafter's top-1 accuracy decays along the block while the right token is almost
always in its top-k. The selector re-ranks the k candidates of every drafted position
with a pairwise term that looks at the chosen predecessor:

    score(l, p -> c) = unary[l, c] + Σ_r P[p, r] · Hh_l[r] · S[c, r]

with unary the drafter logit of c at position l (after the serving scales of
``scale_logits``, ARCHITECTURE.md §3.4), P / S the predecessor / successor codebooks
[V, r], Hh_l = hidden_projection(h_l) and p the token chosen at l-1 (the anchor at
l = 0). A path is walked from the anchor: greedy at T=0, sampled at T>0.

Shapes: N rows (blocks), P = B-1 drafted positions, k candidates, V vocab, r rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def scale_logits(logits: torch.Tensor, multiplier: float = 1.0, softcap: float | None = None) -> torch.Tensor:
    """The drafter's served logits: ``cap * tanh(multiplier * logits / cap)`` (no cap when None), fp32.

    Elementwise and increasing (multiplier > 0), so argmax and top-k *sets* are those of the raw
    logits. Same operations in the same order as vLLM's DFlash2 candidate scores (multiply, then
    cap), so the selector's unary terms agree with it bit for bit. Any shape.
    """
    x = logits.float()
    if multiplier != 1.0:
        x = x * multiplier
    if softcap is not None:
        x = torch.tanh(x / softcap) * softcap
    return x


class CandidateSelector(nn.Module):
    def __init__(
        self,
        vocab: int,
        hidden: int,
        rank: int = 256,
        top_k: int = 16,
        init_std: float = 0.02,
        output_multiplier: float = 1.0,
        final_logit_softcapping: float | None = None,
    ):
        super().__init__()
        self.vocab, self.rank, self.top_k = vocab, rank, top_k
        # applied to the top-k values only (what serving engines do): see ``candidates``
        self.output_multiplier, self.final_logit_softcapping = output_multiplier, final_logit_softcapping
        # Plain Parameters (not nn.Embedding) so the state-dict keys are exactly
        # candidate_selector.{predecessor,successor}_codebook (vLLM's names).
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab, rank))
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)
        self.init_std = init_std
        self.reset_parameters()

    def reset_parameters(self, generator: torch.Generator | None = None):
        # Small init: the pair term is a product of three ~0.02-scale factors, i.e. ~0,
        # so a fresh selector's path is the per-position argmax of the drafter.
        # generator: the selector's own random stream (dflash2.drafter.initialisation), drawn on the
        # CPU so that the values do not depend on the device; None = the global RNG.
        if self.predecessor_codebook.is_meta:  # built on "meta" to be loaded: nothing to init
            return
        with torch.no_grad():
            for p in (self.predecessor_codebook, self.successor_codebook, self.hidden_projection.weight):
                values = torch.empty(p.shape, dtype=torch.float32, device="cpu")  # not the ambient device
                values.normal_(0.0, self.init_std, generator=generator)
                p.copy_(values)

    @torch.no_grad()
    def zero_successor_(self) -> CandidateSelector:
        """Set the successor codebook to zero (a training option, ``drafter.selector_zero_successor_init``).

        The pair term Σ_r P[p, r]·Hh[r]·S[c, r] is then exactly 0, so every score is the drafter's
        logit and the greedy path is exactly the per-position argmax: a fresh selector changes no
        draft. Training still moves it: ∂loss/∂S[c] = P[p] ⊙ Hh · (softmax − onehot)[c] is not zero,
        and P and Hh receive gradient as soon as S is (the LoRA-B = 0 pattern).
        """
        self.successor_codebook.zero_()
        return self

    # ------------------------------------------------------------------ scoring
    def top_candidates(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Raw drafter logits (..., V) -> cand_ids (..., k) int64 and their raw logits (..., k), by raw logit desc.

        All the selector reads of the full logits besides the label's own logit, so training can
        hand it this pair computed chunk by chunk (dflash2/training/chunked_head.py) instead."""
        raw, cand_ids = torch.topk(logits, self.top_k, dim=-1)
        return cand_ids, raw

    def unary(self, raw: torch.Tensor) -> torch.Tensor:
        """Raw logits of candidates (any shape) -> the unary scores: ``scale_logits`` with the serving scales, fp32."""
        return scale_logits(raw, self.output_multiplier, self.final_logit_softcapping)

    def candidates(self, logits: torch.Tensor):
        """Raw drafter logits (N, P, V) -> cand_ids (N, P, k) sorted by logit desc, unary (N, P, k) fp32.

        Top-k of the *raw* logits, then ``scale_logits`` on the k values: the order engines use
        (a cap can make distinct raw logits equal; candidates keep the raw order, so ties in the
        scores still go to the higher raw logit)."""
        cand_ids, raw = self.top_candidates(logits)
        return cand_ids, self.unary(raw)

    def edge_scores(self, hidden, pred_ids, cand_ids, unary):
        """Edge scores from predecessor(s) to the k candidates.

        hidden (N, P, d); pred_ids (N, P) -> returns (N, P, k),
        or pred_ids (N, P, m) (m predecessors per position) -> returns (N, P, m, k).
        cand_ids / unary: (N, P, k). Scores are fp32 (they feed argmax / softmax).
        """
        hh = self.hidden_projection(hidden)  # (N, P, r)
        succ = self.successor_codebook[cand_ids]  # (N, P, k, r)
        pred = self.predecessor_codebook[pred_ids]  # (N, P, r) or (N, P, m, r)
        if pred_ids.dim() == 2:
            pair = torch.einsum("npr,npkr->npk", pred * hh, succ)  # (N, P, k)
            return unary.float() + pair.float()
        pair = torch.einsum("npmr,npkr->npmk", pred * hh[:, :, None, :], succ)  # (N, P, m, k)
        return unary.float()[:, :, None, :] + pair.float()

    def _step(self, hidden, cand_ids, unary, pos: int, pred: torch.Tensor) -> torch.Tensor:
        """Scores (N, k) at position pos from predecessors pred (N,)."""
        s = self.edge_scores(
            hidden[:, pos : pos + 1], pred[:, None], cand_ids[:, pos : pos + 1], unary[:, pos : pos + 1]
        )
        return s[:, 0]

    # ------------------------------------------------------------------ paths
    @torch.no_grad()
    def greedy_path(self, hidden, logits, anchor_ids) -> torch.Tensor:
        """T=0 path: at each l pick the argmax edge from the token chosen at l-1.

        hidden (N, P, d), logits (N, P, V), anchor_ids (N,) -> tokens (N, P).
        Ties go to the lowest candidate index (= higher drafter logit; torch.argmax
        returns the first maximum).
        """
        return self.greedy_path_from_top(hidden, *self.top_candidates(logits), anchor_ids)

    @torch.no_grad()
    def greedy_path_from_top(self, hidden, cand_ids, top_raw, anchor_ids) -> torch.Tensor:
        """``greedy_path`` from the top-k candidates instead of the full logits.

        hidden (N, P, d), cand_ids (N, P, k) and top_raw (N, P, k) from ``top_candidates``,
        anchor_ids (N,) -> tokens (N, P)."""
        unary = self.unary(top_raw)
        pred, out = anchor_ids, []
        for pos in range(cand_ids.shape[1]):
            best = self._step(hidden, cand_ids, unary, pos, pred).argmax(-1)  # (N,)
            pred = cand_ids[:, pos].gather(-1, best[:, None])[:, 0]
            out.append(pred)
        return torch.stack(out, dim=1)

    @torch.no_grad()
    def viterbi_path(self, hidden, logits, anchor_ids) -> torch.Tensor:
        """Exact argmax over all k^P paths of the summed edge scores (max-sum DP).

        For analysis (how much greedy loses); same shapes as ``greedy_path``.
        """
        cand_ids, unary = self.candidates(logits)
        P = cand_ids.shape[1]
        best = self._step(hidden, cand_ids, unary, 0, anchor_ids)  # (N, k) best path score ending in cand
        back = []
        if P > 1:
            # all pair scores at once: predecessors are the k candidates of pos-1
            pair = self.edge_scores(hidden[:, 1:], cand_ids[:, :-1], cand_ids[:, 1:], unary[:, 1:])
            for pos in range(1, P):
                tot = best[:, :, None] + pair[:, pos - 1]  # (N, k_prev, k)
                best, arg = tot.max(dim=1)  # (N, k), (N, k)
                back.append(arg)
        idx = best.argmax(-1)  # (N,) candidate index at the last position
        path = [idx]
        for arg in reversed(back):
            idx = arg.gather(-1, idx[:, None])[:, 0]
            path.append(idx)
        path = torch.stack(path[::-1], dim=1)  # (N, P) candidate indices
        return cand_ids.gather(-1, path[..., None])[..., 0]

    @torch.no_grad()
    def sample_path(self, hidden, logits, anchor_ids, temperature: float, generator=None):
        """T>0 path: sample position by position from softmax(edge scores / T) over
        the k candidates, given the *sampled* predecessor.

        Returns tokens (N, P) and q (N, P, V): q[:, l] is the exact distribution the
        token at l was drawn from, conditioned on the sampled prefix (zero outside the
        candidates). That conditional is what sequential rejection sampling (§4) needs:
        position l is only tested after positions < l were accepted, i.e. exactly
        when the target's prefix equals the sampled prefix.
        """
        assert temperature > 0, "use greedy_path for temperature 0"
        cand_ids, unary = self.candidates(logits)
        N, P, _ = cand_ids.shape
        q = torch.zeros(N, P, self.vocab, dtype=torch.float32, device=logits.device)
        pred, out = anchor_ids, []
        for pos in range(P):
            probs = torch.softmax(self._step(hidden, cand_ids, unary, pos, pred) / temperature, dim=-1)  # (N, k)
            pick = torch.multinomial(probs, 1, generator=generator)  # (N, 1)
            q[:, pos].scatter_(-1, cand_ids[:, pos], probs)  # candidates are distinct (top-k)
            pred = cand_ids[:, pos].gather(-1, pick)[:, 0]
            out.append(pred)
        return torch.stack(out, dim=1), q

    # ------------------------------------------------------------------ training
    def loss(
        self,
        hidden,
        logits,
        anchor_ids,
        labels,
        label_mask,
        weight=None,
        detach_hidden: bool = True,
        inject_gold: bool = False,
        weight_total=None,
    ):
        """Teacher-forced candidate-set cross-entropy.

        hidden (N, P, d), logits (N, P, V), anchor_ids (N,), labels (N, P) long,
        label_mask (N, P) bool, weight optional (P,) or (N, P) per-position weights
        (e.g. the drafter's w_k). Returns (loss scalar, stats dict of detached 0-d tensors: no host sync).
        ``weight_total``: maps the loss's Σw to the Σw it is divided by (default: itself; data-parallel
        training passes a global one, ``dflash2.drafter.objective.WeightTotal``).

        * Predecessor at l is the TRUE previous token (anchor at l=0, labels[l-1]
          after), as the path would be after l accepted tokens.
        * Candidates = top-k of logits.detach(); the unary term is the detached
          logit. Detached because the selector must not distort the drafter's own CE:
          the drafter logits are trained only by the drafter loss, the selector only
          learns the pairwise correction on top of them.
        * ``detach_hidden=True`` (default) also stops the selector gradient at the
          drafter hidden state, for the same reason: the selector is a pure head and a
          v2 drafter's backbone sees exactly the v1 objective. Pass False to let the
          pairwise term shape the backbone (a joint-training ablation).
        * CE over the k candidate scores with target = the label's candidate index.
          Where the label is outside the top-k: with ``inject_gold=False`` (default) the
          position is dropped, since no path can produce that label; with
          ``inject_gold=True`` the label is added as a (k+1)-th candidate (its own detached
          logit as unary) and is the CE target, so every labelled position trains the
          pair term, as peers' trainers do (ARCHITECTURE.md §3.2). Where the label is
          already a candidate the extra slot is masked out (-inf), so the CE is over the
          same k candidates in both modes.
        Stats: coverage (label in top-k, over label_mask), top1 (drafter argmax right),
        acc (selector argmax over the k real candidates right, teacher-forced), all over label_mask.
        """
        logits = logits.detach()
        safe = labels.masked_fill(~label_mask, 0)  # (N, P) in-vocab ids for indexing
        cand_ids, top_raw = self.top_candidates(logits)  # (N, P, k)
        label_raw = logits.gather(-1, safe[..., None])[..., 0]  # (N, P)
        return self.loss_from_top(
            hidden,
            cand_ids,
            top_raw,
            label_raw,
            anchor_ids,
            labels,
            label_mask,
            weight=weight,
            detach_hidden=detach_hidden,
            inject_gold=inject_gold,
            weight_total=weight_total,
        )

    def loss_from_top(
        self,
        hidden,
        cand_ids,
        top_raw,
        label_raw,
        anchor_ids,
        labels,
        label_mask,
        weight=None,
        detach_hidden: bool = True,
        inject_gold: bool = False,
        weight_total=None,
    ):
        """``loss`` from what it reads of the logits: cand_ids (N, P, k) and top_raw (N, P, k) from
        ``top_candidates``, and label_raw (N, P) the raw logit of each label (read only where
        label_mask is True and ``inject_gold``; any finite value elsewhere). Training's chunked
        head computes these without the (N, P, V) logits (dflash2/training/chunked_head.py).
        Other arguments, result and stats: ``loss``."""
        top_raw, label_raw = top_raw.detach(), label_raw.detach()
        if detach_hidden:
            hidden = hidden.detach()
        safe = labels.masked_fill(~label_mask, 0)  # (N, P) in-vocab ids for indexing
        pred_ids = torch.cat([anchor_ids[:, None], safe[:, :-1]], dim=1)  # (N, P)
        unary = self.unary(top_raw)  # (N, P, k)
        match = cand_ids == safe[..., None]  # (N, P, k)
        covered = match.any(-1) & label_mask  # (N, P)
        target = match.float().argmax(-1)  # (N, P), 0 where not covered
        if inject_gold:
            k = cand_ids.shape[-1]
            cand_ids = torch.cat([cand_ids, safe[..., None]], dim=-1)  # (N, P, k+1): the label last
            gold = self.unary(label_raw[..., None])  # the label's unary scaled like the top-k ones
            unary = torch.cat([unary, gold], dim=-1)
            target = torch.where(covered, target, torch.full_like(target, k))
        scores = self.edge_scores(hidden, pred_ids, cand_ids, unary)  # (N, P, k or k+1) fp32
        if inject_gold:  # the extra slot is a duplicate where the label is a candidate already
            dup = F.pad(covered[..., None], (k, 0))  # (N, P, k+1), True only in the last slot
            scores = scores.masked_fill(dup, float("-inf"))
        ce = F.cross_entropy(scores.flatten(0, 1), target.flatten(), reduction="none").view_as(target)
        w = (label_mask if inject_gold else covered).float()
        if weight is not None:
            w = w * weight.to(w.dtype).expand_as(w)
        total = w.sum() if weight_total is None else weight_total(w.sum())
        loss = (ce * w).sum() / total.clamp_min(1e-6)  # 0 (with a graph) when nothing is covered
        with torch.no_grad():
            m = label_mask.float()
            denom = m.sum().clamp_min(1.0)
            right = scores[..., : self.top_k].argmax(-1) == target  # what a path can pick
            stats = {
                "coverage": covered.float().sum() / denom,
                "top1": ((target == 0) & covered).float().sum() / denom,
                "acc": (right & covered).float().sum() / denom,
            }
        return loss, stats
