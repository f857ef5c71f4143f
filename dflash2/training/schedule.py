"""Learning-rate schedule shared by target pretraining and drafter training."""

from __future__ import annotations

import math

import torch


def cosine_with_warmup(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int, min_ratio: float = 0.1):
    """Linear warmup to the base lr, then cosine decay to `min_ratio` of it.

    A LambdaLR, so its state (the step count) is saved in checkpoints and a
    resumed run continues the same curve.
    """
    warmup_steps = max(0, int(warmup_steps))
    total_steps = max(warmup_steps + 1, int(total_steps))

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
