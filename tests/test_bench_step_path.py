"""The throughput benchmark times the training path as it now runs: the module's batch transfer, Lightning's
autocast, the optimiser drafter.optimizer_impl picks, and drafter overrides (dflash2/training/bench_throughput.py)."""

from __future__ import annotations

import pytest

from dflash2.errors import DFlash2Error
from dflash2.training import bench_throughput as bt
from dflash2.training.throughput_setup import drafter_overrides

ONE_ROW = ["--shape", "tiny", "--device", "cpu", "--threads", "1", "--attention", "dense", "--ce", "chunked"]
ONE_ROW += ["--features", "offline", "--warmup", "0", "--steps", "1", "--repeats", "1"]


def test_drafter_overrides():
    assert drafter_overrides(None) == {}
    assert drafter_overrides(["optimizer_impl=foreach", "drafter.loss_gamma = 7"]) == {
        "optimizer_impl": "foreach",
        "loss_gamma": "7",
    }
    with pytest.raises(DFlash2Error, match="--set 'optimizer_impl': write KEY=VALUE"):
        drafter_overrides(["optimizer_impl"])


def test_a_row_says_which_optimiser_stepped_and_set_changes_it(monkeypatch):
    from dflash2.training.drafter_module import DrafterTrainingModule

    moved = []
    real = DrafterTrainingModule.transfer_batch_to_device

    def transfer(self, batch, device, idx):
        moved.append(sorted(batch))
        return real(self, batch, device, idx)

    monkeypatch.setattr(DrafterTrainingModule, "transfer_batch_to_device", transfer)
    default = bt.run(ONE_ROW)
    assert default["rows"][0]["optimizer"] == "for_loop"  # auto on the CPU: torch's default
    assert default["settings"]["pinned_batches"] is False and default["settings"]["drafter_overrides"] == []
    assert moved and moved[0] == ["anchor_keys", "input_ids", "loss_mask", "target_taps"]  # the module's hook
    # the config's defaults ask for the training kernels and the kept logits; on CPU tensors (no interpreter
    # context) the rows say the torch code ran, and the logits are kept (no kernel needed)
    for key in ("loss_kernels", "conv_kernels", "norm_kernels", "loss_keep_logits"):
        assert default["settings"][key] is True, key
    assert not any(default["rows"][0][key] for key in ("loss_kernels", "conv_kernels", "norm_kernels"))
    assert default["rows"][0]["loss_keep_logits"] is True
    over = ["--set", "optimizer_impl=foreach", "--set", "loss_kernels=false", "--set", "conv_kernels=false"]
    over += ["--set", "norm_kernels=false", "--set", "loss_keep_logits=false"]
    foreach = bt.run([*ONE_ROW, *over])
    assert foreach["rows"][0]["optimizer"] == "foreach"
    assert foreach["settings"]["drafter_overrides"] == [
        "optimizer_impl=foreach",
        "loss_kernels=false",
        "conv_kernels=false",
        "norm_kernels=false",
        "loss_keep_logits=false",
    ]
    for key in ("loss_kernels", "conv_kernels", "norm_kernels", "loss_keep_logits"):
        assert foreach["settings"][key] is False and foreach["rows"][0][key] is False, key
    assert foreach["rows"][0]["status"] == "ok"


@pytest.mark.cuda
def test_on_cuda_the_batches_are_pinned_and_the_optimiser_fused():
    argv = ["--shape", "tiny", "--device", "cuda", "--attention", "dense", "--ce", "chunked", "--features", "offline"]
    results = bt.run([*argv, "--warmup", "1", "--steps", "1", "--repeats", "1"])
    assert results["settings"]["pinned_batches"] is True
    assert results["rows"][0]["status"] == "ok" and results["rows"][0]["optimizer"] == "fused"
    # the config's defaults: on a GPU the kernels run, and the row says so
    for key in ("loss_kernels", "conv_kernels", "norm_kernels", "loss_keep_logits"):
        assert results["rows"][0][key] is True, key
    pageable = bt.run([*argv, "--warmup", "1", "--steps", "1", "--repeats", "1", "--pin-memory", "false"])
    assert pageable["settings"]["pinned_batches"] is False and pageable["rows"][0]["status"] == "ok"
