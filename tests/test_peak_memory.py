"""Training peak memory per rank (dflash2/training/peak_memory.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from dflash2.training.peak_memory import GIB, peak_memory_per_rank, reset_peak_memory


class NoCollectives:
    def all_gather(self, tensor):
        raise AssertionError("no collective off CUDA: every rank takes the same branch, and none gathers")


class TwoRanks:
    """What Lightning's all_gather returns with two processes: (world, *shape)."""

    def all_gather(self, tensor):
        return torch.stack([tensor, tensor + 1])


def test_off_cuda_there_is_no_gpu_peak_and_no_collective():
    reset_peak_memory(torch.device("cpu"))  # nothing to reset, and no error
    assert peak_memory_per_rank(NoCollectives(), torch.device("cpu")) is None


@pytest.mark.cuda
def test_each_ranks_peak_by_global_rank():
    device = torch.device("cuda")
    before = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)
    del before  # a peak from before the reset is forgotten
    reset_peak_memory(device)
    base = torch.cuda.memory_allocated(device)  # what other tests still hold
    held = torch.empty(64 * 2**20, dtype=torch.uint8, device=device)
    peak = peak_memory_per_rank(TwoRanks(), device)
    allocated, reserved = peak["allocated_gib"], peak["reserved_gib"]
    assert allocated[0] == pytest.approx((base + held.numel()) / GIB, abs=1e-3)  # values rounded to 1e-3 GiB
    assert reserved[0] >= allocated[0]
    assert allocated[1] == pytest.approx(allocated[0] + 1, abs=1e-3)
    assert reserved[1] == pytest.approx(reserved[0] + 1, abs=1e-3)


def test_reset_before_cudas_first_use_is_skipped(monkeypatch):
    """A run with the target and data cached reaches the reset before anything touched CUDA; torch then
    refuses the reset ("Invalid device argument", seen on an H200). Nothing was allocated, so skipping is exact."""
    calls = []

    def refuse_or_record(device):
        if not torch.cuda.is_initialized():
            raise RuntimeError("Invalid device argument ")
        calls.append(device)

    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", refuse_or_record)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    reset_peak_memory(torch.device("cuda", 0))
    assert calls == []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    reset_peak_memory(torch.device("cuda", 0))
    assert calls == [torch.device("cuda", 0)]


@pytest.mark.cuda
def test_reset_in_a_process_that_has_not_used_cuda_yet():
    """The real case, in a fresh process: the first CUDA call of the run is the reset."""
    code = "\n".join(
        [
            "import torch",
            "from dflash2.training.peak_memory import peak_memory_per_rank, reset_peak_memory",
            "class OneRank:",
            "    def all_gather(self, tensor):",
            "        return tensor",
            "reset_peak_memory(torch.device('cuda', 0))",
            "held = torch.ones(2**20, device='cuda')",
            "print(peak_memory_per_rank(OneRank(), torch.device('cuda', 0))['allocated_gib'][0] > 0)",
        ]
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "True"
