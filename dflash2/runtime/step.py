"""Per-step pieces of the speculative loop, on tensors (docs/ARCHITECTURE.md §4).

So far: T=0 acceptance for a whole batch at once. A verify step feeds each row the
block ``[anchor, d_1 .. d_P]`` (P = B-1 drafts; the anchor is the last emitted token,
not yet in the target's caches) and gets the target's argmax after every input.
Row r accepts the longest prefix of drafts that equal those argmaxes, a[r]; it then
emits ``d_1 .. d_a, bonus`` where the bonus is the target's argmax after d_a (the
correction at the first mismatch, or the extra token after a full match), commits
``a + 1`` block tokens (anchor + accepted drafts) to the target state, and the bonus
becomes its next anchor. The emitted tokens are exactly what greedy decoding of
the target would emit.

Rows are ragged: each has its own a[r], its emission stops at its first EOS, at its
token budget, and rows that are no longer active emit and commit nothing. There is
no loop over rows and no host sync; the caller reads ``num_emitted`` once per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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


def accept_greedy(
    target_argmax: torch.Tensor,
    drafts: torch.Tensor,
    *,
    active: torch.Tensor | None = None,
    eos_token_id: int | None = None,
    budget: torch.Tensor | None = None,
    pad_token_id: int = 0,
) -> Acceptance:
    """T=0 acceptance of a batch. target_argmax (N, B) long, drafts (N, P = B-1) long.

    active (N,) bool: rows taking part (default all); eos_token_id: emission stops after it;
    budget (N,) long ≥ 0: tokens each row may still emit (default unlimited).
    """
    N, B = target_argmax.shape
    device = target_argmax.device
    # longest run of matches from the start: cumprod turns the first mismatch and all after it to 0
    a = (drafts == target_argmax[:, :-1]).long().cumprod(dim=-1).sum(dim=-1)  # (N,)
    bonus = target_argmax.gather(1, a[:, None])[:, 0]  # argmax after d_a
    idx = torch.arange(B, device=device)
    # emitted row: d_1 .. d_a then the bonus at index a (drafts padded by one column to width B)
    padded = torch.cat([drafts, drafts.new_full((N, 1), pad_token_id)], dim=1)  # (N, B)
    tokens = torch.where(idx[None] == a[:, None], bonus[:, None], padded)
    n_emit = a + 1
    finished = torch.zeros(N, dtype=torch.bool, device=device)
    if eos_token_id is not None:
        is_eos = (tokens == eos_token_id) & (idx[None] < n_emit[:, None])
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
