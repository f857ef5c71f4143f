"""Logger factories for the `logger/` config group.

wandb is imported only when this factory runs. Its mode is decided up front so
that a run never blocks on a login prompt or a dead network: `auto` means
online only when an API key is configured and api.wandb.ai answers within two
seconds, offline otherwise (files under save_dir/wandb, syncable later).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from dflash2.errors import DFlash2Error


def wandb_mode(requested: str = "auto") -> str:
    """Resolve `auto` into `online` or `offline`; an explicit mode passes through.

    For `auto`, a WANDB_MODE already in the environment is respected.
    """
    if requested != "auto":
        return requested
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    has_key = bool(os.environ.get("WANDB_API_KEY")) or _netrc_has_wandb()
    if not has_key:
        return "offline"
    try:
        with socket.create_connection(("api.wandb.ai", 443), timeout=2.0):
            return "online"
    except OSError:
        return "offline"


def _netrc_has_wandb() -> bool:
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        return "api.wandb.ai" in netrc.read_text()
    except OSError:
        return False


def make_wandb_logger(
    project: str = "dflash2",
    name: str | None = None,
    save_dir: str = ".",
    mode: str = "auto",
    flush_seconds: float = 1.0,
    **kwargs,
):
    """A WandbLogger in the resolved mode (or None when mode is `disabled`) whose history survives a
    resume (dflash2/training/resumable_loggers.py)."""
    resolved = wandb_mode(mode)
    if resolved == "disabled":
        return None
    try:
        import wandb  # Lightning's WandbLogger needs it; fail here with the fix instead
    except ImportError as err:
        raise DFlash2Error(
            "logger=wandb needs the wandb package: pip install wandb, or pick logger=csv or logger=tensorboard"
        ) from err
    from dflash2.training.resumable_loggers import ResumableWandbLogger

    os.environ["WANDB_MODE"] = resolved  # also governs wandb's own subprocess
    os.environ.setdefault("WANDB_SILENT", "true")
    Path(save_dir).mkdir(parents=True, exist_ok=True)
    # wandb writes the run's local log (the only copy offline) every 15 s by default: a killed run would
    # lose up to 15 s of rows, some from before its checkpoint, which the resumed run does not log again.
    # The setting is a private one of wandb's; an SDK without it keeps its default.
    if "settings" not in kwargs and "x_transaction_log_flush_interval" in getattr(wandb.Settings, "model_fields", {}):
        kwargs["settings"] = wandb.Settings(x_transaction_log_flush_interval=float(flush_seconds))
    return ResumableWandbLogger(project=project, name=name, save_dir=save_dir, offline=resolved == "offline", **kwargs)
