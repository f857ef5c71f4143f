"""Hydra front door of `train.py`.

Before Hydra runs, the overrides are composed once against the config tree so
that a typo (`trainer.max_step=5`, `drafter=dflsh`) stops with a one-line
message instead of Hydra's multi-line report; user errors raised as
DFlash2Error are printed as one line as well (exit code 2).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

CONFIG_DIR = str(Path(__file__).resolve().parents[2] / "configs")


def check_overrides(overrides: list[str], config_name: str = "train") -> str | None:
    """Compose `config_name` with `overrides`; return a one-line error or None."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    plain = [o for o in overrides if not o.startswith(("hydra.", "hydra/", "-", "+hydra"))]
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
            compose(config_name=config_name, overrides=plain)
    except Exception as err:  # Hydra raises several exception types for bad overrides
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return (
            f"error: bad config override: {first} "
            "(see `python train.py --help` for groups and options; use +key=value to add a new key)"
        )
    finally:
        GlobalHydra.instance().clear()
    return None


def main() -> None:
    if not any(a in ("--help", "-h", "--hydra-help", "--info", "-i") for a in sys.argv[1:]):
        problem = check_overrides(sys.argv[1:])
        if problem:
            print(problem, file=sys.stderr)
            sys.exit(2)
    os.environ.setdefault("PROJECT_ROOT", str(Path(CONFIG_DIR).parent))
    _hydra_main()


def _hydra_main() -> None:
    import hydra
    from omegaconf import DictConfig

    from dflash2.errors import DFlash2Error

    @hydra.main(config_path=CONFIG_DIR, config_name="train", version_base="1.3")
    def run(cfg: DictConfig) -> None:
        from dflash2.training.run import run_from_config

        try:
            run_from_config(cfg)
        except DFlash2Error as err:
            print(f"error: {err}", file=sys.stderr)
            sys.exit(2)

    run()
