"""`python -m eval.ablation`: train and evaluate every DFlash v1 / DFlash2 variant over several seeds
and write a table of mean ± std τ and per-position acceptance (issue 11; docs/ABLATION.md).

1. Prepare, once: ``python train.py task=data`` builds (or reuses) the target and regenerates (or finds
   cached) the drafter data, with the data seed. Every run then reads that target and that data, so
   the runs only differ in the variant and the training seed (initial weights, batch order, anchors).
2. Train: ``python train.py drafter=<variant> seed=<seed> ...`` per (variant, seed), ``jobs`` at a time,
   each a child process with ``threads_per_run`` CPU threads (1 by default: bitwise reproducible).
3. Evaluate: ``python -m eval.acceptance`` (real lossless decoding, T=0) of each trained drafter on the
   same held-out prompts.
4. Tabulate: ``ablation.md`` and ``ablation.json`` in the output folder.

This module is the command line and the table's header; what runs is ``ablation_plan``, how it runs
``ablation_runner``, and the statistics ``ablation_table``.

Resumable: a run whose drafter and train_summary.json exist is not trained again, a run killed part-way
resumes from its last checkpoint, and an evaluation with the same settings is not repeated. Child
processes only: this module imports neither Lightning nor Hydra.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shlex
import sys
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

from dflash2.drafter.config import DrafterConfig
from dflash2.drafter.parameter_count import parameter_count
from dflash2.errors import DFlash2Error
from dflash2.eval.ablation_plan import BASELINE, TIMES, VARIANTS, Run, Settings, check_overrides, plan, record_or_check
from dflash2.eval.ablation_runner import execute, prepare
from dflash2.eval.ablation_table import read_measurements, summarise, write_table
from dflash2.logging_setup import configure_console_logging

log = logging.getLogger(__name__)


def run_record(settings: Settings, run: Run) -> dict:
    """One evaluated run: its measurements, parameter count and wall times."""
    config = DrafterConfig.from_dict(json.loads((run.dir / "drafter" / "config.json").read_text())["dflash2"])
    times = json.loads((run.dir / TIMES).read_text()) if (run.dir / TIMES).is_file() else {}
    return {
        "variant": run.variant,
        "seed": run.seed,
        "params": parameter_count(config),
        "intermediate_size": config.intermediate_size,
        **read_measurements(run.eval_dir / "results.json"),
        "train_seconds": times.get("train_seconds"),
        "eval_seconds": times.get(f"{settings.eval_name}_seconds"),
        "run_dir": str(run.dir),
    }


def header(settings: Settings, argv: list[str], runs: list[Run], records: list[dict]) -> dict:
    """The settings lines above the table (and their JSON record)."""
    evaluated = ", ".join(str(n) for n in sorted({r["prompts"] for r in records})) or "none"
    threads = settings.threads_per_run
    determinism = (
        "yes: one CPU thread per training run, and two identical one-thread runs give bitwise identical weights "
        "and τ (tests/test_reproducibility.py)"
        if settings.deterministic
        else f"no: {threads} threads per run split reductions in an order that varies between runs "
        "(identical runs differ at ~1e-8 in the weights)"
    )
    lines = [
        ("command", f"`python -m eval.ablation {shlex.join(argv)}`"),
        ("date", datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")),
        ("machine", f"{platform.machine()}, {os.cpu_count()} CPUs, {settings.jobs} parallel runs"),
        ("training", f"`python train.py` default recipe + `{' '.join(settings.overrides) or '(no overrides)'}`"),
        ("training deterministic", determinism),
        (
            "target and data",
            f"made once and shared by every run (target: `target.seed` build or `target.path`; data seed "
            f"{settings.data_seed}): {settings.out / 'prepare'}",
        ),
        ("seeds", ", ".join(str(s) for s in settings.seeds) + " (drafter init, batch order, anchors)"),
        (
            "evaluation",
            f"`python -m eval.acceptance` on {settings.num_prompts} held-out prompts asked "
            f"({evaluated} evaluated per run) of {settings.prompt_tokens} tokens, {settings.max_new_tokens} new "
            "tokens, the same prompts for every run, T=0, lossless check against plain greedy decoding",
        ),
        ("runs in the table", f"{len(records)} of {len(runs)}"),
    ]
    record = {**asdict(settings), "out": str(settings.out), "deterministic": settings.deterministic}
    return {"baseline": BASELINE, "lines": lines, "json": record}


def tabulate(settings: Settings, runs: list[Run], argv: list[str]) -> list[dict]:
    records = [run_record(settings, r) for r in runs if r.trained and r.evaluated]
    summary = summarise(records, BASELINE)
    write_table(settings.out, summary, records, header(settings, argv, runs, records), VARIANTS)
    return summary


def comma_list(text: str, kind, option: str) -> list:
    try:
        return [kind(x.strip()) for x in text.split(",") if x.strip()]
    except ValueError:
        raise DFlash2Error(f"{option}={text!r}: expected a comma-separated list, e.g. {option} 0,1,2") from None


def parse_args(argv: list[str]) -> Settings:
    parser = argparse.ArgumentParser(
        prog="python -m eval.ablation",
        description="Train and evaluate DFlash v1 / DFlash2 variants over seeds; writes OUT/ablation.{md,json}. "
        "Positional KEY=VALUE arguments are Hydra overrides of every `python train.py` run.",
    )
    parser.add_argument("--out", type=Path, default=Path("outputs/ablation"), help="output folder (resumable)")
    # comma-separated lists, so that a list never swallows the positional overrides that follow it
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated training seeds (default 0,1,2)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {','.join(VARIANTS)}")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="training runs at a time")
    parser.add_argument("--threads-per-run", type=int, default=1, help="CPU threads per run; 1 = bitwise reproducible")
    parser.add_argument("--data-seed", type=int, default=0, help="seed of the shared regenerated data")
    parser.add_argument("--num-prompts", type=int, default=32, help="held-out prompts asked per evaluation")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=64, help="length of each held-out prompt")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of every training run (trainer.max_steps=800)")
    a = parser.parse_args(argv)
    for name in ("jobs", "threads_per_run", "num_prompts", "max_new_tokens", "prompt_tokens"):
        if getattr(a, name) < 1:
            raise DFlash2Error(f"--{name.replace('_', '-')}={getattr(a, name)} must be >= 1")
    return Settings(
        out=a.out.resolve(),
        seeds=list(dict.fromkeys(comma_list(a.seeds, int, "--seeds"))),
        variants=list(dict.fromkeys(comma_list(a.variants, str, "--variants"))),
        jobs=a.jobs,
        threads_per_run=a.threads_per_run,
        data_seed=a.data_seed,
        num_prompts=a.num_prompts,
        max_new_tokens=a.max_new_tokens,
        prompt_tokens=a.prompt_tokens,
        overrides=list(a.overrides),
    )


def run(argv: list[str]) -> int:
    settings = parse_args(argv)
    check_overrides(settings.overrides)
    runs = plan(settings)
    record_or_check(settings)
    (settings.out / "plan.json").write_text(
        json.dumps({"settings": asdict(settings), "runs": [r.name for r in runs]}, indent=2, default=str) + "\n"
    )
    target_dir = prepare(settings)
    failures = execute(settings, runs, target_dir)
    summary = tabulate(settings, runs, argv)
    log.info((settings.out / "ablation.md").read_text())
    log.info(f"ablation: table in {settings.out / 'ablation.md'} and ablation.json ({len(summary)} variants)")
    if failures:
        log.warning(f"ablation: {len(failures)} run(s) failed; rerun the same command to retry them:")
        for problem in failures:
            log.warning(f"  {problem}")
        return 1
    return 0


def main() -> None:
    configure_console_logging()
    try:
        sys.exit(run(sys.argv[1:]))
    except DFlash2Error as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted; run the same command again to resume", file=sys.stderr)
        sys.exit(130)
