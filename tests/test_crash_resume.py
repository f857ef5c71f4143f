"""Crash safety (issue 6): atomic checkpoints, and a training subprocess killed with
SIGKILL mid-epoch resumes from its last checkpoint on the same loss curve."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
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
    assert torch.load(last, weights_only=True)["global_step"] == 2

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
    state = torch.load(last, weights_only=True)
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
        return int(torch.load(path, map_location="cpu", weights_only=True)["global_step"])
    except FileNotFoundError:
        return None


def train_losses(run_dir: Path) -> dict[int, float]:
    path = run_dir / "csv" / "metrics.csv"
    if not path.exists():
        return {}
    with open(path) as fh:
        rows = list(csv.DictReader(fh))
    return {int(r["step"]): float(r["train/loss"]) for r in rows if r.get("train/loss")}


@dataclass
class Interrupted:
    """A run SIGKILLed before step index 5 of 8 and resumed with ckpt_path=last, and its reference."""

    run: Path
    reference: Path
    returncode: int
    ckpt_step_at_kill: int | None
    ckpts_at_kill: list[str]
    drafter_at_kill: bool
    csv_steps_at_kill: list[int]
    summary: dict


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory, micro_train_overrides) -> Interrupted:
    # With the three loggers (tensorboard and wandb each bring csv), whose logs must survive the resume.
    tmp = tmp_path_factory.mktemp("crash")
    overrides = [*micro_train_overrides, "logger=[tensorboard,wandb]"]
    # The run to kill: `python train.py` in a subprocess, held before step index 5 of 8.
    run, marker, log = tmp / "run", tmp / "held", tmp / "killed.log"
    ckpts = run / "checkpoints"
    proc = launch(run_overrides(overrides, run, HOLD, marker), log)
    try:
        # Meanwhile, the reference: the same config run without interruption (in-process, other folder).
        run_in_process(run_overrides(overrides, tmp / "reference"))

        deadline = time.monotonic() + 240
        while not marker.exists():
            assert proc.poll() is None, f"training exited early:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, "the run did not reach step 5 within 240 s"
            time.sleep(0.05)
        time.sleep(2.0)  # W&B writes its local log every second (logger.wandb.flush_seconds); CSV/TB at once
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    at_kill = dict(
        returncode=proc.returncode,
        ckpt_step_at_kill=ckpt_step(ckpts / "last.ckpt"),
        ckpts_at_kill=sorted(p.name for p in ckpts.iterdir()),
        drafter_at_kill=(run / "drafter").exists(),
        csv_steps_at_kill=sorted({int(r["step"]) for r in csv_rows(run)}),
    )
    # Resume in the same folder from last.ckpt (a fresh Trainer, in-process) and let it finish.
    summary = run_in_process([*run_overrides(overrides, run), "ckpt_path=last"])
    return Interrupted(run=run, reference=tmp / "reference", summary=summary, **at_kill)


@pytest.mark.slow
def test_sigkilled_training_resumes_from_the_last_checkpoint_on_the_same_loss_curve(interrupted):
    run, ckpts = interrupted.run, interrupted.run / "checkpoints"
    reference = train_losses(interrupted.reference)
    assert sorted(reference) == list(range(MAX_STEPS))
    assert interrupted.returncode == -signal.SIGKILL
    assert interrupted.ckpt_step_at_kill == 4
    assert interrupted.ckpts_at_kill == ["last.ckpt", "step000002.ckpt", "step000004.ckpt"]
    assert not interrupted.drafter_at_kill

    assert interrupted.summary["drafter"]["steps"] == MAX_STEPS
    assert ckpt_step(ckpts / "last.ckpt") == MAX_STEPS
    assert sorted(p.name for p in ckpts.iterdir()) == [
        "last.ckpt",
        *(f"step{s:06d}.ckpt" for s in range(EVERY, MAX_STEPS + 1, EVERY)),
    ]
    for path in ckpts.iterdir():  # every checkpoint under a final name is complete
        assert ckpt_step(path) == (MAX_STEPS if path.name == "last.ckpt" else int(path.stem.removeprefix("step")))
    assert (run / "drafter" / "model.safetensors").exists()

    resumed = train_losses(run)
    assert sorted(resumed) == list(range(MAX_STEPS))
    for step, loss in resumed.items():
        assert loss == pytest.approx(reference[step], rel=1e-5, abs=1e-6), step


# ----------------------------------------------------------------- the run's logs after the resume
# Measured speed is not reproduced (nor logged at the first step after a restart, which has no previous
# step to time against); every other logged value is.
TIMING = {"train/tokens_per_s"}


def logged_values(rows) -> dict[tuple[int, str], list[float]]:
    """{(step, metric): [value, ...]} over CSV-like rows; a pair logged twice has two values."""
    values: dict[tuple[int, str], list[float]] = {}
    for row in rows:
        step = int(float(row["step"]))
        for key, value in row.items():
            if key != "step" and value not in ("", None):
                values.setdefault((step, key), []).append(float(value))
    return values


def assert_same_history(resumed: dict, reference: dict) -> None:
    twice = sorted(pair for pair, values in resumed.items() if len(values) != 1)
    assert not twice, f"logged more than once: {twice}"
    resumed, reference = ({pair: v for pair, v in d.items() if pair[1] not in TIMING} for d in (resumed, reference))
    assert sorted(resumed) == sorted(reference)  # the same (step, metric) pairs, none missing, none added
    for (step, key), [value] in resumed.items():
        assert value == pytest.approx(reference[step, key][0], rel=1e-5, abs=1e-6), (step, key)


@pytest.mark.slow
def test_csv_log_holds_the_whole_history_once(interrupted):
    # The killed process had written rows up to step 4 (the rows after its step-4 checkpoint are re-run).
    assert interrupted.csv_steps_at_kill[0] == 0 and interrupted.csv_steps_at_kill[-1] >= 4
    resumed, reference = logged_values(csv_rows(interrupted.run)), logged_values(csv_rows(interrupted.reference))
    assert {step for step, _ in resumed} == set(range(MAX_STEPS))
    assert_same_history(resumed, reference)


@pytest.mark.slow
def test_tensorboard_log_holds_each_step_once(interrupted):
    pytest.importorskip("tensorboard")
    resumed, reference = tensorboard_values(interrupted.run), tensorboard_values(interrupted.reference)
    assert {step for step, key in resumed if key == "train/loss"} == set(range(MAX_STEPS))
    assert len(list((interrupted.run / "tensorboard").glob("events.out.tfevents.*"))) == 2  # one file per process
    assert_same_history(resumed, reference)


@pytest.mark.slow
def test_wandb_run_continues_under_its_id_with_each_step_once(interrupted):
    pytest.importorskip("wandb")
    from dflash2.training.resumable_loggers import WANDB_RUN_ID_FILE
    from dflash2.training.wandb_history import STEP_KEY, history_rows, segment_files

    wandb_dir = interrupted.run / "wandb"
    run_id = (wandb_dir / WANDB_RUN_ID_FILE).read_text()
    # The killed process and the resumed one wrote one offline segment each, under the same run id.
    assert [p.parent.name.split("-")[0] for p in segment_files(wandb_dir, run_id)] == ["offline", "offline"]
    assert len(list(wandb_dir.glob("offline-run-*"))) == 2

    def values(run_dir: Path, run_id: str) -> dict:
        rows = history_rows(run_dir / "wandb", run_id)
        return logged_values(
            {"step": row[STEP_KEY], **{k: v for k, v in row.items() if k != STEP_KEY}}
            for row in rows
            if STEP_KEY in row
        )

    reference_id = (interrupted.reference / "wandb" / WANDB_RUN_ID_FILE).read_text()
    resumed, reference = values(interrupted.run, run_id), values(interrupted.reference, reference_id)
    resumed, reference = ({k: v for k, v in d.items() if not k[1].startswith("_")} for d in (resumed, reference))
    assert {step for step, key in resumed if key == "train/loss"} == set(range(MAX_STEPS))
    assert_same_history(resumed, reference)


def csv_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "csv" / "metrics.csv"
    if not path.exists():
        return []
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def tensorboard_values(run_dir: Path) -> dict[tuple[int, str], list[float]]:
    """{(step, tag): values} of the scalars TensorBoard shows for the run (its reader applies purge_step)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    values: dict[tuple[int, str], list[float]] = {}
    for tag in events.Tags()["scalars"]:
        for event in events.Scalars(tag):
            values.setdefault((event.step, tag), []).append(event.value)
    return values
