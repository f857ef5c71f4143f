"""The one way the library reads a torch (pickle) file: ``weights_only=True`` (issue 12).

A ``.ckpt`` / ``.pt`` is a pickle, and unpickling can call any importable function
(``os.system``, ``pathlib.Path.touch``...) before a single key is checked. Drafter
checkpoints get shared, so every load (export, ``ckpt_path`` preflight, the Trainer's
resume through ``AtomicCheckpointIO``, target-build resume, regeneration shards) goes
through ``torch.load(..., weights_only=True)``, which only rebuilds tensors and plain
containers. The project's own checkpoints need nothing more: Lightning's loop, callback,
optimizer and scheduler states are dicts, lists, numbers and strings, and dflash2 stores
its metadata (``checkpoint["dflash2"]``) as a plain dict (``DrafterConfig.to_dict``).
"""

from __future__ import annotations

import contextlib
import pickle
import re
from pathlib import Path
from typing import Any

import torch

from dflash2.errors import DFlash2Error


class UnsafeFileError(DFlash2Error):
    """A torch file holds pickled objects beyond tensors and plain data: refused, never unpickled."""


def load_torch_file(path, *, mmap: bool = False) -> Any:
    """``torch.load(path)`` on CPU that never runs code from the file.

    Raises UnsafeFileError (one line, naming the offending globals) for a file that
    references functions or classes; any other failure (truncated, not a torch file)
    is raised unchanged for the caller to explain in its own terms.
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        refusal = unsafe_load_error(path, e)
        if refusal is not None:
            raise refusal from None  # the pickle's own traceback would only repeat torch's advice to load unsafely
        # torch's message for a damaged or non-torch file advises weights_only=False: keep only the cause
        cause = re.search(r"WeightsUnpickler error:\s*([^\n]+)", str(e))
        detail = cause[1] if cause else "unreadable pickle"
        raise pickle.UnpicklingError(f"not an intact torch file ({detail})") from None


def unsafe_load_error(path, err: BaseException) -> UnsafeFileError | None:
    """The refusal for a weights-only load that failed on a forbidden global, else None.

    A truncated or non-torch file fails the same weights-only unpickler, so the file is
    refused as unsafe only when it really names globals (read from its pickle opcodes,
    which executes nothing; torch's message as a fallback for legacy non-zip files).
    """
    names: list[str] = []
    with contextlib.suppress(Exception):  # not a zip checkpoint, a remote path, unreadable: use the message
        names = list(torch.serialization.get_unsafe_globals_in_checkpoint(str(path)))
    if not names:
        names = re.findall(r"GLOBAL (\S+)", str(err))
    if not names:
        return None
    shown = ", ".join(sorted(set(names))[:4])
    return UnsafeFileError(
        f"{Path(str(path))} was not loaded: it holds pickled Python objects beyond tensors and plain data "
        f"({shown}), and unpickling them could run code; pass a file written by dflash2"
    )
