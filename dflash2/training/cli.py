"""Hydra front door of `python train.py` and the `dflash2-train` entry point.

The command line is Hydra's own (`--help`, `--cfg job|hydra|all`, `--info`, `-m` with
sweeps, ...). Before Hydra runs, Hydra's argument parser separates its flags from the
overrides and the overrides are composed once (dflash2/training/override_check.py), so
that a typo stops with one line (exit 2) instead of Hydra's multi-line report; user
errors raised as DFlash2Error during the run are printed as one line as well.

Output folders: a run writes into `paths.output_dir`. Under `-m` that folder holds the
whole sweep (`multirun.yaml`) and job N writes into `paths.output_dir/N`
(`hydra.sweep` in configs/train.yaml); the job's `paths.output_dir` is set to its own
folder (Hydra's runtime.output_dir), so every path derived from it follows.

Multi-process runs (docs/TRAINING.md, Multi-GPU): Lightning's DDP launcher starts the other
ranks as copies of the command line plus `hydra.run.dir=<rank 0's folder>`; taking the folder
from Hydra's runtime.output_dir, not from `paths.output_dir` (whose default re-reads the clock),
puts every rank in rank 0's folder. Under torchrun / SLURM each rank logs to `train_rank<r>.log`
and only rank 0 writes `.hydra/`, as Lightning does for the ranks it starts.
"""

from __future__ import annotations

import os
import sys

from dflash2.config_dir import config_dir, source_checkout

CONFIG_DIR = str(config_dir())
CONFIG_NAME = "train"
# Flags after which Hydra runs no job (or reads its config from elsewhere): nothing to check.
NO_CHECK_FLAGS = ("help", "hydra_help", "shell_completion", "experimental_rerun", "config_path", "config_dir")


def main() -> None:
    from hydra._internal.utils import get_args_parser

    from dflash2.training.override_check import check_overrides

    args = get_args_parser().parse_args(sys.argv[1:])  # exits with argparse's usage line on a bad flag, as Hydra
    problem = flag_problem(args)
    if problem:
        print(problem, file=sys.stderr)
        sys.exit(2)
    if not any(getattr(args, flag) for flag in NO_CHECK_FLAGS):
        multirun = args.multirun or "hydra.mode=MULTIRUN" in args.overrides
        problem = check_overrides(args.overrides, CONFIG_DIR, args.config_name or CONFIG_NAME, multirun)
        if problem:
            print(problem, file=sys.stderr)
            sys.exit(2)
    checkout = source_checkout()
    if checkout is not None:
        os.environ.setdefault("PROJECT_ROOT", str(checkout))  # paths.root_dir
    sys.argv += rank_job_overrides(args.overrides)
    _hydra_main()


def rank_job_overrides(overrides: list[str]) -> list[str]:
    """Under torchrun / SLURM, ranks > 0 get their own log file and leave `.hydra/` to rank 0
    (every rank writing `train.log` and `.hydra/` in one folder would interleave and overwrite)."""
    from dflash2.training.launch import external_rank

    rank = external_rank()
    if rank == 0 or any(o.startswith("hydra.job.name=") for o in overrides):
        return []
    return [f"hydra.job.name=train_rank{rank}", "hydra.output_subdir=null"]


def one_folder_problem(cfg, hydra_overrides: list[str]) -> str | None:
    """torchrun / SLURM: a dated default `paths.output_dir` would be dated by each rank's own clock."""
    from omegaconf import OmegaConf

    from dflash2.training.launch import external_world_size

    raw = str(OmegaConf.to_container(cfg.paths, resolve=False).get("output_dir"))
    if external_world_size() == 1 or "${now:" not in raw:
        return None
    if any(o.startswith("hydra.run.dir=") for o in hydra_overrides):
        return None
    return (
        "error: under torchrun / SLURM set paths.output_dir=DIR: its dated default is resolved by every rank "
        "on its own clock, and the ranks would write to different folders"
    )


def flag_problem(args) -> str | None:
    """Hydra's two rules on combining flags, as one line (Hydra itself raises them with a traceback)."""
    commands = args.run + args.multirun + args.shell_completion + (args.cfg is not None) + (args.info is not None)
    if commands > 1:
        return "error: use only one of --run, --multirun, --cfg, --info and --shell-completion"
    if args.resolve and args.cfg is None and not args.help:
        return "error: --resolve goes with --cfg (or --help)"
    return None


def _hydra_main() -> None:
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import DictConfig

    from dflash2.errors import DFlash2Error

    @hydra.main(config_path=CONFIG_DIR, config_name=CONFIG_NAME, version_base="1.3")
    def run(cfg: DictConfig) -> None:
        from dflash2.training.run import run_from_config

        hydra = HydraConfig.get()
        problem = one_folder_problem(cfg, list(hydra.overrides.hydra))
        if problem:
            print(problem, file=sys.stderr)
            sys.exit(2)
        # The folder Hydra made for this job: under -m job N's paths.output_dir/N; in a rank that
        # Lightning's DDP launcher started, rank 0's (module docstring).
        cfg.paths.output_dir = hydra.runtime.output_dir
        try:
            run_from_config(cfg)
        except DFlash2Error as err:
            print(f"error: {err}", file=sys.stderr)
            sys.exit(2)

    run()
