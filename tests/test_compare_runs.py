"""`python -m dflash2.training.compare_runs` on run folders written here with known curves: the smoothed
loss differences, the noise verdict, tokens/s per GPU and scaling, memory, and its one-line errors.
(The same tool on real 1- and 2-process CPU runs: tests/test_multi_process_train.py.)"""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys

import pytest
from conftest import REPO, subprocess_env

from dflash2.errors import DFlash2Error
from dflash2.training.compare_runs import compare, curve_difference, load_run, main, trailing_mean

STEPS = list(range(10, 210, 10))  # logged every 10 steps, 200 steps
VAL_STEPS = (100, 200)


def write_run(folder, *, loss, val, tokens_per_s, world_size, peak=None, tau=2.0, resumed_copy_of=None):
    """A run folder as `train.py logger=csv` leaves it: train rows, val rows on their own, summary."""
    (folder / "csv").mkdir(parents=True)
    rows = [{"step": s, "epoch": 0, "train/loss": loss(s), "train/tokens_per_s": tokens_per_s(s)} for s in STEPS]
    rows += [{"step": s, "epoch": 0, "val/loss": val(s)} for s in VAL_STEPS]
    if resumed_copy_of is not None:  # a resumed run logs the steps after its checkpoint again
        rows += [{"step": s, "epoch": 0, "train/loss": resumed_copy_of(s)} for s in STEPS if s > 150]
    with open(folder / "csv" / "metrics.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=["step", "epoch", "train/loss", "train/tokens_per_s", "val/loss"])
        writer.writeheader()
        writer.writerows(rows)
    summary = {"heldout_tau_measured": {"tau": tau}, "steps": STEPS[-1], "world_size": world_size}
    if peak is not None:
        summary["training_peak_memory_per_rank"] = peak
    (folder / "train_summary.json").write_text(json.dumps(summary))
    return folder


def base_loss(step):
    return 4.0 * math.exp(-step / 80) + 1.0


@pytest.fixture
def runs(tmp_path):
    """A 1-GPU baseline, its second seed (off by up to 0.02), a 2-GPU run within that (0.01 off), and a
    2-GPU run that drifts away (0.05 off after step 100); the 1-GPU run does 10k tokens/s."""
    wiggle = {s: (0.02 if (s // 10) % 2 else -0.02) for s in STEPS}  # the seed's scatter, smoothed to <= 0.004
    return {
        "one": write_run(
            tmp_path / "one",
            loss=base_loss,
            val=base_loss,
            tokens_per_s=lambda s: 1000.0 if s == 10 else 10_000.0,  # the first step compiles
            world_size=1,
            peak={"allocated_gib": [10.0], "reserved_gib": [12.0]},
        ),
        "seed1": write_run(
            tmp_path / "seed1",
            loss=lambda s: base_loss(s) + 0.02 + wiggle[s],
            val=lambda s: base_loss(s) + 0.02,
            tokens_per_s=lambda s: 10_000.0,
            world_size=1,
        ),
        "ddp": write_run(
            tmp_path / "ddp",
            loss=lambda s: base_loss(s) + 0.01,
            val=lambda s: base_loss(s) - 0.01,
            tokens_per_s=lambda s: 19_000.0,
            world_size=2,
            peak={"allocated_gib": [6.0, 6.5], "reserved_gib": [7.0, 7.5]},
            tau=2.1,
        ),
        "drift": write_run(
            tmp_path / "drift",
            loss=lambda s: base_loss(s) + (0.05 if s > 100 else 0.0),
            val=base_loss,
            tokens_per_s=lambda s: 16_000.0,
            world_size=2,
        ),
    }


def report_of(runs, *names, noise="seed1"):
    return compare([load_run(n, runs[n]) for n in names], "one", noise, window=2, skip=0.1)


def test_trailing_mean_and_curve_difference():
    assert trailing_mean({1: 1.0, 2: 3.0, 3: 5.0}, 2) == {2: 2.0, 3: 4.0}
    got = curve_difference({1: 1.0, 2: 2.0, 3: 3.0}, {2: 2.5, 3: 2.0, 4: 9.0})
    assert got == {"steps_compared": 2, "max_abs": 1.0, "max_abs_at_step": 3, "rms": pytest.approx(math.sqrt(0.625))}
    assert curve_difference({1: 1.0}, {2: 1.0})["max_abs"] is None


def test_a_run_within_the_seed_noise_passes_and_a_drifting_one_does_not(runs):
    report = report_of(runs, "one", "seed1", "ddp", "drift")
    rows = {r["name"]: r for r in report["runs"]}
    band = report["noise_band"]
    assert band["train_smoothed"]["max_abs"] == pytest.approx(0.02, abs=1e-12)  # the wiggle averages out over 2 points
    assert band["val"]["max_abs"] == pytest.approx(0.02, abs=1e-12)
    ddp = rows["ddp"]["loss_parity"]
    assert ddp["train_smoothed"]["max_abs"] == pytest.approx(0.01) and ddp["val"]["max_abs"] == pytest.approx(0.01)
    assert rows["ddp"]["within_noise"] is True
    drift = rows["drift"]["loss_parity"]["train_smoothed"]
    assert drift["max_abs"] == pytest.approx(0.05) and drift["max_abs_at_step"] > 100
    assert rows["drift"]["within_noise"] is False
    assert rows["one"]["within_noise"] is None and rows["seed1"]["within_noise"] is None  # baseline, band


def test_tokens_per_s_per_gpu_and_scaling_efficiency(runs):
    rows = {r["name"]: r for r in report_of(runs, "one", "seed1", "ddp", "drift")["runs"]}
    assert rows["one"]["tokens_per_s"]["median"] == 10_000.0  # the compile step (step 10 of 200) is skipped
    assert rows["one"]["tokens_per_s"]["points"] == len(STEPS) - 2  # steps 10 and 20 are within the first 10 %
    assert rows["ddp"]["tokens_per_s_per_gpu"] == 9_500.0 and rows["ddp"]["scaling_efficiency"] == pytest.approx(0.95)
    assert rows["drift"]["scaling_efficiency"] == pytest.approx(0.80)
    assert rows["ddp"]["peak_memory_per_rank"]["allocated_gib"] == [6.0, 6.5]
    assert rows["ddp"]["tau_measured"] == 2.1


def test_a_resumed_runs_relogged_steps_keep_their_last_value(tmp_path):
    folder = write_run(
        tmp_path / "r",
        loss=lambda s: 9.0,
        val=base_loss,
        tokens_per_s=lambda s: 1.0,
        world_size=1,
        resumed_copy_of=base_loss,
    )
    run = load_run("r", folder)
    assert run.train_loss[200] == base_loss(200) and run.train_loss[100] == 9.0


def test_the_cli_prints_both_tables_and_writes_json_and_plot(runs, tmp_path):
    out = tmp_path / "report.json"
    command = [
        sys.executable,
        "-m",
        "dflash2.training.compare_runs",
        *(f"{n}={runs[n]}" for n in ("one", "seed1", "ddp")),
        "--noise=seed1",
        "--window=2",
        f"--json={out}",
        f"--plot={tmp_path / 'curves.png'}",
    ]
    done = subprocess.run(command, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    speed_line, loss_line = [line for line in done.stdout.splitlines() if line.startswith("| ddp |")]
    assert speed_line == "| ddp | 2 | 200 | 19,000 [19,000–19,000] | 9,500 | 0.95 | 6.00 / 7.00, 6.50 / 7.50 | 2.100 |"
    assert loss_line.endswith("| 0.0100 | yes |")
    baseline_loss_line = [line for line in done.stdout.splitlines() if line.startswith("| one |")][1]
    assert "(baseline)" in baseline_loss_line
    for line in done.stdout.splitlines():  # every row of a table has its header's columns (markdown drops extra cells)
        if line.startswith("| run |"):
            columns = line.count("|")
        elif line.startswith("|"):
            assert line.count("|") == columns, line
    assert json.loads(out.read_text())["baseline"] == "one"
    assert (tmp_path / "curves.png").stat().st_size > 1000


def test_errors_are_one_line(runs, tmp_path):
    with pytest.raises(DFlash2Error, match=r"csv/metrics.csv is missing \(logger=csv's metrics\)"):
        load_run("x", tmp_path / "nowhere")
    with pytest.raises(DFlash2Error, match=r"--noise 'nope' is not one of the runs \(one, ddp\)"):
        report_of(runs, "one", "ddp", noise="nope")
    with pytest.raises(SystemExit):
        main([f"{runs['one']}"])  # no NAME=
