"""Crash-safe Lightning checkpoints (issue 6).

Lightning's own ``TorchCheckpointIO`` serialises to memory and then opens the
final path for writing: a crash (SIGKILL, full disk, power loss) during that
write leaves a truncated ``.ckpt`` under the final name, and ``last.ckpt`` is
rewritten in place every interval. This plugin writes to a temporary file in
the same folder, fsyncs it, and ``os.replace``-s it onto the final name, so a
reader only ever sees the previous complete file or the new complete file.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose saves are atomic on a local filesystem (temp file + fsync + rename)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not take storage_options")
        if "://" in str(path):  # remote storage (s3://, gs://...): rename is not atomic there; keep Lightning's path
            return super().save_checkpoint(checkpoint, path)
        atomic_torch_save(checkpoint, Path(path))


def atomic_torch_save(obj: Any, path: Path) -> None:
    """``torch.save(obj, path)`` that never leaves a partial file under ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Not mkstemp: its 0600 mode would differ from Lightning's plain open(); O_EXCL + umask gives the usual mode.
    tmp = path.parent / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(path.parent)


def _fsync_dir(folder: Path) -> None:
    """Persist the rename itself (best effort; not every OS/filesystem allows opening a directory)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
