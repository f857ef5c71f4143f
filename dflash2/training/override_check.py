"""Typo check of command-line overrides before Hydra runs (`dflash2.training.cli`).

Hydra reports a mistyped key or group option (`trainer.max_step=5`, `drafter=dflsh`)
with a multi-line report, and under `-m` only when the sweep reaches the bad job.
Composing the config once up front turns it into one line before anything runs.

Only overrides are checked; the flags (`--cfg`, `-m`, `--info`, ...) are Hydra's and are
separated out by Hydra's own argument parser before this sees the overrides. Under
`-m` the sweeps are expanded the way Hydra's basic sweeper does (comma lists,
`range()`, `choice()`, `glob()` over a group), but instead of composing every job of
the product: one job with the first value of every sweep, plus one job per further
option of each swept config *group* (a group option decides which keys exist; a
further value of a plain key cannot make a key disappear).
"""

from __future__ import annotations

from pathlib import Path

from dflash2.errors import DFlash2Error


def check_overrides(
    overrides: list[str], config_dir: str | Path, config_name: str = "train", multirun: bool = False
) -> str | None:
    """Compose `config_name` with `overrides` (each job to check under `multirun`); a one-line error or None."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
            for job in jobs_to_check(overrides, GlobalHydra.instance().config_loader(), multirun):
                compose(config_name=config_name, overrides=job)
    except DFlash2Error as err:
        return f"error: {err}"
    except Exception as err:  # Hydra raises several exception types for bad overrides
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return f"error: bad config override: {first} (--help lists the groups and options; +key=value adds a new key)"
    finally:
        GlobalHydra.instance().clear()
    return None


def jobs_to_check(overrides: list[str], config_loader, multirun: bool) -> list[list[str]]:
    """The override lists to compose; raises Hydra's parse error or a DFlash2Error for a sweep without -m."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    alternatives: list[list[str]] = []  # per override, the "key=value" strings of its jobs
    swept_groups: list[int] = []
    for override in OverridesParser.create(config_loader=config_loader).parse_overrides(overrides):
        if override.key_or_group.split(".")[0].split("/")[0] == "hydra":
            continue  # Hydra's own settings (hydra.run.dir, hydra/launcher=...): Hydra checks those itself
        if not override.is_sweep_override():
            alternatives.append([override.input_line])
            continue
        if not multirun:
            raise DFlash2Error(
                f"{override.input_line} is a sweep (one job per value): add -m to run them all,"
                f" or write key=[a,b] for a list, or quote the value for a string"
            )
        if not override.is_discrete_sweep():
            continue  # interval(): only optimizing sweepers take these, and they check them
        values = [f"{override.get_key_element()}={v}" for v in override.sweep_string_iterator()]
        if not values:
            continue  # an empty sweep runs no job
        if config_loader.get_group_options(override.key_or_group):
            swept_groups.append(len(alternatives))
        alternatives.append(values)
    first = [values[0] for values in alternatives]
    jobs = [first]
    for index in swept_groups:
        jobs += [[*first[:index], value, *first[index + 1 :]] for value in alternatives[index][1:]]
    return jobs
