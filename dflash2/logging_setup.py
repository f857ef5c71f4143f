"""How dflash2's messages reach the console: one concise line per message, from one process.

Library modules only do ``log = logging.getLogger(__name__)`` and ``log.info(...)``; where the
lines go is decided by the entry point:

- ``python train.py`` and ``python -m eval.acceptance``: Hydra applies
  ``configs/hydra/job_logging/dflash2.yaml`` (console lines in the format below, the full
  record with time and logger in the run folder's ``<job>.log``);
- the other CLIs and notebooks: :func:`configure_console_logging`.

Free of Lightning on purpose (only dflash2/training imports it): the rank comes from the
environment variables Lightning, torchrun and SLURM set, and Lightning's loggers are found
by name.
"""

from __future__ import annotations

import logging
import os
import sys

# The variables Lightning's own rank_zero_only reads, in its order, so that "rank zero" means the same
# process for our lines as for Lightning's (lightning_fabric.utilities.rank_zero._get_rank).
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK")

# Lightning gives these loggers console handlers of its own when it is imported (with propagate=False
# for the last two when the root logger has no handler yet): every Lightning line would print twice
# beside a root handler, or bypass the format and the run's log file.
LIGHTNING_LOGGERS = ("lightning", "lightning.pytorch", "lightning.fabric")


def process_rank() -> int:
    """This process's rank in a multi-process run (0 when it is not one)."""
    for name in RANK_VARIABLES:
        value = os.environ.get(name)
        if value is not None:
            try:
                return int(value)
            except ValueError:
                continue
    return 0


class RankZeroFilter(logging.Filter):
    """Lets records through in the rank-0 process only: with DDP every rank runs the same script,
    and N copies of each line help no one. Read per record, as the launcher may set the rank late."""

    def filter(self, record: logging.LogRecord) -> bool:
        return process_rank() == 0


class ConsoleFormatter(logging.Formatter):
    """``[package] message``, with the level named from WARNING up: ``[dflash2] target: ...``,
    ``[lightning] GPU available: False, used: False``, ``[dflash2] WARNING: skipping prompt 1 ...``.

    The package says whose line it is without the date, module path and level of Hydra's default."""

    def format(self, record: logging.LogRecord) -> str:
        package = record.name.split(".", 1)[0]
        level = f"{record.levelname}: " if record.levelno >= logging.WARNING else ""
        line = f"[{package}] {level}{record.getMessage()}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def send_lightning_logs_to_root() -> None:
    """When the root logger has handlers (an entry point configured logging), remove Lightning's own
    console handlers so that its lines go through those, once (console format, rank filter, log file).
    Without root handlers Lightning's are the only ones, and stay. Call after Lightning is imported."""
    if not logging.getLogger().handlers:
        return
    for name in LIGHTNING_LOGGERS:
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            logger.removeHandler(handler)
        logger.propagate = True


def configure_console_logging(level: int = logging.INFO) -> None:
    """For CLIs run as scripts and for notebooks: INFO and up on stdout in the console format, rank 0
    only. Like ``logging.basicConfig``, it leaves a root logger that already has handlers alone
    (a host application's or pytest's), so it never doubles lines."""
    root = logging.getLogger()
    if root.handlers:
        return
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(ConsoleFormatter())
    handler.addFilter(RankZeroFilter())
    root.addHandler(handler)
    root.setLevel(level)
    send_lightning_logs_to_root()
