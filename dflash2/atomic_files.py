"""Writes that never leave a partial file under the final name (issue 6).

Temp file in the same folder, fsync, ``os.replace``, then fsync of the folder.
Kept free of Lightning so that the data package (regeneration shards) and the
training package (checkpoints) share one implementation.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from pathlib import Path
from typing import Any

import torch


@contextlib.contextmanager
def _replacing(path: Path):
    """Yield a fresh temp path beside ``path`` for the caller to write and fsync; then ``os.replace`` it
    onto ``path`` and fsync the folder, or, if the body raised, remove it. The shared half of both writers."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def atomic_torch_save(obj: Any, path: Path) -> None:
    """``torch.save(obj, path)`` that never leaves a partial file under ``path``."""
    with _replacing(path) as tmp:
        # Not mkstemp: its 0600 mode would differ from Lightning's plain open(); O_EXCL + umask gives the usual mode.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())


def fsync_dir(folder: Path) -> None:
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


def atomic_write_with(path: Path, write: Any) -> None:
    """``write(tmp_path)`` then fsync + ``os.replace`` onto ``path``: for writers that take a file name
    (``safetensors.torch.save_file``, JSON) rather than a file object; the same guarantee as above."""
    with _replacing(path) as tmp:
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
