"""Trainer settings the machine cannot run are one-line errors before any target build
(dflash2/training/device_check.py): a GPU run without a GPU, FSDP on the CPU, more GPUs than visible."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import REPO, subprocess_env
from omegaconf import OmegaConf

from dflash2.errors import DFlash2Error
from dflash2.training.device_check import check_trainer_devices


def trainer(**fields):
    return OmegaConf.create(fields)


@pytest.fixture
def gpus(monkeypatch):
    """Pretend this machine has `n` CUDA GPUs (the CPU machines have none)."""

    def pretend(n: int):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)

    return pretend


def test_a_gpu_run_without_a_gpu_says_how_to_train_on_the_cpu(gpus, monkeypatch):
    gpus(0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(DFlash2Error) as err:
        check_trainer_devices(trainer(accelerator="gpu", devices=1, strategy="auto"))
    message = str(err.value)
    assert message.startswith(f"trainer.accelerator=gpu but torch {torch.__version__} sees no CUDA GPU here")
    assert "CUDA_VISIBLE_DEVICES=''" in message and "trainer=cpu" in message and "trainer=ddp_cpu" in message


def test_fsdp_on_the_cpu_points_to_ddp_cpu(gpus):
    gpus(0)
    fsdp = {"_target_": "lightning.pytorch.strategies.FSDPStrategy", "sharding_strategy": "FULL_SHARD"}
    with pytest.raises(DFlash2Error, match=r"^trainer=fsdp with trainer.accelerator=cpu: .* use trainer=ddp_cpu"):
        check_trainer_devices(trainer(accelerator="cpu", devices=2, strategy=fsdp))
    with pytest.raises(DFlash2Error, match="Lightning's FSDP runs on CUDA GPUs only"):
        check_trainer_devices(trainer(accelerator="cpu", strategy="fsdp"))


@pytest.mark.parametrize("devices", [3, "3", [0, 1, 2], "0,1,2"])
def test_more_gpus_than_visible_is_refused(gpus, devices):
    gpus(2)
    with pytest.raises(DFlash2Error, match=r"but 2 CUDA GPU\(s\) are visible; lower trainer.devices or give -1"):
        check_trainer_devices(trainer(accelerator="gpu", devices=devices, strategy="ddp"))


@pytest.mark.parametrize("devices", [1, 2, -1, "auto", "-1", [1]])
def test_settings_the_machine_can_run_pass(gpus, devices):
    gpus(2)
    check_trainer_devices(trainer(accelerator="gpu", devices=devices, strategy="ddp"))
    check_trainer_devices(trainer(accelerator="cuda", devices=devices, strategy={"_target_": "x.FSDPStrategy"}))


def test_cpu_runs_are_not_checked_against_gpus(gpus):
    gpus(0)
    check_trainer_devices(trainer(accelerator="cpu", devices=2, strategy="ddp"))  # trainer=ddp_cpu
    check_trainer_devices(trainer(accelerator="cpu", devices=1))  # trainer=cpu, the default


def test_under_torchrun_the_gpu_count_is_left_to_lightning(gpus, monkeypatch):
    """A SLURM task bound to its own GPU sees one device while trainer.devices names the node's 8."""
    gpus(1)
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("SLURM_JOB_NAME", "train")
    check_trainer_devices(trainer(accelerator="gpu", devices=8, strategy="ddp"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU machines' case: no GPU")
def test_train_py_with_trainer_gpu_on_a_cpu_machine_is_one_line_before_any_work(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "train.py"),
            "trainer=gpu",
            f"paths.output_dir={tmp_path / 'run'}",
            f"paths.cache_dir={tmp_path / 'cache'}",
        ],
        cwd=tmp_path,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1].startswith("error: trainer.accelerator=gpu but torch")
    assert not (tmp_path / "cache").exists()  # refused before the target build or any regeneration
