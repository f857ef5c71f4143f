"""Training objective of the drafter (ARCHITECTURE.md §2.6), free of Lightning.

Anchors, block labels, the decay-weighted cross-entropy and the metrics logged
every step. Shapes: N sequences of length L, A anchors per sequence, block
size B, P = B - 1 drafted positions per block, V the target vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

# Maps this process's Σw of a loss to the Σw it is divided by. One process: itself. Data-parallel
# training passes (Σw over all ranks) / world size, so that DDP's mean of the per-rank gradients is
# the gradient of the global batch's loss (dflash2/training/data_parallel.py says why).
WeightTotal = Callable[[torch.Tensor], torch.Tensor]


def own_weight_total(local: torch.Tensor) -> torch.Tensor:
    """The one-process normaliser of a weighted loss: its own weight sum."""
    return local


def sample_anchors(
    loss_mask: torch.Tensor,
    num_anchors: int,
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw up to `num_anchors` anchor positions per sequence, uniformly without replacement.

    An anchor p is eligible when p >= 1 (some context precedes it) and both p
    and p + 1 are supervised response tokens (§2), so every block has at least
    one label. loss_mask: (N, L) {0,1}. Returns anchors (N, A) int64, sorted,
    and anchor_valid (N, A) bool; rows with fewer eligible positions are
    padded with position 1 and valid=False.

    `generator`: one generator for the batch, or one per row (`row_anchor_generator`): then a
    row's anchors depend on its own generator and its own tokens only, not on the other rows of
    the batch or the padding, so a row draws the same anchors in whichever batch or rank it is.
    """
    n, length = loss_mask.shape
    mask = loss_mask.bool()
    eligible = torch.zeros_like(mask)
    eligible[:, 1:-1] = mask[:, 1:-1] & mask[:, 2:]
    # Random scores on CPU from an explicit generator (repeatable per step), eligible first.
    if isinstance(generator, Sequence):
        scores = _row_scores(loss_mask, generator).to(loss_mask.device)
    else:
        scores = torch.rand(n, length, generator=generator).to(loss_mask.device)
    scores = torch.where(eligible, scores, torch.full_like(scores, 2.0))
    picked = scores.argsort(dim=1)[:, :num_anchors]  # (N, A)
    valid = eligible.gather(1, picked)
    anchors = torch.where(valid, picked, torch.ones_like(picked))
    # Sort valid anchors by position (padding last) for readable masks and logs.
    order = torch.where(valid, anchors, torch.full_like(anchors, length + 1)).argsort(dim=1)
    return anchors.gather(1, order), valid.gather(1, order)


def _row_scores(loss_mask: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """(N, L) scores, row i drawn from generators[i]. A row draws as many numbers as its supervised
    span is long (up to its last supervised token), a length of its own: right padding to a longer
    batch neighbour would otherwise change how many numbers it draws, and so which."""
    n, length = loss_mask.shape
    if len(generators) != n:
        raise ValueError(f"{len(generators)} anchor generators for {n} rows")
    scores = torch.full((n, length), 2.0)
    supervised = loss_mask.detach().bool().cpu()
    for i, gen in enumerate(generators):
        where = supervised[i].nonzero()
        span = int(where[-1]) + 1 if len(where) else 0
        scores[i, :span] = torch.rand(span, generator=gen)
    return scores


def block_labels(
    input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor, anchor_valid: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels of the drafted positions: block position k (1..B-1) predicts token anchor + k (no shift).

    Returns labels (N, A, P) int64 and label_mask (N, A, P) bool (False past the
    sequence end, on unsupervised tokens, or for padded anchors).
    """
    n, length = input_ids.shape
    offsets = torch.arange(1, block_size, device=input_ids.device)
    pos = anchors[:, :, None] + offsets  # (N, A, P)
    inside = pos < length
    pos_c = pos.clamp(max=length - 1)
    flat = pos_c.reshape(n, -1)
    labels = input_ids.gather(1, flat).view_as(pos)
    supervised = loss_mask.bool().gather(1, flat).view_as(pos)
    return labels, inside & supervised & anchor_valid[:, :, None]


def position_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """w_k = exp(-(k-1)/gamma) for k = 1..B-1: (P,). Early positions matter most for acceptance."""
    k = torch.arange(1, block_size, device=device, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def weighted_block_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    label_mask: torch.Tensor,
    weights: torch.Tensor,
    weight_total: WeightTotal = own_weight_total,
) -> torch.Tensor:
    """Σ w_k·CE_k / Σ w_k over valid positions. logits (N, A, P, V); weights (P,).
    `weight_total` gives the Σ w_k divided by (see `WeightTotal`)."""
    ce = F.cross_entropy(logits.float().flatten(0, 2), labels.flatten(), reduction="none").view_as(labels)
    return weighted_position_loss(ce, label_mask, weights, weight_total)


def weighted_position_loss(
    ce: torch.Tensor, label_mask: torch.Tensor, weights: torch.Tensor, weight_total: WeightTotal = own_weight_total
) -> torch.Tensor:
    """Σ w_k·CE_k / Σ w_k over valid positions from per-position CE (N, A, P) fp32 (the chunked head's, or
    ``weighted_block_loss``'s from full logits); label_mask (N, A, P) bool; weights (P,).
    `weight_total` gives the Σ w_k divided by (see `WeightTotal`)."""
    w = weights.view(1, 1, -1) * label_mask
    return (ce * w).sum() / weight_total(w.sum()).clamp_min(1e-8)


@torch.no_grad()
def block_metrics(predictions: torch.Tensor, labels: torch.Tensor, label_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-position top-1 accuracy and the acceptance estimate.

    predictions/labels: (N, A, P); label_mask (N, A, P). The ratios of `block_metric_sums`.

    Acceptance estimate: at T=0 a block's drafts are accepted up to the first
    wrong one, so per block accepted = the length of the leading run of
    correct predictions, and τ = 1 + accepted (the bonus token). The estimate
    averages that over blocks, counting only blocks whose P positions are all
    labelled (a block cut by the sequence end would bias it down). When the
    training responses are the target's greedy outputs this is the τ that
    greedy speculative decoding would measure on the same contexts.
    """
    return metrics_from_sums(block_metric_sums(predictions, labels, label_mask))


@torch.no_grad()
def block_metric_sums(predictions: torch.Tensor, labels: torch.Tensor, label_mask: torch.Tensor) -> torch.Tensor:
    """The counts behind `block_metrics` as one float64 vector (3P + 2): correct per position,
    labelled per position, then leading correct drafts summed over full blocks, full blocks.
    Sums add over batches and ranks (ratios do not): sum them, then `metrics_from_sums`.
    float64: counts stay exact far beyond what one step holds."""
    correct = (predictions == labels) & label_mask
    full = label_mask.all(dim=-1)  # (N, A)
    run = correct.long().cumprod(dim=-1).sum(dim=-1)  # (N, A) leading correct drafts
    return torch.cat(
        [
            correct.sum(dim=(0, 1)).double(),
            label_mask.sum(dim=(0, 1)).double(),
            run[full].sum().double()[None],
            full.sum().double()[None],
        ]
    )


def metrics_from_sums(sums: torch.Tensor) -> dict[str, torch.Tensor]:
    """`block_metrics` from (summed) `block_metric_sums`."""
    p = (sums.numel() - 2) // 2
    correct, labelled, run, blocks = sums[:p], sums[p : 2 * p], sums[2 * p], sums[2 * p + 1]
    acc = (correct / labelled.clamp_min(1)).float()  # (P,)
    tau = 1.0 + (run / blocks).float() if bool(blocks > 0) else torch.tensor(float("nan"), device=sums.device)
    return {"acc_per_position": acc, "tau_estimate": tau, "blocks": blocks.long()}


def expected_tau_from_accuracies(acc_per_position: torch.Tensor) -> float:
    """τ if position errors were independent: 1 + Σ_k Π_{j<=k} acc_j (a cross-check of the estimate)."""
    return 1.0 + float(torch.cumprod(acc_per_position.float(), dim=0).sum())


def anchor_generator(seed: int, step: int) -> torch.Generator:
    """The RNG of one step's anchor draw: a function of (seed, step) only, so resumed runs redraw the same anchors."""
    return torch.Generator().manual_seed((int(seed) * 1_000_003 + int(step)) % (2**63 - 1))


def row_anchor_generator(seed: int, step: int, row: int) -> torch.Generator:
    """The RNG of one training row's anchors: a function of (seed, step, global row) only, the row's
    place in the global batch of that step. The same row draws the same anchors whatever process
    (rank) of a data-parallel run holds it, and in a resumed run. SeedSequence mixes the three
    numbers into the seed (a linear mix such as seed * K + step + row gives distinct keys one stream)."""
    state = np.random.SeedSequence([int(seed), int(step), int(row)]).generate_state(2, np.uint32)
    return torch.Generator().manual_seed((int(state[0]) << 31 | int(state[1]) >> 1) & (2**63 - 1))
