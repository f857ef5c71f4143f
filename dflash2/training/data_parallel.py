"""Sums over the ranks of a data-parallel drafter run (DDP / FSDP), and which rank writes files.

Each rank trains on its slice of the step's global batch (dflash2/training/drafter_data.py) and
DDP (FSDP alike) *averages* the ranks' gradients. Both losses of a step are ratios
S / D = Σ w·CE / Σ w over the rank's labelled positions, and the mean over ranks of per-rank
ratios is the global batch's ratio only when every rank holds the same Σ w, which nothing
guarantees: rows differ in their numbers of supervised positions, and a global batch that the
world size W does not divide gives ranks different row counts. So each rank divides its own S_r
by ``global_weight_share`` = (Σ over ranks of D) / W instead of by D_r: the mean over ranks of
W·S_r / Σ D is Σ S / Σ D, the loss of the whole global batch as one process computes it, and
since that denominator is a constant of the step (detached), DDP's averaged gradient is that
loss's gradient too. With one process every function here is the identity.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def world_size() -> int:
    """Processes in the run's default process group (1 when there is none)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    """``values`` summed over the ranks (a detached copy; the same tensor when there is one process).
    Every rank must call it, in the same order: it is a collective."""
    if world_size() == 1:
        return values
    total = values.detach().clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total


def global_weight_share(local: torch.Tensor) -> torch.Tensor:
    """The divisor of a rank's weighted loss sum: Σ w over all ranks / W (module docstring).
    A `dflash2.drafter.objective.WeightTotal`."""
    world = world_size()
    if world == 1:
        return local
    return all_reduce_sum(local.detach().float()) / world
