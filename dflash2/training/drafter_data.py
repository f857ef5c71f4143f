"""LightningDataModule of drafter training: batches of regenerated sequences.

Data order is a function of (seed, step) only: `StepSampler` walks seeded
permutations of the dataset and starts at `global_step * batch_size`, so a run
resumed from a checkpoint sees exactly the batches the uninterrupted run would
have seen (no reliance on dataloader state). The step is read each time
iteration starts, not when the loader is built: after a mid-epoch resume
Lightning ends the shortened epoch early and iterates the same loader again,
and that pass must start at the step actually reached.
"""

from __future__ import annotations

from collections.abc import Callable

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler


class StepSampler(Sampler[int]):
    """Indices for steps [start_step, total_steps) of a run, `batch_size` per step.

    Epoch e of the data is permutation e (seeded by (seed, e)); the run's index
    stream is their concatenation, cut to the run's steps. `start_step` is an
    int or a callable returning the current step, read when iteration starts.
    """

    def __init__(
        self, dataset_len: int, batch_size: int, total_steps: int, seed: int, start_step: int | Callable[[], int] = 0
    ):
        self.n, self.batch_size, self.total_steps, self.seed = dataset_len, batch_size, total_steps, seed
        self._start_step = start_step

    @property
    def start_step(self) -> int:
        step = self._start_step() if callable(self._start_step) else self._start_step
        return min(max(0, int(step)), self.total_steps)

    def __len__(self) -> int:
        return (self.total_steps - self.start_step) * self.batch_size

    def __iter__(self):
        first, last = self.start_step * self.batch_size, self.total_steps * self.batch_size
        epoch = first // self.n
        offset = first - epoch * self.n
        produced = first
        while produced < last:
            perm = np.random.default_rng((self.seed, epoch)).permutation(self.n)
            for i in perm[offset:]:
                if produced >= last:
                    return
                yield int(i)
                produced += 1
            epoch, offset = epoch + 1, 0


def collate_sequences(rows: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad rows to the longest: input_ids (N, L) int64, loss_mask (N, L) int64, and target_taps
    (N, L, K*d) when the rows carry stored taps (data.features=offline, training/offline_features.py)."""
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
        batch["target_taps"] = first.new_zeros((len(rows), length, first.shape[-1]))
        for i, r in enumerate(rows):
            batch["target_taps"][i, : r["target_taps"].shape[0]] = r["target_taps"]
    return batch


class DrafterDataModule(L.LightningDataModule):
    """Train / validation loaders over regenerated `datasets.Dataset`s."""

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
    ):
        super().__init__()
        self.train_dataset, self.val_dataset = train_dataset, val_dataset
        self.batch_size, self.total_steps, self.seed = batch_size, total_steps, seed
        self.pad_id, self.num_workers = pad_id, num_workers

    def _current_step(self) -> int:
        return int(self.trainer.global_step) if self.trainer is not None else 0

    def _collate(self, rows):
        return collate_sequences(rows, self.pad_id)

    def train_dataloader(self) -> DataLoader:
        # Lazy: the trainer restores global_step before iterating, and may iterate again after a
        # shortened resumed epoch; each pass starts at the step reached (see the module docstring).
        sampler = StepSampler(len(self.train_dataset), self.batch_size, self.total_steps, self.seed, self._current_step)
        return DataLoader(
            self.train_dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            collate_fn=self._collate,
            num_workers=self.num_workers,
            drop_last=False,
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(
            self.val_dataset,
            batch_size=self.batch_size,
            shuffle=False,
            collate_fn=self._collate,
            num_workers=self.num_workers,
        )
