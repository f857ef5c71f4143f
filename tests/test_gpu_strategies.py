"""`python train.py` under DDP and FSDP on one GPU against the plain single-device run (issue 16's groundwork).

Data parallel at world size 1 is not a speed-up, but it runs every GPU-only part of the two strategies
that the CPU tests cannot (torch's FSDP refuses the CPU): NCCL, the FSDP wrapping and flattening of
the drafter, the norm clipping through the FSDP root, the full weights gathered for the export, the
held-out report and the measured τ, and FSDP's checkpoint format, resumed on a plain device and the
reverse. Micro target and drafter (tests/conftest.py), 4 steps; each run is its own `train.py`
process, so each starts NCCL afresh and its peak memory is its own.

Tolerance: fp32 (`trainer.precision=32-true`), the same kernels on the same batches; what differs is
summation order (FSDP's flat parameter: the gradient norm and the optimizer over one vector instead of
one tensor per weight) and CUDA's atomics, through a few AdamW steps: 1e-5 relative, the CPU
multi-process tests' bound (tests/test_multi_process_train.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO
from safetensors.torch import load_file
from test_multi_process_train import RTOL, assert_same_metrics, metrics, run_two_processes

pytestmark = [pytest.mark.slow, pytest.mark.cuda]

RUN = [
    "trainer.max_steps=4",
    "trainer.val_check_interval=2",
    "callbacks.model_checkpoint.every_n_train_steps=2",
    "trainer.precision=32-true",
]
STRATEGIES = {
    "single": ["trainer=gpu"],
    "ddp": ["trainer=ddp", "trainer.devices=1"],
    "fsdp": ["trainer=fsdp", "trainer.devices=1"],
}


def train(out: Path, overrides: list[str], strategy: str, log: Path) -> Path:
    command = [sys.executable, str(REPO / "train.py"), *overrides, *RUN, *STRATEGIES[strategy]]
    run_two_processes([*command, f"paths.output_dir={out}"], REPO, log)  # one process: world size 1
    return out


class Runs(dict):
    """strategy -> its run folder, each run trained when a test first asks for it (so `-k` selects runs too)."""

    def __init__(self, root: Path, overrides: list[str]):
        super().__init__()
        self.root, self.overrides = root, overrides

    def __missing__(self, name: str) -> Path:
        self[name] = train(self.root / name, self.overrides, name, self.root / f"{name}.log")
        return self[name]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, micro_train_overrides) -> Runs:
    return Runs(tmp_path_factory.mktemp("gpu_strategies"), micro_train_overrides)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_one_gpu_ddp_and_fsdp_log_the_metrics_of_the_plain_run(runs, strategy):
    assert_same_metrics(metrics(runs[strategy]), metrics(runs["single"]))
    assert {k[1] for k in metrics(runs[strategy])} >= {"train/loss", "val/loss", "val/tau_measured"}


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_one_gpu_ddp_and_fsdp_export_the_drafter_of_the_plain_run(runs, strategy):
    expected = load_file(runs["single"] / "drafter" / "model.safetensors")
    got = load_file(runs[strategy] / "drafter" / "model.safetensors")
    assert sorted(got) == sorted(expected)
    for name, weight in expected.items():
        torch.testing.assert_close(got[name], weight, rtol=RTOL, atol=1e-6, msg=name)
    plain, other = (json.loads((runs[s] / "train_summary.json").read_text()) for s in ("single", strategy))
    assert plain["heldout_tau_measured"]["lossless"] and other["heldout_tau_measured"]["lossless"]
    assert other["heldout_tau_measured"]["tau"] == pytest.approx(plain["heldout_tau_measured"]["tau"], rel=RTOL)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_the_summary_holds_the_training_peak_memory_of_each_rank(runs, strategy):
    peak = json.loads((runs[strategy] / "train_summary.json").read_text())["training_peak_memory_per_rank"]
    assert len(peak["allocated_gib"]) == len(peak["reserved_gib"]) == 1
    assert 0 < peak["allocated_gib"][0] <= peak["reserved_gib"][0]
    assert "training peak GPU memory per rank" in (runs[strategy] / "train.log").read_text()


@pytest.mark.parametrize(("written", "resumed"), [("fsdp", "single"), ("single", "fsdp")])
def test_fsdp_checkpoints_and_plain_ones_resume_each_other_on_the_same_batches(
    runs, written, resumed, tmp_path, micro_train_overrides
):
    ckpt = runs[written] / "checkpoints" / "step000002.ckpt"
    out = train(tmp_path / "resumed", [*micro_train_overrides, f"ckpt_path={ckpt}"], resumed, tmp_path / "log")
    assert_same_metrics(metrics(out), metrics(runs["single"]), steps=range(2, 4))
