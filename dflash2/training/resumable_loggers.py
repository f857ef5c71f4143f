"""Loggers whose history survives a resume (issue 10): after ``ckpt_path=...`` the run's CSV,
TensorBoard and W&B logs hold every step once, from the first to the last.

A run killed after its step-``g`` checkpoint has logged steps up to some ``k >= g``; the
resumed run starts again at step ``g`` (Lightning logs the batch trained at global step ``s``
under step ``s``), so it logs steps ``g..k`` a second time. Before training starts,
:func:`resume_histories` tells each logger ``g``:

- CSV: the rows of the existing ``metrics.csv`` with step < g are kept and the new rows are
  appended (Lightning's CSVLogger would delete the file); columns are merged.
- TensorBoard: the new SummaryWriter gets ``purge_step=g``: TensorBoard (and its
  EventAccumulator) drops the earlier events at steps >= g, so the re-run steps replace them.
- W&B: the same run id (kept in ``<save_dir>/wandb/dflash2_run_id``) is resumed, and the
  (step, metric) pairs the run already holds (read from its local transaction logs,
  dflash2/training/wandb_history.py) are not sent again. W&B history cannot be truncated
  without its "rewind" feature (a private preview), so for steps ``g..k`` W&B keeps the values
  the killed process logged; they equal the re-run's where resuming is deterministic (CPU), and
  the CSV and TensorBoard logs hold the re-run's own. Offline runs keep one folder per segment;
  ``wandb sync`` uploads the segments of a run id in order, into one run.

A logger only keeps what reached the disk before the kill, so the CSV and TensorBoard loggers
write each logging call through (configs/logger/*.yaml, ``log_metrics``); a killed run loses
no logged row.
"""

from __future__ import annotations

import csv
import logging
import os
from pathlib import Path

from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger, WandbLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from dflash2.training.wandb_history import logged_step_metrics

log = logging.getLogger(__name__)

WANDB_RUN_ID_FILE = "dflash2_run_id"


def resume_histories(loggers: list, step: int) -> None:
    """Tell each logger that the run resumes at global step ``step`` (before training starts)."""
    for logger in loggers:
        if hasattr(logger, "resume_history_at"):
            logger.resume_history_at(step)
        else:
            log.warning(
                f"{type(logger).__name__} does not keep its history across a resume: its steps >= {step} may repeat"
            )


class _HistoryKeepingWriter(ExperimentWriter):
    """Lightning's CSV writer, but an existing metrics.csv keeps its rows with step < ``keep_before``."""

    def __init__(self, log_dir: str, keep_before: int):
        self._keep_before = keep_before
        super().__init__(log_dir)

    def _check_log_dir_exists(self) -> None:
        # Called by the base __init__ where Lightning deletes the previous metrics.csv.
        if not self._fs.isfile(self.metrics_file_path):
            return
        with self._fs.open(self.metrics_file_path, "r", newline="") as file:
            reader = csv.DictReader(file)
            header = list(reader.fieldnames or [])
            kept = [row for row in reader if row.get("step") and int(float(row["step"])) < self._keep_before]
        # Appends must follow the file's column order; new columns make the base class rewrite the header.
        self.metrics_keys = header
        tmp = f"{self.metrics_file_path}.tmp"
        with self._fs.open(tmp, "w", newline="") as file:
            writer = csv.DictWriter(file, fieldnames=header)
            writer.writeheader()
            writer.writerows(kept)
        self._fs.mv(tmp, self.metrics_file_path)  # a rename: a kill leaves the old file or the new one


class ResumableCSVLogger(CSVLogger):
    """Lightning's CSVLogger; after :meth:`resume_history_at` it continues the existing metrics.csv."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._resume_step: int | None = None

    def resume_history_at(self, step: int) -> None:
        if self._experiment is not None:
            raise RuntimeError("resume_history_at must be called before the logger writes anything")
        self._resume_step = int(step)

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None and self._resume_step is not None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _HistoryKeepingWriter(self.log_dir, self._resume_step)
        return super().experiment


class ResumableTensorBoardLogger(TensorBoardLogger):
    """Lightning's TensorBoardLogger whose events replace those of earlier processes from the run's
    (re)start step on (``purge_step``: 0 for a fresh run, which hides a previous run in the same
    folder), and which flushes every logging call so that a killed run leaves all it logged."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("purge_step", 0)
        super().__init__(*args, **kwargs)

    def resume_history_at(self, step: int) -> None:
        if self._experiment is not None:
            raise RuntimeError("resume_history_at must be called before the logger writes anything")
        self._kwargs["purge_step"] = int(step)  # the SummaryWriter arguments, used when it is created

    @rank_zero_only
    def log_metrics(self, metrics, step: int | None = None) -> None:
        super().log_metrics(metrics, step)
        self.experiment.flush()


class ResumableWandbLogger(WandbLogger):
    """Lightning's WandbLogger that records its run id in the run folder and, after
    :meth:`resume_history_at`, continues that run without sending a (step, metric) twice."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._already_logged: set[tuple[int, str]] = set()
        self._run_id_recorded = False

    @property
    def _wandb_dir(self) -> Path:
        return Path(self.save_dir or ".") / "wandb"

    def resume_history_at(self, step: int) -> None:
        if self._experiment is not None:
            raise RuntimeError("resume_history_at must be called before the logger writes anything")
        id_file = self._wandb_dir / WANDB_RUN_ID_FILE
        run_id = self._wandb_init.get("id") or (id_file.read_text().strip() if id_file.is_file() else None)
        if not run_id:
            log.warning(f"no W&B run id in {id_file}: the resumed run is logged as a new W&B run")
            return
        self._wandb_init["id"] = run_id  # with Lightning's resume="allow": the same run, continued
        try:
            self._already_logged = logged_step_metrics(self._wandb_dir, run_id)
        except Exception as err:  # an unreadable log only costs de-duplication, never the run
            log.warning(f"could not read the W&B history of run {run_id} ({err}); steps >= {step} may repeat")

    @property
    def experiment(self):
        run = super().experiment
        if rank_zero_only.rank == 0 and not self._run_id_recorded:  # other ranks hold a stand-in, not the run
            self._run_id_recorded = True
            self._wandb_dir.mkdir(parents=True, exist_ok=True)
            tmp = self._wandb_dir / f".{WANDB_RUN_ID_FILE}.tmp"
            tmp.write_text(run.id)
            os.replace(tmp, self._wandb_dir / WANDB_RUN_ID_FILE)
        return run

    @rank_zero_only
    def finalize(self, status: str) -> None:
        super().finalize(status)
        # Lightning leaves the W&B run open until the process exits; a second run in the same process
        # (a notebook, a test) would then log into this one instead of its own.
        if self._experiment is not None and hasattr(self._experiment, "finish"):
            self._experiment.finish(exit_code=0 if status == "success" else 1)

    @rank_zero_only
    def log_metrics(self, metrics, step: int | None = None) -> None:
        if step is not None and self._already_logged:
            join = self.LOGGER_JOIN_CHAR
            metrics = {
                k: v
                for k, v in metrics.items()
                if (int(step), f"{self._prefix}{join}{k}" if self._prefix else k) not in self._already_logged
            }
            if not metrics:
                return
        super().log_metrics(metrics, step)
