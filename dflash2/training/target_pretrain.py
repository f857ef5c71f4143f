"""Pretraining of the embedded default target with Lightning (ARCHITECTURE.md §8).

The pieces: a map-style dataset of random token windows (deterministic per
index, so a rebuild from the same seed sees the same batches), a data module
whose train loader starts at the trainer's current step (so a build resumed
from a checkpoint sees the batches the uninterrupted build would have seen), a
LightningModule around the HF causal LM, and held-out evaluation next to
unigram baselines.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from dflash2.training.schedule import cosine_with_warmup


class RandomWindows(Dataset):
    """`num_samples` windows of `seq_len` tokens drawn from one token stream.

    Window i starts at a position drawn from a generator seeded by (seed, i):
    the data order depends only on the seed, never on workers or timing.
    Items are (seq_len,) int64 tensors.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, num_samples: int, seed: int):
        if len(tokens) <= seq_len:
            raise ValueError(f"token stream of {len(tokens)} tokens is shorter than seq_len={seq_len}")
        self.tokens, self.seq_len, self.num_samples, self.seed = tokens, seq_len, num_samples, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> torch.Tensor:
        start = int(np.random.default_rng((self.seed, i)).integers(0, len(self.tokens) - self.seq_len))
        return torch.from_numpy(self.tokens[start : start + self.seq_len].astype(np.int64))


class FromStepSampler(Sampler[int]):
    """Indices ``[step * batch_size, total_steps * batch_size)`` in order, where ``step = current_step()``
    is read each time iteration starts.

    Batch s of a run is therefore always items ``[s * batch_size, (s + 1) * batch_size)``, whether
    the run started at 0 or was resumed from a checkpoint at step s0 (Lightning restores
    ``global_step`` but does not skip the batches of a plain DataLoader already seen in the
    epoch). Reading the step lazily also covers Lightning ending the resumed "epoch" early
    and iterating the loader again: the new pass starts at the step actually reached.
    """

    def __init__(self, batch_size: int, total_steps: int, current_step: Callable[[], int]):
        self.batch_size, self.total_steps, self.current_step = int(batch_size), int(total_steps), current_step

    def _first_step(self) -> int:
        return min(max(0, int(self.current_step())), self.total_steps)

    def __len__(self) -> int:
        return (self.total_steps - self._first_step()) * self.batch_size

    def __iter__(self) -> Iterator[int]:
        return iter(range(self._first_step() * self.batch_size, self.total_steps * self.batch_size))


class ResumableWindowsData(L.LightningDataModule):
    """The pretraining loader: batches of `dataset` (e.g. `RandomWindows`) from the trainer's current step on.

    With ``global_step == 0`` this is exactly ``DataLoader(dataset, batch_size, shuffle=False)``
    cut to `total_steps` batches, i.e. the order of a build that never resumes.
    """

    def __init__(self, dataset: Dataset, batch_size: int, total_steps: int):
        super().__init__()
        self.dataset, self.batch_size, self.total_steps = dataset, int(batch_size), int(total_steps)
        if len(dataset) < self.batch_size * self.total_steps:
            raise ValueError(f"{len(dataset)} items are fewer than {self.total_steps} steps of {self.batch_size}")

    def _current_step(self) -> int:
        return int(self.trainer.global_step) if self.trainer is not None else 0

    def train_dataloader(self) -> DataLoader:
        sampler = FromStepSampler(self.batch_size, self.total_steps, self._current_step)
        return DataLoader(self.dataset, batch_size=self.batch_size, sampler=sampler, num_workers=0)


def consecutive_windows(tokens: np.ndarray, seq_len: int, max_windows: int) -> torch.Tensor:
    """Non-overlapping windows from the start of a stream: (W, seq_len) int64."""
    count = min(max_windows, len(tokens) // seq_len)
    if count == 0:
        raise ValueError(f"held-out stream of {len(tokens)} tokens is shorter than one window of {seq_len}")
    return torch.from_numpy(tokens[: count * seq_len].astype(np.int64)).view(count, seq_len)


class CausalLMPretrainModule(L.LightningModule):
    """Next-token cross-entropy on an HF causal LM; AdamW + cosine with warmup."""

    def __init__(self, model: torch.nn.Module, lr: float, weight_decay: float, warmup_steps: int, max_steps: int):
        super().__init__()
        self.model = model
        self.lr, self.weight_decay = lr, weight_decay
        self.warmup_steps, self.max_steps = warmup_steps, max_steps

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("target/train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        decay = [p for n, p in self.model.named_parameters() if p.ndim >= 2]
        no_decay = [p for n, p in self.model.named_parameters() if p.ndim < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": self.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=self.lr,
            betas=(0.9, 0.95),
        )
        scheduler = cosine_with_warmup(optimizer, self.warmup_steps, self.max_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


@torch.no_grad()
def heldout_cross_entropy(model: torch.nn.Module, windows: torch.Tensor, batch_size: int = 16) -> float:
    """Mean next-token cross-entropy (nats/token) of `model` on (W, T) windows."""
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for chunk in windows.split(batch_size):
        chunk = chunk.to(device)
        logits = model(input_ids=chunk).logits[:, :-1].float()
        targets = chunk[:, 1:]
        total += torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum"
        ).item()
        count += targets.numel()
    return total / count


def unigram_cross_entropies(train_tokens: np.ndarray, windows: torch.Tensor, vocab_size: int) -> dict[str, float]:
    """Unigram baselines on the tokens that `heldout_cross_entropy` scores.

    - `unigram_train`: frequencies fitted on the train stream (add-one smoothed),
      the baseline a model must beat to have learned anything beyond counts.
    - `unigram_oracle`: frequencies fitted on the held-out targets themselves,
      i.e. their unigram entropy, the best any unigram model could do.
    """
    targets = windows[:, 1:].reshape(-1).numpy()
    train_counts = np.bincount(train_tokens, minlength=vocab_size).astype(np.float64) + 1.0
    train_logp = np.log(train_counts / train_counts.sum())
    oracle_counts = np.bincount(targets, minlength=vocab_size).astype(np.float64)
    oracle_p = oracle_counts / oracle_counts.sum()
    nonzero = oracle_p > 0
    return {
        "unigram_train": float(-train_logp[targets].mean()),
        "unigram_oracle": float(-(oracle_p[nonzero] * np.log(oracle_p[nonzero])).sum()),
    }


def perplexity(cross_entropy: float) -> float:
    return float(math.exp(min(cross_entropy, 50.0)))
