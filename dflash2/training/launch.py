"""How this process was started: alone, by Lightning's DDP launcher, or by torchrun / SLURM.

Lightning's own launcher (``python train.py trainer=ddp``) starts the other ranks only when
``trainer.fit`` begins, as copies of the command line: by then rank 0 has built the target and
regenerated the data, and the copies find them in the cache. torchrun and ``srun`` start every
rank at once, before anything is cached; a target build (a one-device Lightning run, which
Lightning refuses inside such a launch) or a regeneration running in every rank is not an option,
so those launches expect the cache to be filled first (`python train.py task=data ...`) and say
so when it is not. Read from the environment, as Lightning's cluster environments do.
"""

from __future__ import annotations

import os

import torch.distributed as dist

PREPARE_FIRST = (
    "under torchrun / SLURM every rank starts at once, so build the target and regenerate the data first, "
    "in one process: python train.py task=data <the same overrides, without the launcher>"
)


def external_world_size() -> int:
    """Processes that torchrun or SLURM's srun started for this run (1 when neither did: one process,
    or Lightning's launcher, whose other ranks start later)."""
    if dist.is_available() and dist.is_torchelastic_launched():
        return int(os.environ.get("WORLD_SIZE", "1"))
    # Lightning's rule (SLURMEnvironment): srun sets SLURM_NTASKS; job names bash / interactive mean
    # an interactive allocation whose processes something else launches.
    if "SLURM_NTASKS" in os.environ and os.environ.get("SLURM_JOB_NAME") not in ("bash", "interactive"):
        return int(os.environ["SLURM_NTASKS"])
    return 1


def external_rank() -> int:
    """This process's global rank in a torchrun / SLURM launch (0 otherwise)."""
    if external_world_size() == 1:
        return 0
    if dist.is_available() and dist.is_torchelastic_launched():
        return int(os.environ.get("RANK", "0"))
    return int(os.environ.get("SLURM_PROCID", "0"))
