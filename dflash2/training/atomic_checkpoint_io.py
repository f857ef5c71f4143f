"""Crash-safe Lightning checkpoints (issue 6).

Lightning's own ``TorchCheckpointIO`` serialises to memory and then opens the
final path for writing: a crash (SIGKILL, full disk, power loss) during that
write leaves a truncated ``.ckpt`` under the final name, and ``last.ckpt`` is
rewritten in place every interval. This plugin writes to a temporary file in
the same folder, fsyncs it, and ``os.replace``-s it onto the final name, so a
reader only ever sees the previous complete file or the new complete file.

Loads (the Trainer's resume from ``ckpt_path``) are always ``weights_only=True``:
a shared ``.ckpt`` is a pickle that could otherwise run code (see dflash2/safe_load.py).
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

from lightning.pytorch.plugins.io import TorchCheckpointIO

from dflash2.atomic_files import atomic_torch_save
from dflash2.safe_load import unsafe_load_error


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose saves are atomic on a local filesystem (temp file + fsync + rename)
    and whose loads never unpickle code."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not take storage_options")
        if "://" in str(path):  # remote storage (s3://, gs://...): rename is not atomic there; keep Lightning's path
            return super().save_checkpoint(checkpoint, path)
        atomic_torch_save(checkpoint, Path(path))

    def load_checkpoint(self, path, map_location: Any | None = lambda storage, loc: storage, weights_only=None):
        # weights_only=None would leave it to torch's default (and TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD);
        # False is never right for a file a user hands over, so every load is weights-only.
        try:
            return super().load_checkpoint(path, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as e:
            refusal = unsafe_load_error(path, e)
            if refusal is not None:
                raise refusal from None
            raise
