"""The pieces of one decoding step, as small functions on tensors (docs/ARCHITECTURE.md §4).

A speculative step is prefill (once) then, per step: draft (drafter.py), :func:`verify`,
accept (:func:`accept_greedy` / :func:`accept_sampled`), :func:`commit` and :func:`emit`;
engine.py strings them together. An AR step is the same with no drafts (P = 0).

A verify step feeds each row the block ``[anchor, d_1 .. d_P]`` (P = B-1 drafts; the
anchor is the last emitted token, not yet in the target's caches). At T=0 row r accepts
the longest prefix of drafts that equal the target's argmaxes, a[r]; at T>0 rejection
sampling decides a[r] (sampling.py). Either way it then emits ``d_1 .. d_a, bonus`` where
the bonus is the target's token after d_a (the correction at the first rejection, or
the extra token after a full accept), commits ``a + 1`` block tokens (anchor + accepted
drafts) to the target state and the drafter context, and the bonus becomes its next
anchor. At T=0 the emitted tokens are exactly what greedy decoding of the target emits.

Rows are ragged: each has its own a[r], its emission stops at its first EOS, at its
token budget, and rows that are no longer active emit and commit nothing. There is
no loop over rows and no host sync in any of these functions; the engine reads one
small tensor back per step for its loop condition.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash2.decoding.sampling import SamplingParams, warp_probs
from dflash2.runtime.sampling import Proposal, rejection_accept_proposal, sample


@dataclass
class Acceptance:
    """Outcome of one verify step for N rows of a block of B = P + 1 tokens.

    num_accepted: (N,) long in [0, P], drafts accepted (0 for inactive rows).
    commit:       (N,) long, block tokens to commit to the target state: a + 1, 0 for inactive rows.
    tokens:       (N, B) long, emitted tokens d_1 .. d_a, bonus in the first num_emitted places (then pad).
    num_emitted:  (N,) long in [0, B]: a + 1, cut after the first EOS and at the budget; 0 if inactive.
    next_anchor:  (N,) long, the bonus token: the next block's first input.
    finished:     (N,) bool, the row emitted EOS or used up its budget this step (or was inactive).
    """

    num_accepted: torch.Tensor
    commit: torch.Tensor
    tokens: torch.Tensor
    num_emitted: torch.Tensor
    next_anchor: torch.Tensor
    finished: torch.Tensor


def eos_ids(eos_token_id, device) -> torch.Tensor | None:
    """None, an id or several ids -> (E,) long on ``device`` (built once per generation, not per step)."""
    if eos_token_id is None:
        return None
    if isinstance(eos_token_id, torch.Tensor):
        return eos_token_id.to(device=device, dtype=torch.long).reshape(-1)
    ids = [int(eos_token_id)] if isinstance(eos_token_id, int) else [int(e) for e in eos_token_id]
    return torch.tensor(ids, dtype=torch.long, device=device) if ids else None


def finish_step(
    a: torch.Tensor,
    bonus: torch.Tensor,
    drafts: torch.Tensor,
    *,
    active: torch.Tensor | None = None,
    eos_token_id=None,
    budget: torch.Tensor | None = None,
    pad_token_id: int = 0,
) -> Acceptance:
    """What a row emits and commits once a[r] drafts are accepted and ``bonus`` follows them.

    a (N,) long in [0, P]; bonus (N,) long; drafts (N, P) long (P may be 0: an AR step).
    active (N,) bool: rows taking part (default all); eos_token_id: an id, ids or an (E,) tensor
    (emission stops after the first one); budget (N,) long ≥ 0: tokens each row may still emit.
    """
    N, P = drafts.shape
    B = P + 1
    device = drafts.device
    idx = torch.arange(B, device=device)
    # emitted row: d_1 .. d_a then the bonus at index a (drafts padded by one column to width B)
    padded = torch.cat([drafts, drafts.new_full((N, 1), pad_token_id)], dim=1)  # (N, B)
    tokens = torch.where(idx[None] == a[:, None], bonus[:, None], padded)
    n_emit = a + 1
    finished = torch.zeros(N, dtype=torch.bool, device=device)
    eos = eos_token_id if isinstance(eos_token_id, torch.Tensor) else eos_ids(eos_token_id, device)
    if eos is not None:
        # a broadcast compare, not torch.isin: isin sorts (unique) for larger inputs, a host sync on CUDA
        is_eos = (tokens[..., None] == eos).any(-1) & (idx[None] < n_emit[:, None])
        first_eos = torch.where(is_eos, idx[None], B).amin(dim=1)  # B when there is none
        finished |= first_eos < B
        n_emit = torch.minimum(n_emit, first_eos + 1)
    if budget is not None:
        finished |= budget <= n_emit
        n_emit = torch.minimum(n_emit, budget)
    commit = a + 1
    if active is not None:
        n_emit, commit, a = n_emit * active, commit * active, a * active
        finished |= ~active
    tokens = torch.where(idx[None] < n_emit[:, None], tokens, pad_token_id)
    return Acceptance(a, commit, tokens, n_emit, bonus, finished)


def accept_greedy(target_argmax: torch.Tensor, drafts: torch.Tensor, **finish) -> Acceptance:
    """T=0 acceptance of a batch. target_argmax (N, B) long, drafts (N, P = B-1) long.

    Keyword arguments (active, eos_token_id, budget, pad_token_id): see :func:`finish_step`.
    """
    # longest run of matches from the start: cumprod turns the first mismatch and all after it to 0
    a = (drafts == target_argmax[:, :-1]).long().cumprod(dim=-1).sum(dim=-1)  # (N,)
    bonus = target_argmax.gather(1, a[:, None])[:, 0]  # argmax after d_a
    return finish_step(a, bonus, drafts, **finish)


def accept_sampled(p: torch.Tensor, proposal: Proposal, generator=None, **finish) -> Acceptance:
    """T>0 acceptance of a batch by rejection sampling. p (N, B, V) warped target probabilities.

    proposal: the drafts (N, P) and their q (sparse, dense, or none = argmax drafts, a point mass).
    Keyword arguments: see :func:`finish_step`. Rows that are inactive draw too (fixed shapes) and
    their draws are discarded. (The engine's accept is kernels/sampled_accept.py: the same draws and
    the same law, in one launch on CUDA.)
    """
    a, bonus = rejection_accept_proposal(p, proposal, generator)
    return finish_step(a, bonus, proposal.tokens, **finish)


# ----------------------------------------------------------------------------- the step's other pieces
def choose(logits: torch.Tensor, params: SamplingParams, generator=None) -> torch.Tensor:
    """logits (..., V) -> tokens (...): argmax at T=0, else a draw from the warped p."""
    return logits.argmax(-1) if params.greedy else sample(warp_probs(logits, params), generator)


def prefill(model, state, ids: torch.Tensor, lengths: torch.Tensor, taps_out=None, taps: bool = True) -> torch.Tensor:
    """Variable-length prefill: ids (N, P_max) right-padded prompts, lengths (N,) -> last logits (N, V).

    One forward of the padded batch; row r commits its own lengths[r] tokens, so the padding
    writes only K/V past the row's length (never read) and never enters a GDN state. Taps of all
    P_max positions go to ``taps_out`` (N, P_max, K·d) when given; taps=False computes none (plain AR).
    """
    out = model(ids, state, taps_out=taps_out, logits_index=lengths - 1, taps=taps)
    # folded at once, even for a prompt as long as a reserved block (whose commit would be deferred): the
    # first decode verify may be a captured graph of another block length, which folds only its own log
    state.commit(lengths, defer=False)
    return out.logits


def verify(model, state, block: torch.Tensor, *, taps_out=None, kv_len: int | None = None) -> torch.Tensor:
    """The target over block (N, B) = [anchor, d_1 .. d_P] at each row's length -> logits (N, B, V).

    Commits nothing: :func:`commit` keeps each row's accepted part afterwards.
    """
    return model(block, state, taps_out=taps_out, kv_len=kv_len).logits


def commit(state, n: torch.Tensor, drafter=None, context=None) -> None:
    """Keep n[r] block tokens of row r: the target's lengths / GDN replay, and the drafter context
    gets the taps of those positions (already in ``context.taps``, written by :func:`verify`)."""
    state.commit(n)
    if drafter is not None:
        drafter.append(context, context.taps, n)


def emit(out: torch.Tensor, count: torch.Tensor, tokens: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """Append tokens[r, :n[r]] to row r of out (N, W) at column count[r]; returns count + n.

    tokens (N, T). The T − n[r] columns after the new end are overwritten too (with whatever
    tokens holds there) and rewritten by the next call, so W must be ≥ max(count) + T.
    """
    idx = count[:, None] + torch.arange(tokens.shape[1], device=count.device)  # (N, T)
    out.scatter_(1, idx, tokens)
    return count + n
