"""The whole trained drafter on rank 0, whatever the strategy: what exports, reports and τ read.

One process and DDP: every rank holds all of the drafter's weights in ``module.drafter`` (DDP's
wrapper only adds gradient hooks around it, and calling the drafter directly for inference, as
the decoder does, uses those same weights). FSDP: each rank holds a shard, and outside the
FSDP-wrapped forward ``module.drafter``'s weights are flat shards, not the model; using them
there gives wrong numbers or errors. So the full state dict is gathered to rank 0 (a collective:
every rank calls `drafter_on_rank_zero`) and loaded into a fresh, unwrapped drafter.
Other strategies (DeepSpeed, Lightning's ModelParallelStrategy, XLA) and DDP's spawn / fork
launchers (which pickle the module, frozen target included, into new processes, and hand weights
back to the parent) are refused up front by `check_supported_strategy`: untested paths that could
export or report another model than the one trained must not start.
"""

from __future__ import annotations

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, SingleDeviceStrategy
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher

from dflash2.errors import DFlash2Error

# Exact types: DeepSpeed's strategy is a DDPStrategy subclass, but shards like FSDP without its gather.
SUPPORTED = (SingleDeviceStrategy, DDPStrategy, FSDPStrategy)


def check_supported_strategy(trainer: L.Trainer) -> None:
    """One device, DDP or FSDP started by Lightning's script launcher, torchrun or SLURM; anything else
    is a one-line error before training."""
    strategy = trainer.strategy
    if type(strategy) not in SUPPORTED or isinstance(strategy.launcher, _MultiProcessingLauncher):
        name = type(strategy).__name__ + (" (spawn / fork)" if isinstance(strategy, DDPStrategy) else "")
        raise DFlash2Error(
            f"trainer strategy {name} is not supported: dflash2 trains on one device, with DDP (trainer=ddp: "
            "strategy=ddp, or under torchrun / SLURM) or with FSDP (trainer=fsdp)"
        )


def drafter_on_rank_zero(trainer: L.Trainer, module) -> torch.nn.Module | None:
    """The trained drafter with all its weights on global rank 0; None on every other rank.

    Call it on every rank (under FSDP it gathers). The drafter returned under FSDP is a copy on
    the CPU in fp32 (the full state dict of the master weights); otherwise it is ``module.drafter``.
    """
    if isinstance(trainer.strategy, FSDPStrategy):
        state = trainer.strategy.lightning_module_state_dict()  # full, rank 0 only (the others get {})
        if not trainer.is_global_zero:
            return None
        prefix = "drafter."
        weights = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
        copy = type(module.drafter)(module.drafter.config)
        copy.load_state_dict(weights, strict=True)  # a missing or foreign key is an error, never a silent mix
        # Modules' run-time switches (drafter.norm_kernels, drafter.conv_kernels: the Triton kernels or the
        # torch twins) are not weights: carry them over, so the copy runs the code the training ran.
        for mine, trained in zip(copy.modules(), module.drafter.modules(), strict=True):
            if hasattr(trained, "use_kernels"):
                mine.use_kernels = trained.use_kernels
        return copy.float().train(module.drafter.training)
    return module.drafter if trainer.is_global_zero else None
