"""Proposals and T>0 acceptance on the runtime's path (docs/ARCHITECTURE.md §4).

Lossless rejection sampling needs q_i(x), the distribution draft i was drawn from.
The reference decoder always passes q as a dense (N, P, V) fp32 tensor; most drafts
never need one:

* argmax drafts (T=0 drafting under T>0 verification) have a point mass: one id, prob 1;
* the DFlash2 selector samples among its k candidates: k ids and their probabilities;
* only a drafter sampling the full warped vocabulary has a dense q.

:class:`Proposal` carries q in whichever of these forms the drafter produced, and
:func:`rejection_accept_proposal` is the reference ``rejection_accept`` for all of
them: the same random draws in the same order and the same float operations, so for
one generator state it returns exactly what the reference returns on the densified q.
Nothing here reads back to the host: :func:`sample` is ``torch.multinomial``'s draw
without its validation sync.

Shapes: N rows, P = B-1 drafted positions, k candidates per position, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Proposal:
    """The drafts of one step and, at T>0, the exact distribution each was drawn from.

    tokens: (N, P) long drafts.
    ids, probs: (N, P, k) long / fp32, sparse q: q[n, i] puts probs[n, i, j] on ids[n, i, j] and zero
        elsewhere (ids distinct within a position). Point mass: k = 1, probs 1.
    dense: (N, P, V) fp32 q, only when the drafter sampled the full vocabulary.
    All three None: greedy drafts at T=0 (acceptance needs no q).
    """

    tokens: torch.Tensor
    ids: torch.Tensor | None = None
    probs: torch.Tensor | None = None
    dense: torch.Tensor | None = None

    @classmethod
    def point_mass(cls, tokens: torch.Tensor) -> Proposal:
        """Deterministic drafts (N, P) as a sparse q of one id with probability 1."""
        return cls(tokens, tokens[..., None], torch.ones(*tokens.shape, 1, device=tokens.device))

    def densify(self, vocab_size: int) -> torch.Tensor:
        """q as (N, P, V) fp32 (for tests and the reference path); greedy drafts give their point mass."""
        if self.dense is not None:
            return self.dense
        sparse = self if self.ids is not None else Proposal.point_mass(self.tokens)
        out = torch.zeros(*sparse.ids.shape[:-1], vocab_size, dtype=torch.float32, device=self.tokens.device)
        return out.scatter_(-1, sparse.ids, sparse.probs.float())


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """probs (..., V) -> tokens (...) long, one draw per row, with no host sync.

    ``torch.multinomial(probs, 1)`` draws argmax(probs / E) with E ~ Exp(1) i.i.d. (the exponential
    race, P(argmax = x) = probs[x] / Σ probs), but first reads max/min/sum of probs back to the host
    to validate them: a sync per call. This is the same computation without the validation, hence
    the same draw for the same generator state (tests check it against the reference ``sample``).
    """
    race = torch.empty_like(probs).exponential_(1, generator=generator)
    return (probs / race).argmax(-1)


def rejection_accept_proposal(
    p: torch.Tensor, proposal: Proposal, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """T>0 lossless acceptance of a batch (the math of ``decoding.sampling.rejection_accept``).

    p (N, P+1, V) warped target probabilities at the verify positions; proposal: drafts (N, P) and
    their q, sparse (ids, probs), dense, or none (argmax drafts: a point mass). Returns
    (num_accepted (N,) long in [0, P], next_token (N,) long): accept d_i with probability
    min(1, p_i(d_i) / q_i(d_i)); at the first rejection draw from norm(max(0, p_i − q_i)); after a
    full accept draw the bonus from p_P. A sparse q is subtracted at its k ids only, never densified.
    Same random draws in the same order and the same float operations as the reference, so for one
    generator state the result is the reference's on the densified q; no host sync.
    (The engine's accept runs kernels/sampled_accept.py instead: the same draws, the residual left
    unnormalised; see there.)
    """
    proposal = with_q(proposal)
    u = torch.rand(proposal.tokens.shape, generator=generator, device=p.device, dtype=torch.float32)
    a = accepted_prefix(p, proposal, u)
    resid, p_a = residual(p, proposal, a)
    mass = resid.sum(-1, keepdim=True)
    # mass == 0 only when p_a == q_a, where a rejection has probability 0 (rounding): fall back to p
    resid = torch.where(mass > 0, resid / mass.clamp_min(1e-30), p_a)
    return a, sample(resid, generator)


# ----------------------------------------------------------------------------- its pieces
def with_q(proposal: Proposal) -> Proposal:
    """The proposal with a q: argmax drafts (no q) become point masses (k = 1)."""
    if proposal.dense is None and proposal.ids is None:
        return Proposal.point_mass(proposal.tokens)
    return proposal


def accept_noise(p: torch.Tensor, P: int, generator: torch.Generator | None = None):
    """The random draws of one T>0 accept, in :func:`rejection_accept_proposal`'s order and shapes, so that
    a generator advances alike on either path: the uniforms u (N, P) fp32, then the exponential race
    (N, V) fp32 of the bonus draw (:func:`sample` on an (N, V) fp32 residual). p (N, P+1, V)."""
    N, V = p.shape[0], p.shape[-1]
    u = torch.rand((N, P), generator=generator, device=p.device, dtype=torch.float32)
    race = torch.empty((N, V), device=p.device, dtype=torch.float32).exponential_(1, generator=generator)
    return u, race


def accepted_prefix(p: torch.Tensor, proposal: Proposal, u: torch.Tensor) -> torch.Tensor:
    """a (N,) long in [0, P]: drafts accepted while u_i · q_i(d_i) < p_i(d_i) (accept with prob min(1, p/q)).

    p (N, P+1, V); proposal with a q (:func:`with_q`); u (N, P) fp32 uniforms."""
    drafts, q = proposal.tokens, proposal.dense
    P = drafts.shape[-1]
    px = p[..., :P, :].gather(-1, drafts[..., None])[..., 0]  # (N, P) p_i(d_i)
    if q is not None:
        qx = q.gather(-1, drafts[..., None])[..., 0]  # (N, P) q_i(d_i)
    else:
        qx = (proposal.probs.float() * (proposal.ids == drafts[..., None])).sum(-1)  # exactly one id matches
    return (u * qx < px).long().cumprod(dim=-1).sum(dim=-1)


def residual(p: torch.Tensor, proposal: Proposal, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bonus's unnormalised law max(0, p_a − q_a) (N, V) fp32, and p_a (N, V) fp32 itself.

    p (N, P+1, V); proposal with a q; a (N,) accepted drafts. After a full accept (a == P) q is zero
    there and the residual is p_P. Each entry is one fp32 subtraction (p − 0 = p off a sparse q's ids)."""
    P, V = proposal.tokens.shape[-1], p.shape[-1]
    p_a = p.float().gather(-2, a[:, None, None].expand(-1, 1, V))[:, 0]  # (N, V)
    if P == 0:  # no drafts (an AR step): no q to gather from
        return p_a.clamp_min(0.0), p_a
    at, keep = a.clamp(max=max(P - 1, 0))[:, None, None], (a < P)[:, None]
    if proposal.dense is not None:
        resid = p_a - proposal.dense.float().gather(-2, at.expand(-1, 1, V))[:, 0] * keep
    else:
        k = proposal.ids.shape[-1]
        ids_a = proposal.ids.gather(-2, at.expand(-1, 1, k))[:, 0]  # (N, k)
        probs_a = proposal.probs.float().gather(-2, at.expand(-1, 1, k))[:, 0] * keep
        resid = p_a.scatter_add(-1, ids_a, -probs_a)  # p_a − q_a: only k entries change
    return resid.clamp_min(0.0), p_a
