"""How the ablation runs (issue 11): the one preparation run, then the (variant, seed) runs as child
processes, ``jobs`` at a time, each training then evaluating, with a progress line.

Each child gets this checkout on its PYTHONPATH and ``threads_per_run`` CPU threads (OMP/MKL): with one
thread a run is bitwise reproducible (docs/RELIABILITY.md, Reproducibility). Children write into log files
in their run folder; a failed run is reported in one line with its log and the others go on.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import shlex
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from dflash2.errors import DFlash2Error
from dflash2.eval.ablation_plan import TIMES, Run, Settings, eval_command, prepare_command, repo_root, train_command

log = logging.getLogger(__name__)


def child_env(threads: int | None) -> dict[str, str]:
    """This checkout importable first in every child; ``threads`` CPU threads (None = the library default)."""
    root = str(repo_root())
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "PROJECT_ROOT": root, "TOKENIZERS_PARALLELISM": "false"}
    if threads is not None:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    return env


def prepare(settings: Settings) -> Path:
    """Build/reuse the target and the data once (all CPU threads); returns the published target folder."""
    log.info(f"ablation: preparing target and data: {shlex.join(prepare_command(settings))}")
    done = subprocess.run(prepare_command(settings), env=child_env(None), cwd=os.getcwd())
    if done.returncode != 0:
        raise DFlash2Error(
            f"preparing the target and data failed (exit {done.returncode}); see the messages above "
            f"(a bad override is reported there as one line)"
        )
    return settings.out / "prepare" / "target"


def _call(command: list[str], log: Path, threads: int, keep_open: tuple[int, ...] = ()) -> tuple[int, float]:
    """Run ``command`` with its output in ``log``; returns (exit status, wall seconds).
    keep_open: file descriptors the child inherits (the run's lock, see ``run_lock``)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with open(log, "w") as handle:
        handle.write(shlex.join(command) + "\n")
        handle.flush()
        env = child_env(threads)
        rc = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, env=env, pass_fds=keep_open).returncode
    return rc, time.perf_counter() - started


@contextmanager
def run_lock(run: Run):
    """An exclusive lock on ``run.dir/.ablation.lock``: yields its file descriptor, or None when another process
    holds it. The children inherit the descriptor, so the lock outlives a killed ablation process for as long
    as its orphaned child still trains, and a second ablation never trains the same run beside it. Without
    ``fcntl`` (Windows) there is no lock."""
    run.dir.mkdir(parents=True, exist_ok=True)
    with open(run.dir / ".ablation.lock", "a") as handle:
        try:
            import fcntl
        except ImportError:
            yield None
            return
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield -1
            return
        yield handle.fileno()


def _record_time(run: Run, key: str, seconds: float) -> None:
    path = run.dir / TIMES
    times = json.loads(path.read_text()) if path.is_file() else {}
    times[key] = seconds
    path.write_text(json.dumps(times, indent=2) + "\n")


def train_and_evaluate(settings: Settings, run: Run, target_dir: Path) -> str | None:
    """Train (unless complete) then evaluate (unless done) one run; returns None or a one-line failure."""
    with run_lock(run) as lock:
        if lock == -1:
            return f"{run.name}: another process is working on {run.dir} (its .ablation.lock is held); not started"
        keep_open = () if lock is None else (lock,)
        if not run.trained:
            command, log_file = train_command(settings, run, target_dir), run.dir / "train.console.log"
            rc, seconds = _call(command, log_file, settings.threads_per_run, keep_open)
            if rc != 0:
                return f"{run.name}: training failed (exit {rc}); log {log_file}"
            _record_time(run, "train_seconds", seconds)
        if not run.evaluated:
            command, log_file = eval_command(settings, run, target_dir), run.dir / f"{settings.eval_name}.console.log"
            rc, seconds = _call(command, log_file, settings.threads_per_run, keep_open)
            if rc != 0:
                return f"{run.name}: evaluation failed (exit {rc}); log {log_file}"
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
    log.info(
        f"ablation: {len(runs) - len(todo)} of {len(runs)} runs already trained and evaluated; "
        f"{len(todo)} to go, {settings.jobs} at a time, {settings.threads_per_run} thread(s) each"
    )
    failures: list[str] = []
    started, shown, last_print = time.perf_counter(), "", 0.0
    pool = ThreadPoolExecutor(max_workers=max(1, settings.jobs))
    futures = {pool.submit(train_and_evaluate, settings, r, target_dir): r for r in todo}
    try:
        while futures:
            for future in [f for f in futures if f.done()]:
                futures.pop(future)
                problem = future.result()
                if problem:
                    failures.append(problem)
                    log.warning(f"ablation: {problem}")
            now = time.perf_counter()
            counts = progress(runs, failures)
            if counts != shown or now - last_print >= refresh_s:
                elapsed = time.strftime("%H:%M:%S", time.gmtime(now - started))
                doing = activity([r for f, r in futures.items() if f.running()])
                log.info(f"ablation {elapsed}: {counts}" + (f" | {doing}" if doing else ""))
                shown, last_print = counts, now
            time.sleep(0.5)
    except KeyboardInterrupt:
        # the running children got the same Ctrl-C (one process group); start no queued run after it
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
    log.info(f"ablation: {progress(runs, failures)}")
    return failures
