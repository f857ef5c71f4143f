"""A pinned batch goes to the GPU on a side stream; anything else the way Lightning moves it
(dflash2/training/batch_transfer.py, DrafterTrainingModule.transfer_batch_to_device)."""

from __future__ import annotations

import pytest
import torch

from dflash2.training.batch_transfer import batch_tensors, copies_beside_compute, copy_beside_compute


def _batch() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "input_ids": torch.randint(0, 100, (2, 12), generator=g),
        "loss_mask": torch.ones(2, 12, dtype=torch.long),
        "target_taps": torch.randn(2, 12, 6, generator=g).bfloat16(),
        "anchor_keys": torch.tensor([[3, 0], [3, 1]]),
    }


def test_batch_tensors_walks_nested_batches():
    a, b, c = torch.zeros(1), torch.ones(2), torch.full((3,), 2.0)
    assert [t.numel() for t in batch_tensors({"x": a, "y": [b, (c, "label")], "z": 3})] == [1, 2, 3]
    assert batch_tensors("no tensors") == []


def test_only_a_pinned_host_batch_bound_for_a_gpu_takes_the_side_stream(monkeypatch):
    batch = _batch()
    assert not copies_beside_compute(batch, torch.device("cuda"))  # pageable: Lightning's copy
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, *a: True)  # as the loader's pinning leaves it
    assert copies_beside_compute(batch, torch.device("cuda"))
    assert copies_beside_compute(batch, "cuda:1")
    assert not copies_beside_compute(batch, torch.device("cpu"))
    assert not copies_beside_compute({}, torch.device("cuda"))


def test_the_training_module_moves_a_cpu_batch_as_lightning_does(make_spec_target, make_spec_drafter):
    from lightning.fabric.utilities.apply_func import move_data_to_device

    from dflash2.training.drafter_module import DrafterTrainingModule

    target = make_spec_target("qwen3")
    module = DrafterTrainingModule(
        make_spec_drafter(target, 4),
        target,
        num_anchors=4,
        loss_gamma=4.0,
        selector_loss_weight=1.0,
        lr=1e-3,
        weight_decay=0.0,
        warmup_ratio=0.0,
        total_steps=1,
        seed=0,
    )
    batch = _batch()
    moved = module.transfer_batch_to_device(batch, torch.device("cpu"), 0)
    reference = move_data_to_device(_batch(), torch.device("cpu"))
    assert moved.keys() == reference.keys()
    for key in moved:
        assert torch.equal(moved[key], reference[key]) and moved[key].dtype == reference[key].dtype
    assert module._copy_streams == {}  # no side stream off the GPU


@pytest.mark.cuda
def test_a_pinned_batch_arrives_whole_and_the_compute_stream_reads_it_after_the_copy():
    batch = {k: v.pin_memory() for k, v in _batch().items()}
    assert copies_beside_compute(batch, torch.device("cuda"))
    # keep the compute stream busy, so the copy really runs beside it
    busy = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):
        busy = busy @ busy / 64
    streams = {}
    moved = copy_beside_compute(batch, torch.device("cuda"), streams)
    assert list(streams) == [torch.device("cuda", torch.cuda.current_device())]
    sums = {k: v.double().sum() for k, v in moved.items()}  # compute-stream kernels reading the copies
    for key, value in batch.items():
        assert moved[key].is_cuda and moved[key].dtype == value.dtype
        assert torch.equal(moved[key].cpu(), value)
        assert float(sums[key]) == pytest.approx(float(value.double().sum()))
