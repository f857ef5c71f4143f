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
    _hydra_main()


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
    from hydra.types import RunMode
    from omegaconf import DictConfig

    from dflash2.errors import DFlash2Error

    @hydra.main(config_path=CONFIG_DIR, config_name=CONFIG_NAME, version_base="1.3")
    def run(cfg: DictConfig) -> None:
        from dflash2.training.run import run_from_config

        if HydraConfig.get().mode == RunMode.MULTIRUN:  # job N of a sweep writes into paths.output_dir/N
            cfg.paths.output_dir = HydraConfig.get().runtime.output_dir
        try:
            run_from_config(cfg)
        except DFlash2Error as err:
            print(f"error: {err}", file=sys.stderr)
            sys.exit(2)

    run()
