"""LightningDataModule of drafter training: batches of regenerated sequences.

Data order is a function of (seed, step) only, whatever the number of processes: the global
batch of step s is positions [s*B, (s+1)*B) of the run's index stream (B = data.batch_size, the
*global* batch), the concatenation of seeded permutations of the dataset, one per epoch of the
data. Rank r of a W-process run (DDP / FSDP) takes rows [r*B//W, (r+1)*B//W) of it: the ranks'
slices are disjoint and together the global batch, so a run sees the same rows at every step at
any world size, and a checkpoint resumes at another one. Lightning's DistributedSampler would
re-shard the stream instead (each rank's epoch then ends after total_steps / W steps), so the
trainer configs set ``use_distributed_sampler: false``.

Each row carries its key (step, row in the global batch): the anchors of a row are drawn from
an RNG keyed by (seed, step, row) (`row_anchor_generator`), the same on whichever rank it lands.

The step is read each time iteration starts, not when the loader is built: a run resumed from
a checkpoint starts there (no reliance on dataloader state), and after a mid-epoch resume
Lightning ends the shortened epoch early and iterates the same loader again; that pass must
start at the step actually reached. A "step" here is one loader batch: an optimizer step, or
one of its ``trainer.accumulate_grad_batches`` micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from dflash2.errors import DFlash2Error


class RowKey(NamedTuple):
    """One row of a step: dataset index, the step, and its place in the step's global batch."""

    index: int
    step: int
    row: int


def rank_rows(batch_size: int, rank: int, world_size: int) -> range:
    """The rows of a global batch that rank ``rank`` of ``world_size`` takes: a contiguous slice,
    sizes differing by one at most when ``world_size`` does not divide ``batch_size``."""
    return range(rank * batch_size // world_size, (rank + 1) * batch_size // world_size)


class StepSampler(Sampler[list[RowKey]]):
    """Batches of steps [start_step, total_steps) of a run: this rank's rows of each global batch.

    Epoch e of the data is permutation e (seeded by (seed, e)); the run's index stream is their
    concatenation, global batch s its positions [s*batch_size, (s+1)*batch_size). ``start_step``
    is an int or a callable returning the current step, read when iteration starts.
    """

    def __init__(
        self,
        dataset_len: int,
        batch_size: int,
        total_steps: int,
        seed: int,
        start_step: int | Callable[[], int] = 0,
        rank: int = 0,
        world_size: int = 1,
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside a world of {world_size}")
        if batch_size < world_size:
            raise DFlash2Error(
                f"data.batch_size={batch_size} is the global batch (all processes together) and is smaller than "
                f"the {world_size} processes of the run: raise data.batch_size to >= {world_size}"
            )
        self.n, self.batch_size, self.total_steps, self.seed = dataset_len, batch_size, total_steps, seed
        self.rank, self.world_size = rank, world_size
        self._start_step = start_step
        self._perms: dict[int, np.ndarray] = {}

    @property
    def start_step(self) -> int:
        step = self._start_step() if callable(self._start_step) else self._start_step
        return min(max(0, int(step)), self.total_steps)

    def __len__(self) -> int:
        return self.total_steps - self.start_step

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            self._perms = {e: p for e, p in self._perms.items() if e >= epoch - 1}  # the stream only moves on
            self._perms[epoch] = np.random.default_rng((self.seed, epoch)).permutation(self.n)
        return self._perms[epoch]

    def global_batch(self, step: int) -> list[int]:
        """Dataset indices of step ``step``'s global batch, in row order (the same at any world size)."""
        first = step * self.batch_size
        return [int(self._permutation(p // self.n)[p % self.n]) for p in range(first, first + self.batch_size)]

    def __iter__(self):
        rows = rank_rows(self.batch_size, self.rank, self.world_size)
        for step in range(self.start_step, self.total_steps):
            indices = self.global_batch(step)
            yield [RowKey(indices[r], step, r) for r in rows]


class KeyedRows(Dataset):
    """The dataset read by `RowKey`: each row with its anchor key (step, global row) added."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: RowKey) -> dict:
        return {**self.dataset[key.index], "anchor_key": (key.step, key.row)}


def collate_sequences(rows: list[dict], pad_id: int, pin: bool = False) -> dict[str, torch.Tensor]:
    """Right-pad rows to the longest: input_ids (N, L) int64, loss_mask (N, L) int64, and target_taps
    (N, L, K*d) when the rows carry stored taps (data.features=offline, training/offline_features.py).

    ``pin``: the taps are padded straight into page-locked host memory (needs CUDA; see
    ``DrafterDataModule``), so the loader's pinning has nothing left to copy for the largest tensor."""
    length = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r["input_ids"])] = torch.tensor(r["input_ids"])
        mask[i, : len(r["loss_mask"])] = torch.tensor(r["loss_mask"])
    batch = {"input_ids": ids, "loss_mask": mask}
    if "target_taps" in rows[0]:
        # zero on padding: the drafter never reads a padded position's taps (causal context, anchors on responses)
        first = rows[0]["target_taps"]
        taps = torch.zeros((len(rows), length, first.shape[-1]), dtype=first.dtype, pin_memory=pin)
        for i, r in enumerate(rows):
            taps[i, : r["target_taps"].shape[0]] = r["target_taps"]
        batch["target_taps"] = taps
    return batch


def collate_keyed_sequences(rows: list[dict], pad_id: int, pin: bool = False) -> dict[str, torch.Tensor]:
    """`collate_sequences` plus ``anchor_keys`` (N, 2) int64: each row's (step, row in the global batch)."""
    batch = collate_sequences(rows, pad_id, pin)
    batch["anchor_keys"] = torch.tensor([r["anchor_key"] for r in rows], dtype=torch.long).view(len(rows), 2)
    return batch


def check_pin_memory(value) -> bool | str:
    """``data.pin_memory`` (auto | true | false; null = auto)."""
    if value is None or value == "auto":
        return "auto"
    if isinstance(value, bool):
        return value
    raise DFlash2Error(f"data.pin_memory={value!r} must be auto, true or false")


class DrafterDataModule(L.LightningDataModule):
    """Train / validation loaders over regenerated `datasets.Dataset`s.

    ``pin_memory`` (data.pin_memory; auto = when the trainer's device is a GPU): batches in page-locked
    host memory. Lightning copies a batch to the GPU with ``non_blocking=True``; from pageable memory
    that copy still blocks the host until the GPU has finished its queued work and then crawls through
    a staging buffer (the offline taps, (N, L, K·d), are hundreds of MB a step at an 8B target), from
    pinned memory it is one asynchronous DMA. With ``num_workers=0`` the taps are padded straight into
    pinned memory (``collate_sequences(pin=True)``); with workers, the loader's pinning thread copies
    each batch into pinned memory beside the training loop. The batches' values are the same either way.
    """

    def __init__(
        self,
        train_dataset,
        val_dataset,
        *,
        batch_size: int,
        total_steps: int,
        seed: int,
        pad_id: int,
        num_workers: int = 0,
        pin_memory: bool | str = "auto",
    ):
        super().__init__()
        self.train_dataset, self.val_dataset = train_dataset, val_dataset
        self.batch_size, self.total_steps, self.seed = batch_size, total_steps, seed
        self.pad_id, self.num_workers = pad_id, num_workers
        self.pin_memory = check_pin_memory(pin_memory)

    def _pinned(self) -> bool:
        """Whether batches go to page-locked memory: auto = the trainer trains on a CUDA device; never
        without CUDA (page-locking goes through the CUDA driver)."""
        if not torch.cuda.is_available():
            return False
        if self.pin_memory != "auto":
            return bool(self.pin_memory)
        device = getattr(getattr(self.trainer, "strategy", None), "root_device", None)
        return device is not None and device.type == "cuda"

    def _pin_in_collate(self) -> bool:
        # Only in this process: a worker process must not touch CUDA (page-locking goes through it);
        # with workers the loader's pinning thread, in this process, does it.
        return self._pinned() and self.num_workers == 0

    def _accumulation(self) -> int:
        return int(self.trainer.accumulate_grad_batches) if self.trainer is not None else 1

    def _current_step(self) -> int:
        # Loader batches done: a checkpoint is written between optimizer steps, after all their micro-batches.
        return int(self.trainer.global_step) * self._accumulation() if self.trainer is not None else 0

    def _collate(self, rows):
        return collate_sequences(rows, self.pad_id, self._pin_in_collate())

    def _collate_keyed(self, rows):
        return collate_keyed_sequences(rows, self.pad_id, self._pin_in_collate())

    def train_dataloader(self) -> DataLoader:
        # Lazy: the trainer restores global_step before iterating, and may iterate again after a
        # shortened resumed epoch; each pass starts at the step reached (see the module docstring).
        rank, world = (self.trainer.global_rank, self.trainer.world_size) if self.trainer is not None else (0, 1)
        sampler = StepSampler(
            len(self.train_dataset),
            self.batch_size,
            self.total_steps * self._accumulation(),
            self.seed,
            self._current_step,
            rank=rank,
            world_size=world,
        )
        return DataLoader(
            KeyedRows(self.train_dataset),
            batch_sampler=sampler,
            collate_fn=self._collate_keyed,
            num_workers=self.num_workers,
            pin_memory=self._pinned(),
        )

    def val_dataloader(self) -> DataLoader:
        # Not sharded: every rank runs the whole validation split, so the logged numbers are the
        # one-process ones exactly (the split is small; the cost is W-fold redundant work).
        return DataLoader(
            self.val_dataset,
            batch_size=self.batch_size,
            shuffle=False,
            collate_fn=self._collate,
            num_workers=self.num_workers,
            pin_memory=self._pinned(),
        )
