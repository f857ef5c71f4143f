"""data.pin_memory: training batches in page-locked host memory when the trainer trains on a GPU
(dflash2/training/drafter_data.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import dflash2.training.drafter_data as drafter_data
from dflash2.errors import DFlash2Error
from dflash2.training.drafter_data import DrafterDataModule, check_pin_memory, collate_sequences


def _rows(n: int = 6, width: int = 5) -> list[dict]:
    """Offline-feature rows of different lengths: input_ids, loss_mask and target_taps (len, width) bf16."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(n):
        length = 4 + i
        rows.append(
            {
                "input_ids": torch.randint(0, 50, (length,), generator=g).tolist(),
                "loss_mask": [0, 0] + [1] * (length - 2),
                "target_taps": torch.randn(length, width, generator=g).bfloat16(),
            }
        )
    return rows


def _trainer(device: str) -> SimpleNamespace:
    """What the data module reads of a Lightning Trainer."""
    strategy = SimpleNamespace(root_device=torch.device(device))
    return SimpleNamespace(strategy=strategy, global_step=0, accumulate_grad_batches=1, global_rank=0, world_size=1)


def _module(pin_memory="auto", device: str | None = "cpu", num_workers: int = 0) -> DrafterDataModule:
    rows = _rows()
    dm = DrafterDataModule(
        rows, rows, batch_size=2, total_steps=2, seed=0, pad_id=0, num_workers=num_workers, pin_memory=pin_memory
    )
    dm.trainer = None if device is None else _trainer(device)
    return dm


def test_check_pin_memory():
    assert check_pin_memory(None) == "auto" and check_pin_memory("auto") == "auto"
    assert check_pin_memory(True) is True and check_pin_memory(False) is False
    with pytest.raises(DFlash2Error, match=r"data\.pin_memory='yes' must be auto, true or false"):
        check_pin_memory("yes")


@pytest.mark.parametrize(
    "setting,device,pinned",
    [
        ("auto", "cuda", True),
        ("auto", "cpu", False),
        ("auto", None, False),
        (True, "cpu", True),
        (False, "cuda", False),
    ],
)
def test_auto_pins_when_the_trainer_trains_on_a_gpu(monkeypatch, setting, device, pinned):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a CUDA machine, as far as the loader asks
    dm = _module(setting, device)
    assert dm.train_dataloader().pin_memory is pinned
    assert dm.val_dataloader().pin_memory is pinned


@pytest.mark.parametrize("num_workers,in_collate", [(0, True), (2, False)])
def test_without_workers_the_taps_are_padded_straight_into_pinned_memory(monkeypatch, num_workers, in_collate):
    """No worker: collate allocates the pinned batch itself (the loader's pinning then copies nothing). With
    workers: never in a worker process (CUDA there is unsafe); the loader's pinning thread copies."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    seen = []
    monkeypatch.setattr(
        drafter_data, "collate_keyed_sequences", lambda rows, pad_id, pin=False: seen.append(pin) or {"n": len(rows)}
    )
    monkeypatch.setattr(
        drafter_data, "collate_sequences", lambda rows, pad_id, pin=False: seen.append(pin) or {"n": len(rows)}
    )
    dm = _module("auto", "cuda", num_workers)
    dm._collate_keyed(_rows()[:2])
    dm._collate(_rows()[:2])
    assert seen == [in_collate, in_collate]


def test_no_pinning_without_cuda_even_when_asked(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    dm = _module(True, "cuda")
    assert dm.train_dataloader().pin_memory is False and not dm._pin_in_collate()


def test_unpinned_batches_are_what_they_were():
    """pin=False (every CPU run): right-padded ids, mask and taps, zeros on padding, nothing page-locked."""
    rows = _rows()[:3]
    batch = collate_sequences(rows, pad_id=7)
    length = len(rows[-1]["input_ids"])
    assert batch["target_taps"].shape == (3, length, 5) and batch["target_taps"].dtype == torch.bfloat16
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        assert batch["input_ids"][i, :n].tolist() == r["input_ids"] and (batch["input_ids"][i, n:] == 7).all()
        assert torch.equal(batch["target_taps"][i, :n], r["target_taps"])
        assert not batch["target_taps"][i, n:].any()
    assert not any(t.is_pinned() for t in batch.values())


@pytest.mark.cuda
@pytest.mark.parametrize("num_workers", [0, 2])
def test_on_a_gpu_trainer_every_batch_tensor_is_pinned_and_unchanged(num_workers):
    dm = _module("auto", "cuda", num_workers)
    batch = next(iter(dm.train_dataloader()))
    assert all(t.is_pinned() for t in batch.values())
    reference = next(iter(_module(False, "cpu").train_dataloader()))
    assert batch.keys() == reference.keys()
    for key in batch:
        assert torch.equal(batch[key], reference[key]), key
    moved = batch["target_taps"].to("cuda", non_blocking=True)
    assert torch.equal(moved.cpu(), reference["target_taps"])
