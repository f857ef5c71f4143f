"""`python train.py` in two processes on the CPU (gloo) against one process (issue 15, item 5).

The same global batch at every step, so the same losses and metrics, the same trained drafter,
files written once by rank 0, and checkpoints that resume at the other world size, through both
launchers: Lightning's own (``trainer=ddp_cpu``, which starts rank 1 as a copy of the command
line) and torchrun. Micro target and drafter (tests/conftest.py), 4 steps of a global batch of 5
rows: ranks hold 2 and 3 rows, the case where per-rank mean losses would not average to the
global one.

Tolerance: two processes compute the same sums in another order (2 + 3 rows, then over ranks,
instead of 5 rows at once; matmuls over other batch shapes and paddings), so values agree to
fp32 rounding, carried through a few AdamW steps: measured within 2e-7 relative on CPU; the
tests allow 1e-5.
"""

from __future__ import annotations

import csv
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, subprocess_env
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from safetensors.torch import load_file

from dflash2.training.cli import CONFIG_DIR
from dflash2.training.run import run_from_config

pytestmark = pytest.mark.slow

RUN = [
    "trainer.max_steps=4",
    "data.batch_size=5",  # the global batch: 2 + 3 rows on two ranks
    "trainer.val_check_interval=2",  # validation and the measured-tau callback under DDP too
    "callbacks.model_checkpoint.every_n_train_steps=2",
]
RTOL = 1e-5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metrics(run_dir: Path) -> dict[tuple[int, str], float]:
    """Every logged (step, metric) of a run's metrics.csv, timing metrics left out (wall time differs)."""
    out = {}
    with open(run_dir / "csv" / "metrics.csv") as fh:
        for row in csv.DictReader(fh):
            for key, value in row.items():
                if value and key not in ("epoch", "step") and "seconds" not in key and "per_s" not in key:
                    assert (int(row["step"]), key) not in out, f"{key} logged twice at step {row['step']}"
                    out[(int(row["step"]), key)] = float(value)
    return out


def assert_same_metrics(got: dict, expected: dict, steps=None) -> None:
    if steps is not None:
        expected = {k: v for k, v in expected.items() if k[0] in steps}
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=RTOL, abs=1e-6), key


def run_in_process(overrides: list[str]) -> dict:
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    GlobalHydra.instance().clear()
    return run_from_config(cfg)


def run_two_processes(command: list[str], cwd: Path, log: Path) -> None:
    env = subprocess_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    with open(log, "w") as fh:
        done = subprocess.run(command, cwd=cwd, env=env, stdout=fh, stderr=subprocess.STDOUT, timeout=900)
    assert done.returncode == 0, log.read_text()[-4000:]


@pytest.fixture(scope="module")
def one(tmp_path_factory, micro_train_overrides) -> Path:
    """The reference: one process, the global batch whole."""
    out = tmp_path_factory.mktemp("one") / "run"
    run_in_process([*micro_train_overrides, *RUN, f"paths.output_dir={out}"])
    return out


@pytest.fixture(scope="module")
def two(one, tmp_path_factory, micro_train_overrides) -> Path:
    """Two processes started by Lightning (`trainer=ddp_cpu`), in the run's default dated folder:
    rank 1 starts seconds after rank 0 and must still write into rank 0's folder."""
    cwd = tmp_path_factory.mktemp("two")
    command = [sys.executable, str(REPO / "train.py"), *micro_train_overrides, *RUN, "trainer=ddp_cpu"]
    run_two_processes(command, cwd, cwd / "console.log")
    runs = [p for p in (cwd / "outputs" / "train").glob("*/*") if p.is_dir()]
    assert len(runs) == 1, runs  # one run folder for both ranks
    return runs[0]


def test_two_processes_log_the_losses_and_metrics_of_one(one, two):
    assert_same_metrics(metrics(two), metrics(one))
    assert {k[1] for k in metrics(one)} >= {"train/loss", "train/acc_pos1", "val/loss", "val/tau_measured"}


def test_two_processes_train_the_drafter_of_one(one, two):
    expected, got = load_file(one / "drafter" / "model.safetensors"), load_file(two / "drafter" / "model.safetensors")
    assert sorted(got) == sorted(expected)
    for name, weight in expected.items():
        torch.testing.assert_close(got[name], weight, rtol=RTOL, atol=1e-6, msg=name)


def test_rank_zero_alone_writes_the_runs_files(two):
    names = {p.name for p in two.iterdir()}
    assert {"drafter", "checkpoints", "heldout_eval", "train_summary.json", "run_summary.json", "target"} <= names
    assert {"train.log", "train_ddp_process_1.log"} <= names  # a log file per rank, named by Lightning
    checkpoints = sorted(p.name for p in (two / "checkpoints").iterdir())
    assert checkpoints == ["last.ckpt", "step000002.ckpt", "step000004.ckpt"]
    log = (two / "train.log").read_text()
    assert log.count("RESULT: measured tau") == 1 and "RESULT" not in (two / "train_ddp_process_1.log").read_text()


def test_compare_runs_reads_the_world_sizes_and_finds_the_curves_equal(one, two):
    """The multi-GPU report tool on real runs: world sizes from the summaries, loss curves that agree."""
    from dflash2.training.compare_runs import compare, load_run

    report = compare([load_run("one", one), load_run("two", two)], "one", None, window=1, skip=0.0)
    base, other = report["runs"]
    assert (base["world_size"], other["world_size"]) == (1, 2)
    parity = other["loss_parity"]
    assert parity["train_smoothed"]["steps_compared"] == 4 and parity["val"]["steps_compared"] == 2
    assert parity["train_smoothed"]["max_abs"] <= RTOL * base["final_train_loss_smoothed"]
    assert parity["val"]["max_abs"] <= RTOL * base["final_val_loss"]
    assert other["tokens_per_s"]["points"] >= 2 and other["tokens_per_s_per_gpu"] > 0
    assert other["within_noise"] is None  # no noise run given


def test_a_two_process_checkpoint_resumes_in_one_process_on_the_same_batches(one, two, tmp_path, micro_train_overrides):
    out = tmp_path / "resumed"
    ckpt = two / "checkpoints" / "step000002.ckpt"
    run_in_process([*micro_train_overrides, *RUN, f"paths.output_dir={out}", f"ckpt_path={ckpt}"])
    assert_same_metrics(metrics(out), metrics(one), steps=range(2, 4))


def test_a_one_process_checkpoint_resumes_in_two_processes_under_torchrun(one, tmp_path, micro_train_overrides):
    out = tmp_path / "torchrun"
    port = free_port()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2"]
    torchrun += ["--master_addr=127.0.0.1", f"--master_port={port}"]
    ckpt = one / "checkpoints" / "step000002.ckpt"
    args = [*micro_train_overrides, *RUN, "trainer=ddp_cpu", f"paths.output_dir={out}", f"ckpt_path={ckpt}"]
    run_two_processes([*torchrun, "train.py", *args], REPO, tmp_path / "console.log")
    assert_same_metrics(metrics(out), metrics(one), steps=range(2, 4))
    assert (out / "train_rank1.log").is_file() and (out / "drafter" / "model.safetensors").is_file()
