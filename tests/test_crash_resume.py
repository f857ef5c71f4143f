"""Crash safety (issue 6): atomic checkpoints, and a training subprocess killed with
SIGKILL mid-epoch resumes from its last checkpoint on the same loss curve."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import subprocess_env
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from lightning.pytorch import Callback

from dflash2.training.atomic_checkpoint_io import AtomicCheckpointIO
from dflash2.training.cli import CONFIG_DIR
from dflash2.training.run import run_from_config

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent


class HoldAtStep(Callback):
    """Stops a training run (without exiting) before batch ``hold_at_step``, after writing ``marker``,
    so the test can SIGKILL it at a known point between two checkpoints. It touches no RNG or
    weights: losses are those of a run without it. ``hold_at_step=-1`` disables it."""

    def __init__(self, hold_at_step: int = -1, marker: str = ""):
        self.hold_at_step, self.marker = int(hold_at_step), marker

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.hold_at_step:
            Path(self.marker).write_text(str(os.getpid()))
            while True:  # wait here to be killed
                time.sleep(0.05)


# ----------------------------------------------------------------- atomic checkpoint writes


def test_trainer_configs_write_checkpoints_through_the_atomic_io(tmp_path):
    from hydra.utils import instantiate

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("train", overrides=["trainer=cpu", f"paths.output_dir={tmp_path}", f"paths.cache_dir={tmp_path}"])
    GlobalHydra.instance().clear()
    trainer = instantiate(cfg.trainer, logger=False, enable_progress_bar=False)
    assert type(trainer.strategy.checkpoint_io) is AtomicCheckpointIO


def test_a_failed_checkpoint_write_leaves_the_previous_file_and_no_partial_one(tmp_path, monkeypatch):
    io = AtomicCheckpointIO()
    last = tmp_path / "checkpoints" / "last.ckpt"
    io.save_checkpoint({"global_step": 2, "w": torch.arange(4.0)}, last)
    assert torch.load(last, weights_only=False)["global_step"] == 2

    real_save = torch.save

    def dies_half_way(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 half a checkpoint")  # some bytes reach the disk, then the write fails
        raise OSError("No space left on device")

    monkeypatch.setattr(torch, "save", dies_half_way)
    with pytest.raises(OSError, match="No space left"):
        io.save_checkpoint({"global_step": 4, "w": torch.zeros(4)}, last)
    with pytest.raises(OSError):
        io.save_checkpoint({"global_step": 4}, tmp_path / "checkpoints" / "step000004.ckpt")
    monkeypatch.setattr(torch, "save", real_save)

    # The previous checkpoint is intact, the new name does not exist, and no temp file is left.
    state = torch.load(last, weights_only=False)
    assert state["global_step"] == 2 and torch.equal(state["w"], torch.arange(4.0))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["last.ckpt"]


# ----------------------------------------------------------------- SIGKILL mid-epoch, then resume

MAX_STEPS = 8
EVERY = 2
# killed before step index 5: step 4 trained after the step-4 checkpoint is lost, step 6's checkpoint never written
HOLD = 5


def run_overrides(
    micro_train_overrides, output_dir: Path, hold_at_step: int = -1, marker: Path | None = None
) -> list[str]:
    return [
        *micro_train_overrides,
        f"paths.output_dir={output_dir}",
        f"trainer.max_steps={MAX_STEPS}",
        f"callbacks.model_checkpoint.every_n_train_steps={EVERY}",
        "+trainer.limit_val_batches=0",  # no validation / measured tau: this test is about training state
        "~callbacks.measured_tau",
        "+callbacks.hold._target_=test_crash_resume.HoldAtStep",
        f"+callbacks.hold.hold_at_step={hold_at_step}",
        f"+callbacks.hold.marker={marker or ''}",
    ]


def run_in_process(overrides: list[str]) -> dict:
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    GlobalHydra.instance().clear()
    sys.path.insert(0, str(TESTS))  # Hydra imports the callback as test_crash_resume.HoldAtStep
    try:
        return run_from_config(cfg)
    finally:
        sys.path.remove(str(TESTS))


def launch(overrides: list[str], log: Path) -> subprocess.Popen:
    env = subprocess_env()
    return subprocess.Popen(
        [sys.executable, "train.py", *overrides], cwd=REPO, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT
    )


def ckpt_step(path: Path) -> int | None:
    try:  # checkpoints are replaced atomically, so a file that exists always loads
        return int(torch.load(path, map_location="cpu", weights_only=False)["global_step"])
    except FileNotFoundError:
        return None


def train_losses(run_dir: Path) -> dict[int, float]:
    path = run_dir / "csv" / "metrics.csv"
    if not path.exists():
        return {}
    with open(path) as fh:
        rows = list(csv.DictReader(fh))
    return {int(r["step"]): float(r["train/loss"]) for r in rows if r.get("train/loss")}


@pytest.mark.slow
def test_sigkilled_training_resumes_from_the_last_checkpoint_on_the_same_loss_curve(tmp_path, micro_train_overrides):
    # The run to kill: `python train.py` in a subprocess, held before step index 5 of 8.
    run, marker, log = tmp_path / "run", tmp_path / "held", tmp_path / "killed.log"
    ckpts = run / "checkpoints"
    proc = launch(run_overrides(micro_train_overrides, run, HOLD, marker), log)
    try:
        # Meanwhile, the reference: the same config run without interruption (in-process, other folder).
        run_in_process(run_overrides(micro_train_overrides, tmp_path / "reference"))
        reference = train_losses(tmp_path / "reference")
        assert sorted(reference) == list(range(MAX_STEPS))

        deadline = time.monotonic() + 240
        while not marker.exists():
            assert proc.poll() is None, f"training exited early:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, "the run did not reach step 5 within 240 s"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert ckpt_step(ckpts / "last.ckpt") == 4
    assert sorted(p.name for p in ckpts.iterdir()) == ["last.ckpt", "step000002.ckpt", "step000004.ckpt"]
    assert not (run / "drafter").exists()

    # Resume in the same folder from last.ckpt (a fresh Trainer, in-process) and let it finish.
    summary = run_in_process([*run_overrides(micro_train_overrides, run), "ckpt_path=last"])
    assert summary["drafter"]["steps"] == MAX_STEPS

    assert ckpt_step(ckpts / "last.ckpt") == MAX_STEPS
    assert sorted(p.name for p in ckpts.iterdir()) == [
        "last.ckpt",
        *(f"step{s:06d}.ckpt" for s in range(EVERY, MAX_STEPS + 1, EVERY)),
    ]
    for path in ckpts.iterdir():  # every checkpoint under a final name is complete
        assert ckpt_step(path) == (MAX_STEPS if path.name == "last.ckpt" else int(path.stem.removeprefix("step")))
    assert (run / "drafter" / "model.safetensors").exists()

    # The CSV logger of the resumed run rewrites metrics.csv; keep only the steps it trained.
    resumed = {s: v for s, v in train_losses(run).items() if s >= 4}
    assert sorted(resumed) == list(range(4, MAX_STEPS))
    for step, loss in resumed.items():
        assert loss == pytest.approx(reference[step], rel=1e-5, abs=1e-6), step
