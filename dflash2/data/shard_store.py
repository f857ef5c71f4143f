"""Crash-safe store of finished regeneration batches (issue 6).

Regenerating a split on a real target takes hours; a kill (preemption, OOM
killer, a second Ctrl-C) must cost at most the batch in flight. While
`regenerate_split` runs, every finished generation batch is written to its own
file `batch-000003.pt` in a partial folder next to the final dataset. Each
shard holds

    index            int, the position of the batch in the prompt batches
    prompt           (n, P) int64, the batch's prompts
    response         (n, R) int64, the target's continuation (R = data.response_tokens)
    generator_state  uint8 tensor, `torch.Generator.get_state()` *after* this batch

so a rerun can skip the finished batches and continue sampling from the same
RNG state. Files are written to a temp name, fsynced and `os.replace`-d: a file
under a shard name is always complete. The prompts are stored because the
cache key leaves out `data.generation_batch_size`, which changes how prompts
are batched: a shard whose prompts differ from the current batch is stale.

The atomic write is `dflash2.atomic_files.atomic_torch_save`, shared with the
training checkpoints.
"""

from __future__ import annotations

import logging
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash2.atomic_files import atomic_torch_save
from dflash2.safe_load import load_torch_file

log = logging.getLogger(__name__)

SHARD_NAME = re.compile(r"batch-(\d{6})\.pt")


@dataclass
class Shard:
    """One finished generation batch; shapes as in the module docstring."""

    index: int
    prompt: torch.Tensor
    response: torch.Tensor
    generator_state: torch.Tensor


class ShardStore:
    """The partial folder of one regeneration; shards must be saved in batch order."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)

    def path(self, index: int) -> Path:
        return self.folder / f"batch-{index:06d}.pt"

    def save(self, shard: Shard) -> None:
        """Write `shard` atomically (temp file + fsync + rename)."""
        path = self.path(shard.index)
        # atomic_torch_save creates the folder on every save: a concurrent run of the same split (one per
        # DDP rank) that finished first removes it; its final dataset then exists and our later shards are moot.
        payload = {
            "index": shard.index,
            "prompt": shard.prompt,
            "response": shard.response,
            "generator_state": shard.generator_state,
        }
        try:
            atomic_torch_save(payload, path)
        except FileNotFoundError:
            # The folder or our temp file was removed by a concurrent run (see above / `load`):
            # only the crash-resume copy of this batch is lost, never the batch itself.
            return

    def load(self, prompts: list[torch.Tensor], response_tokens: int) -> list[Shard]:
        """The valid shards 0..k-1 for these prompt batches (each (n, P) int64), in order.

        Stray temp files are deleted. A shard that does not load or does not match
        its prompt batch is deleted with every later one: those batches are
        regenerated, since the generator state of the later shards follows from it.
        """
        if not self.folder.is_dir():
            return []
        names = {p.name: p for p in self.folder.iterdir()}
        for name, p in names.items():
            if not SHARD_NAME.fullmatch(name):
                _unlink(p)  # a temp file of a killed write
        shards: list[Shard] = []
        while len(shards) < len(prompts) and self.path(len(shards)).name in names:
            shard = self._read(len(shards), prompts[len(shards)], response_tokens)
            if shard is None:
                break
            shards.append(shard)
        for name, p in names.items():
            m = SHARD_NAME.fullmatch(name)
            if m and int(m.group(1)) >= len(shards):
                _unlink(p)
        return shards

    def _read(self, index: int, prompt: torch.Tensor, response_tokens: int) -> Shard | None:
        path = self.path(index)
        try:
            d = load_torch_file(path)
            shard = Shard(int(d["index"]), d["prompt"], d["response"], d["generator_state"])
            valid = (
                shard.index == index
                and torch.equal(shard.prompt, prompt)
                and shard.response.dtype == torch.int64
                and tuple(shard.response.shape) == (prompt.shape[0], response_tokens)
                and shard.generator_state.dtype == torch.uint8
            )
        except Exception as e:  # a truncated or foreign file: any error means "regenerate this batch"
            log.warning(f"discarding unreadable regeneration shard {path} ({type(e).__name__}); it is regenerated")
            return None
        if not valid:
            log.warning(f"discarding regeneration shard {path}: made for other prompts or settings; it is regenerated")
            return None
        return shard

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def _unlink(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
        return
    path.unlink(missing_ok=True)
