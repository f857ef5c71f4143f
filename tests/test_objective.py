"""Anchors, labels, loss weights and metrics of the drafter objective (ARCHITECTURE.md §2.6)."""

from __future__ import annotations

import math

import torch

from dflash2.drafter.objective import (
    anchor_generator,
    block_labels,
    block_metric_sums,
    block_metrics,
    expected_tau_from_accuracies,
    metrics_from_sums,
    position_weights,
    sample_anchors,
    weighted_block_loss,
)
from dflash2.training.drafter_data import StepSampler


def test_position_weights_follow_the_decay():
    w = position_weights(8, 4.0)
    assert w.shape == (7,)
    assert w[0] == 1.0
    for k in range(1, 8):
        assert math.isclose(float(w[k - 1]), math.exp(-(k - 1) / 4.0), rel_tol=1e-6)
    assert torch.all(w[1:] < w[:-1])


def test_weighted_loss_is_normalised_by_the_weights_of_valid_positions():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 7, 11)
    labels = torch.randint(0, 11, (2, 3, 7))
    mask = torch.rand(2, 3, 7) > 0.3
    w = position_weights(8, 4.0)
    loss = weighted_block_loss(logits, labels, mask, w)
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, 11), labels.reshape(-1), reduction="none").view(2, 3, 7)
    expected = (ce * w * mask).sum() / (w * mask).sum()
    torch.testing.assert_close(loss, expected)
    # Uniform logits give log(V) whatever the weights.
    flat = weighted_block_loss(torch.zeros_like(logits), labels, mask, w)
    assert math.isclose(float(flat), math.log(11), rel_tol=1e-5)


def test_anchors_are_supervised_pairs_and_redrawn_per_step():
    mask = torch.zeros(3, 40, dtype=torch.long)
    mask[0, 10:30] = 1
    mask[1, 5:8] = 1  # only anchors 5 and 6 are eligible
    anchors, valid = sample_anchors(mask, 8, anchor_generator(0, 0))
    assert anchors.shape == valid.shape == (3, 8)
    for row in range(3):
        for p, v in zip(anchors[row].tolist(), valid[row].tolist()):
            if v:
                assert p >= 1 and mask[row, p] == 1 and mask[row, p + 1] == 1
    assert valid[0].all() and valid[1].sum() == 2 and not valid[2].any()
    assert set(anchors[1][valid[1]].tolist()) == {5, 6}
    again, _ = sample_anchors(mask, 8, anchor_generator(0, 0))
    other, _ = sample_anchors(mask, 8, anchor_generator(0, 1))
    assert torch.equal(anchors, again) and not torch.equal(anchors, other)
    assert len(set(anchors[0].tolist())) == 8  # without replacement


def test_block_labels_are_the_tokens_at_the_same_positions():
    ids = torch.arange(100, 120)[None]
    mask = torch.ones(1, 20, dtype=torch.long)
    mask[0, :3] = 0
    anchors = torch.tensor([[3, 15]])
    labels, lmask = block_labels(ids, mask, anchors, torch.tensor([[True, True]]), block_size=8)
    assert labels[0, 0].tolist() == list(range(104, 111))  # anchor 3 -> positions 4..10 (no shift)
    assert lmask[0, 0].all()
    assert lmask[0, 1].tolist() == [True] * 4 + [False] * 3  # positions 16..19 exist, 20..22 do not


def test_metrics_acceptance_counts_leading_correct_drafts():
    labels = torch.tensor([[[1, 2, 3, 4], [1, 2, 3, 4]]])
    preds = torch.tensor([[[1, 2, 9, 4], [9, 2, 3, 4]]])
    mask = torch.ones_like(labels, dtype=torch.bool)
    m = block_metrics(preds, labels, mask)
    assert m["acc_per_position"].tolist() == [0.5, 1.0, 0.5, 1.0]
    assert float(m["tau_estimate"]) == 1.0 + (2 + 0) / 2
    assert math.isclose(expected_tau_from_accuracies(torch.tensor([0.5, 1.0, 0.5, 1.0])), 1 + 0.5 + 0.5 + 0.25 + 0.25)


def test_step_sampler_resumes_the_same_stream():
    full = [key.index for batch in StepSampler(10, 4, total_steps=7, seed=3) for key in batch]
    assert len(full) == 28
    resumed = [key.index for batch in StepSampler(10, 4, total_steps=7, seed=3, start_step=4) for key in batch]
    assert resumed == full[16:]
    assert sorted(full[:10]) == list(range(10))  # each epoch is a permutation


def test_block_metrics_are_the_ratios_of_sums_that_add_over_parts():
    torch.manual_seed(0)
    labels = torch.randint(0, 3, (5, 4, 6))
    preds = torch.where(torch.rand(5, 4, 6) < 0.7, labels, torch.randint(0, 3, (5, 4, 6)))
    mask = torch.rand(5, 4, 6) > 0.2
    whole = block_metrics(preds, labels, mask)
    parts = sum(block_metric_sums(preds[rows], labels[rows], mask[rows]) for rows in (slice(0, 2), slice(2, 5)))
    summed = metrics_from_sums(parts)
    torch.testing.assert_close(summed["acc_per_position"], whole["acc_per_position"])
    torch.testing.assert_close(summed["tau_estimate"], whole["tau_estimate"])
    assert int(summed["blocks"]) == int(whole["blocks"]) > 0
