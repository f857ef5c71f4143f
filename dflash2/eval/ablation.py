"""`python -m eval.ablation`: train and evaluate every DFlash v1 / DFlash2 variant over several seeds
and write a table of mean ± std τ and per-position acceptance (issue 11; docs/ABLATION.md).

1. Prepare, once: ``python train.py task=data`` builds (or reuses) the target and regenerates (or finds
   cached) the drafter data, with the data seed. Every run then reads that target and that data, so
   the runs only differ in the variant and the training seed (initial weights, batch order, anchors).
2. Train: ``python train.py drafter=<variant> seed=<seed> ...`` per (variant, seed), ``jobs`` at a time,
   each a child process with ``threads_per_run`` CPU threads (1 by default: bitwise reproducible).
3. Evaluate: ``python -m eval.acceptance`` (real lossless decoding, T=0) of each trained drafter on the
   same held-out prompts.
4. Tabulate: ``ablation.md`` and ``ablation.json`` in the output folder (``dflash2.eval.ablation_table``).

Resumable: a run whose drafter and train_summary.json exist is not trained again, a run killed part-way
resumes from its last checkpoint, and an evaluation with the same settings is not repeated. Child
processes only: this module imports neither Lightning nor Hydra.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from dflash2.errors import DFlash2Error

REPO_ROOT = Path(__file__).resolve().parents[2]
# drafter config option (configs/drafter/<name>.yaml) -> what it is
VARIANTS = {
    "dflash": "DFlash v1",
    "dflash_matched": "v1, MLP widened to DFlash2's parameter count",
    "dflash2_conv_only": "v1 + block-local conv",
    "dflash2_selector_only": "v1 + candidate selector",
    "dflash2": "DFlash2 (conv + selector)",
}
BASELINE = "dflash"
# Set by the ablation for each run; a user override of these would silently break the design.
RESERVED_KEYS = {
    "seed",
    "task",
    "drafter",
    "data.seed",
    "ckpt_path",
    "paths.output_dir",
    "drafter.version",
    "drafter.use_local_conv",
    "drafter.use_selector",
    "drafter.match_dflash2_parameters",
}
RECORD = "ablation_settings.json"  # the training settings an output folder was made with (resume check)
TIMES = "ablation_times.json"  # per run: wall seconds of its training and of each evaluation


@dataclass
class Settings:
    out: Path
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    variants: list[str] = field(default_factory=lambda: list(VARIANTS))
    jobs: int = 1
    threads_per_run: int = 1
    data_seed: int = 0
    num_prompts: int = 64
    max_new_tokens: int = 128
    prompt_tokens: int = 64
    overrides: list[str] = field(default_factory=list)  # Hydra overrides of every `python train.py`

    @property
    def eval_name(self) -> str:
        """Folder of one evaluation setting inside a run: other settings evaluate again, no retraining."""
        return f"eval_p{self.num_prompts}_new{self.max_new_tokens}_len{self.prompt_tokens}"

    @property
    def deterministic(self) -> bool:
        return self.threads_per_run == 1


@dataclass
class Run:
    variant: str
    seed: int
    dir: Path
    eval_dir: Path

    @property
    def name(self) -> str:
        return f"{self.variant}/seed{self.seed}"

    @property
    def trained(self) -> bool:
        # train_summary.json is written after the drafter folder (train_drafter.py): both there = complete
        drafter = self.dir / "drafter"
        return (
            (drafter / "config.json").is_file()
            and (drafter / "model.safetensors").is_file()
            and (self.dir / "train_summary.json").is_file()
        )

    @property
    def evaluated(self) -> bool:
        return (self.eval_dir / "results.json").is_file()


# ------------------------------------------------------------------ plan and commands
def override_key(override: str) -> str:
    """`~a.b`, `+a.b=1`, `++a.b=1`, `a.b=1` -> `a.b`."""
    return override.lstrip("~+").split("=", 1)[0]


def check_overrides(overrides: list[str]) -> None:
    for o in overrides:
        key = override_key(o)
        if key in RESERVED_KEYS:
            raise DFlash2Error(
                f"override {o!r} is set by the ablation for each run; choose variants with --variants, seeds with "
                f"--seeds and the data seed with --data-seed"
            )


def plan(settings: Settings) -> list[Run]:
    unknown = [v for v in settings.variants if v not in VARIANTS]
    if unknown:
        raise DFlash2Error(f"unknown variant(s) {unknown}; choose from {list(VARIANTS)}")
    if not settings.seeds:
        raise DFlash2Error("no seeds given; pass --seeds 0 1 2")
    runs = []
    for variant in settings.variants:
        for seed in settings.seeds:
            run_dir = settings.out / "runs" / variant / f"seed{seed}"
            runs.append(Run(variant, seed, run_dir, run_dir / settings.eval_name))
    return runs


def record_or_check(settings: Settings) -> None:
    """An output folder is resumed only with the training settings it was made with."""
    wanted = {
        "overrides": settings.overrides,
        "data_seed": settings.data_seed,
        "threads_per_run": settings.threads_per_run,
    }
    path = settings.out / RECORD
    if path.is_file():
        made = json.loads(path.read_text())
        if made != wanted:
            changed = sorted(k for k in wanted if made.get(k) != wanted[k])
            raise DFlash2Error(
                f"{settings.out} holds runs made with other {', '.join(changed)} ({made}); "
                f"pass the same settings to resume it, or another --out"
            )
        return
    settings.out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(wanted, indent=2) + "\n")


def child_env(threads: int | None) -> dict[str, str]:
    """This checkout importable first in every child; ``threads`` CPU threads (None = the library default)."""
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "PROJECT_ROOT": str(REPO_ROOT), "TOKENIZERS_PARALLELISM": "false"}
    if threads is not None:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    return env


def prepare_command(settings: Settings) -> list[str]:
    return [
        sys.executable,
        str(REPO_ROOT / "train.py"),
        *settings.overrides,
        "task=data",
        f"seed={settings.data_seed}",
        f"paths.output_dir={settings.out / 'prepare'}",
    ]


def train_command(settings: Settings, run: Run, target_dir: Path) -> list[str]:
    user_keys = {override_key(o) for o in settings.overrides}
    defaults = []  # quiet, light logging for children writing into files; a user override wins
    if "logger" not in user_keys:
        defaults += ["logger=csv", "+logger.csv.flush_logs_every_n_steps=10"]  # frequent rows: progress display
    if "trainer.enable_progress_bar" not in user_keys:
        defaults.append("trainer.enable_progress_bar=false")
    if "callbacks.progress_bar" not in user_keys:
        defaults.append("~callbacks.progress_bar")
    resume = ["ckpt_path=last"] if (run.dir / "checkpoints" / "last.ckpt").is_file() else []
    return [
        sys.executable,
        str(REPO_ROOT / "train.py"),
        *defaults,
        *(o for o in settings.overrides if override_key(o) != "target.path"),
        f"target.path={target_dir}",
        f"drafter={run.variant}",
        f"seed={run.seed}",
        f"data.seed={settings.data_seed}",
        f"paths.output_dir={run.dir}",
        *resume,
    ]


def eval_command(settings: Settings, run: Run, target_dir: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "eval.acceptance",
        f"target={target_dir}",
        f"drafter={run.dir / 'drafter'}",
        "prompts=heldout",
        f"num_prompts={settings.num_prompts}",
        f"prompt_tokens={settings.prompt_tokens}",
        f"max_new_tokens={settings.max_new_tokens}",
        "temperature=0.0",
        "device=cpu",
        "seed=0",  # the same prompts and decoding seed for every drafter
        f"paths.output_dir={run.eval_dir}",
    ]


# ------------------------------------------------------------------ execution
def prepare(settings: Settings) -> Path:
    """Build/reuse the target and the data once (all CPU threads); returns the published target folder."""
    print(f"[ablation] preparing target and data: {shlex.join(prepare_command(settings))}", flush=True)
    done = subprocess.run(prepare_command(settings), env=child_env(None), cwd=os.getcwd())
    if done.returncode != 0:
        raise DFlash2Error(
            f"preparing the target and data failed (exit {done.returncode}); see the messages above "
            f"(a bad override is reported there as one line)"
        )
    return settings.out / "prepare" / "target"


def _call(command: list[str], log: Path, threads: int) -> tuple[int, float]:
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with open(log, "w") as handle:
        handle.write(shlex.join(command) + "\n")
        handle.flush()
        rc = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, env=child_env(threads)).returncode
    return rc, time.perf_counter() - started


def _record_time(run: Run, key: str, seconds: float) -> None:
    path = run.dir / TIMES
    times = json.loads(path.read_text()) if path.is_file() else {}
    times[key] = seconds
    path.write_text(json.dumps(times, indent=2) + "\n")


def train_and_evaluate(settings: Settings, run: Run, target_dir: Path) -> str | None:
    """Train (unless complete) then evaluate (unless done) one run; returns None or a one-line failure."""
    if not run.trained:
        rc, seconds = _call(train_command(settings, run, target_dir), run.dir / "train.log", settings.threads_per_run)
        if rc != 0:
            return f"{run.name}: training failed (exit {rc}); log {run.dir / 'train.log'}"
        _record_time(run, "train_seconds", seconds)
    if not run.evaluated:
        log = run.dir / f"{settings.eval_name}.log"
        rc, seconds = _call(eval_command(settings, run, target_dir), log, settings.threads_per_run)
        if rc != 0:
            return f"{run.name}: evaluation failed (exit {rc}); log {log}"
        _record_time(run, f"{settings.eval_name}_seconds", seconds)
    return None


def latest_step(run: Run) -> int | None:
    """The last training step in the run's metrics.csv (None before the first rows are written)."""
    path = run.dir / "csv" / "metrics.csv"
    try:
        with open(path) as handle:
            rows = list(csv.DictReader(handle))
    except (OSError, csv.Error):
        return None
    steps = [int(r["step"]) for r in rows if r.get("step", "").isdigit()]
    return max(steps) if steps else None


def progress(runs: list[Run], failures: list[str]) -> str:
    """Counts of finished stages: a new line is printed when they change."""
    done = lambda stage: sum(getattr(r, stage) for r in runs)  # noqa: E731
    return f"trained {done('trained')}/{len(runs)}, evaluated {done('evaluated')}/{len(runs)}, failed {len(failures)}"


def activity(running: list[Run]) -> str:
    """What each running job is doing: its last logged training step, or evaluating."""
    parts = []
    for r in running:
        step = None if r.trained else latest_step(r)
        parts.append(f"{r.name} " + ("evaluating" if r.trained else f"step {step}" if step is not None else "starting"))
    return "; ".join(parts)


def execute(settings: Settings, runs: list[Run], target_dir: Path, refresh_s: float = 30.0) -> list[str]:
    """All runs, ``settings.jobs`` at a time, with a status line on changes and every ``refresh_s``."""
    todo = [r for r in runs if not (r.trained and r.evaluated)]
    print(
        f"[ablation] {len(runs) - len(todo)} of {len(runs)} runs already trained and evaluated; "
        f"{len(todo)} to go, {settings.jobs} at a time, {settings.threads_per_run} thread(s) each",
        flush=True,
    )
    failures: list[str] = []
    started, shown, last_print = time.perf_counter(), "", 0.0
    with ThreadPoolExecutor(max_workers=max(1, settings.jobs)) as pool:
        futures = {pool.submit(train_and_evaluate, settings, r, target_dir): r for r in todo}
        while futures:
            for future in [f for f in futures if f.done()]:
                futures.pop(future)
                problem = future.result()
                if problem:
                    failures.append(problem)
                    print(f"[ablation] {problem}", flush=True)
            now = time.perf_counter()
            counts = progress(runs, failures)
            if counts != shown or now - last_print >= refresh_s:
                elapsed = time.strftime("%H:%M:%S", time.gmtime(now - started))
                doing = activity([r for f, r in futures.items() if f.running()])
                print(f"[ablation {elapsed}] {counts}" + (f" | {doing}" if doing else ""), flush=True)
                shown, last_print = counts, now
            time.sleep(0.5)
    print(f"[ablation] {progress(runs, failures)}", flush=True)
    return failures


# ------------------------------------------------------------------ table
def run_record(settings: Settings, run: Run) -> dict:
    from dflash2.drafter.config import DrafterConfig
    from dflash2.drafter.parameter_count import parameter_count
    from dflash2.eval.ablation_table import read_measurements

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


def header(settings: Settings, argv: list[str], runs: list[Run], done: int) -> dict:
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
        ("target and data", f"built once (data seed {settings.data_seed}): {settings.out / 'prepare'}"),
        ("seeds", ", ".join(str(s) for s in settings.seeds) + " (drafter init, batch order, anchors)"),
        (
            "evaluation",
            f"`python -m eval.acceptance` on {settings.num_prompts} held-out prompts of {settings.prompt_tokens} "
            f"tokens, {settings.max_new_tokens} new tokens, T=0, lossless check against plain greedy decoding",
        ),
        ("runs in the table", f"{done} of {len(runs)}"),
    ]
    record = {"threads_per_run": threads, "deterministic": settings.deterministic}
    return {"baseline": BASELINE, "lines": lines, "json": record}


def tabulate(settings: Settings, runs: list[Run], argv: list[str]) -> list[dict]:
    from dflash2.eval.ablation_table import summarise, write_table

    records = [run_record(settings, r) for r in runs if r.trained and r.evaluated]
    summary = summarise(records, BASELINE)
    write_table(settings.out, summary, records, header(settings, argv, runs, len(records)), VARIANTS)
    return summary


# ------------------------------------------------------------------ command line
def parse_args(argv: list[str]) -> Settings:
    parser = argparse.ArgumentParser(
        prog="python -m eval.ablation",
        description="Train and evaluate DFlash v1 / DFlash2 variants over seeds; writes OUT/ablation.{md,json}. "
        "Positional KEY=VALUE arguments are Hydra overrides of every `python train.py` run.",
    )
    parser.add_argument("--out", type=Path, default=Path("outputs/ablation"), help="output folder (resumable)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), help=f"from {list(VARIANTS)}")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="training runs at a time")
    parser.add_argument("--threads-per-run", type=int, default=1, help="CPU threads per run; 1 = bitwise reproducible")
    parser.add_argument("--data-seed", type=int, default=0, help="seed of the shared target build and data")
    parser.add_argument("--num-prompts", type=int, default=64, help="held-out prompts per evaluation")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=64, help="length of each held-out prompt")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of every training run (trainer.max_steps=800)")
    a = parser.parse_args(argv)
    for name in ("jobs", "threads_per_run", "num_prompts", "max_new_tokens", "prompt_tokens"):
        if getattr(a, name) < 1:
            raise DFlash2Error(f"--{name.replace('_', '-')}={getattr(a, name)} must be >= 1")
    return Settings(
        out=a.out.resolve(),
        seeds=list(dict.fromkeys(a.seeds)),
        variants=list(dict.fromkeys(a.variants)),
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
    print((settings.out / "ablation.md").read_text(), flush=True)
    print(f"[ablation] table: {settings.out / 'ablation.md'} and ablation.json ({len(summary)} variants)", flush=True)
    if failures:
        print(f"[ablation] {len(failures)} run(s) failed; rerun the same command to retry them:", file=sys.stderr)
        for problem in failures:
            print(f"  {problem}", file=sys.stderr)
        return 1
    return 0


def main() -> None:
    try:
        sys.exit(run(sys.argv[1:]))
    except DFlash2Error as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
