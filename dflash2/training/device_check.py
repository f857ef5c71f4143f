"""Trainer settings this machine cannot run, refused in one line before any target build or regeneration.

Lightning finds these only when the Trainer is built, after the target build (minutes) and the
data regeneration, and Hydra wraps its message in a multi-line instantiation error. The cases:
- `trainer.accelerator=gpu` (or `cuda`) where torch sees no CUDA GPU (a CPU build of torch, no
  driver, an empty CUDA_VISIBLE_DEVICES);
- `trainer=fsdp` with a CPU accelerator (Lightning's FSDP strategy runs on CUDA only);
- more GPUs in `trainer.devices` than are visible, when Lightning starts the processes itself.
  Under torchrun or SLURM (the launcher's WORLD_SIZE is set) the count is left to Lightning, since
  a SLURM task bound to its own GPU may see one device of the several the node has.
"""

from __future__ import annotations

import os

import torch
from omegaconf import DictConfig, OmegaConf

from dflash2.errors import DFlash2Error
from dflash2.training.launch import external_world_size

GPU_NAMES = ("gpu", "cuda")


def _strategy_name(strategy) -> str:
    """`ddp`, `fsdp` or the class path of a strategy given as a Hydra node."""
    if isinstance(strategy, (dict, DictConfig)):
        return str(strategy.get("_target_", ""))
    return str(strategy or "")


def _requested_gpus(devices) -> int | None:
    """How many GPUs `trainer.devices` asks for; None for "all" (-1, "auto") or a form left to Lightning."""
    if isinstance(devices, (list, tuple)) or OmegaConf.is_list(devices):
        return len(devices)
    if isinstance(devices, str):
        text = devices.strip()
        if "," in text:  # Lightning's "0,1": these device indices
            return len([d for d in text.split(",") if d.strip()])
        devices = text
    try:
        count = int(devices)
    except (TypeError, ValueError):
        return None
    return count if count > 0 else None


def check_trainer_devices(trainer: DictConfig) -> None:
    """Raise a one-line DFlash2Error when the `trainer` config cannot run on this machine (module docstring)."""
    accelerator = str(trainer.get("accelerator", "cpu"))
    strategy = _strategy_name(trainer.get("strategy"))
    if "fsdp" in strategy.lower() and accelerator not in (*GPU_NAMES, "auto"):
        raise DFlash2Error(
            f"trainer=fsdp with trainer.accelerator={accelerator}: Lightning's FSDP runs on CUDA GPUs only; "
            "on the CPU use trainer=ddp_cpu (data-parallel, gloo)"
        )
    if accelerator not in GPU_NAMES:
        return
    if not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = "" if visible is None else f", CUDA_VISIBLE_DEVICES={visible!r}"
        raise DFlash2Error(
            f"trainer.accelerator={accelerator} but torch {torch.__version__} sees no CUDA GPU here{where}; "
            "train on the CPU with trainer=cpu (the default) or trainer=ddp_cpu, or install a CUDA build of torch"
        )
    wanted = _requested_gpus(trainer.get("devices"))
    visible = torch.cuda.device_count()
    if wanted is not None and wanted > visible and external_world_size() <= 1:
        raise DFlash2Error(
            f"trainer.devices={trainer.get('devices')} but {visible} CUDA GPU(s) are visible; lower "
            "trainer.devices or give -1 for every visible GPU"
        )
