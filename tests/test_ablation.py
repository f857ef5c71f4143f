"""`python -m eval.ablation` (issue 11): plan, commands, resume rules, the table, and the command end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import subprocess_env

from dflash2.errors import DFlash2Error
from dflash2.eval.ablation import parse_args
from dflash2.eval.ablation_plan import (
    VARIANTS,
    Run,
    Settings,
    check_overrides,
    plan,
    record_or_check,
    train_command,
)
from dflash2.eval.ablation_runner import run_lock, train_and_evaluate
from dflash2.eval.ablation_table import markdown, measurements, summarise

REPO = Path(__file__).resolve().parents[1]


def record(variant: str, seed: int, tau: float, rates: list[float], params: int = 1000) -> dict:
    return {"variant": variant, "seed": seed, "params": params, "tau": tau, "per_position_acceptance": rates}


def test_summary_is_mean_and_sample_std_over_seeds_with_a_paired_delta():
    runs = [
        record("dflash", 0, 2.0, [0.6, 0.3]),
        record("dflash", 1, 3.0, [0.8, 0.5]),
        record("dflash2", 0, 2.5, [0.7, 0.4], params=3000),
        record("dflash2", 1, 4.0, [0.9, 0.6], params=3000),
    ]
    for r in runs:
        r["lossless"] = True
    v1, v2 = summarise(runs, baseline="dflash")
    assert (v1["variant"], v2["variant"]) == ("dflash", "dflash2")
    assert v1["tau_mean"] == pytest.approx(2.5) and v1["tau_std"] == pytest.approx(0.5**0.5)  # sample std, n-1
    assert v1["per_position_mean"] == pytest.approx([0.7, 0.4])
    assert v1["delta_tau_vs_baseline_mean"] is None  # the baseline has no delta against itself
    assert v2["delta_tau_vs_baseline_mean"] == pytest.approx(0.75)  # (0.5 + 1.0) / 2, seed by seed
    assert v2["delta_tau_vs_baseline_std"] == pytest.approx((2 * 0.25**2) ** 0.5)
    assert v2["params"] == [3000] and v2["seeds"] == [0, 1] and v2["lossless"]


def test_a_single_seed_has_no_std_and_a_failed_lossless_check_shows():
    runs = [record("dflash", 0, 2.0, [0.5]) | {"lossless": False}]
    (row,) = summarise(runs, baseline="dflash")
    assert row["tau_std"] is None and not row["lossless"]
    for r in runs:
        r.update(verify_steps=10, prompts=2)
    text = markdown([row], runs, {"baseline": "dflash", "lines": [("command", "x")]}, VARIANTS)
    assert "| `dflash` | DFlash v1 | 0.001 M | 1 | 2.000 | — |" in text and "**NO**" in text


def test_measurements_read_tau_and_acceptance_from_an_acceptance_result():
    results = {
        "mean_tau": 2.5,
        "per_position_acceptance": [0.75, 0.5],
        "lossless": True,
        "steps": 40,
        "num_prompts": 4,
        "skipped_prompts": 0,
    }
    got = measurements(results)
    assert got["tau"] == 2.5 and got["per_position_acceptance"] == [0.75, 0.5]
    assert got["lossless"] is True and got["verify_steps"] == 40 and got["prompts"] == 4


@pytest.mark.parametrize("override", ["seed=3", "drafter=dflash", "data.seed=1", "+drafter.use_selector=true"])
def test_overrides_the_ablation_sets_per_run_are_refused(override):
    with pytest.raises(DFlash2Error, match="set by the ablation") as err:
        check_overrides(["trainer.max_steps=10", override])
    assert "\n" not in str(err.value)


def test_lists_are_comma_separated_and_overrides_follow_them(tmp_path):
    settings = parse_args(["--out", str(tmp_path), "--seeds", "2,0", "--variants", "dflash2,dflash", "a.b=1"])
    assert settings.seeds == [2, 0] and settings.variants == ["dflash2", "dflash"] and settings.overrides == ["a.b=1"]
    assert parse_args([]).seeds == [0, 1, 2] and parse_args([]).variants == list(VARIANTS)
    with pytest.raises(DFlash2Error, match="comma-separated"):
        parse_args(["--seeds", "0 1"])


def test_plan_is_every_variant_times_every_seed(tmp_path):
    runs = plan(Settings(out=tmp_path, seeds=[0, 1, 2]))
    assert [(r.variant, r.seed) for r in runs] == [(v, s) for v in VARIANTS for s in (0, 1, 2)]
    assert len({r.dir for r in runs}) == 15
    with pytest.raises(DFlash2Error, match="unknown variant"):
        plan(Settings(out=tmp_path, variants=["dflash3"]))


def test_a_folder_is_resumed_only_with_the_training_settings_it_was_made_with(tmp_path):
    record_or_check(Settings(out=tmp_path, overrides=["trainer.max_steps=10"]))
    record_or_check(Settings(out=tmp_path, overrides=["trainer.max_steps=10"], num_prompts=8))  # eval may change
    with pytest.raises(DFlash2Error, match="other overrides") as err:
        record_or_check(Settings(out=tmp_path, overrides=["trainer.max_steps=20"]))
    assert "\n" not in str(err.value)


def test_train_command_uses_the_prepared_target_and_resumes_a_killed_run(tmp_path):
    settings = Settings(out=tmp_path, data_seed=4, overrides=["target.path=/user/target", "trainer.max_steps=10"])
    run = Run("dflash2_conv_only", 2, tmp_path / "run", tmp_path / "run" / "eval")
    command = train_command(settings, run, tmp_path / "prepare" / "target")
    assert "target.path=/user/target" not in command  # the prepared copy of it is used
    assert command[-5:] == [
        f"target.path={tmp_path / 'prepare' / 'target'}",
        "drafter=dflash2_conv_only",
        "seed=2",
        "data.seed=4",
        f"paths.output_dir={run.dir}",
    ]
    assert command.index("logger=csv") < command.index("trainer.max_steps=10")  # the user's overrides win over defaults
    assert "ckpt_path=last" not in command
    (run.dir / "checkpoints").mkdir(parents=True)
    (run.dir / "checkpoints" / "last.ckpt").write_bytes(b"")
    assert train_command(settings, run, tmp_path)[-1] == "ckpt_path=last"
    user_logger = Settings(out=tmp_path, overrides=["logger=tensorboard", "~callbacks.progress_bar"])
    command = train_command(user_logger, run, tmp_path)
    assert "logger=csv" not in command and command.count("~callbacks.progress_bar") == 1


@pytest.mark.slow
def test_the_command_trains_evaluates_and_tabulates_end_to_end_and_resumes(tmp_path, micro_train_overrides):
    """Tiny mode: the micro target, 2 steps, 2 variants x 1 seed, 2 jobs at once; then the same command again.

    2 steps (the micro default: 6) with one validation and one checkpoint, one seed (the summary over seeds
    is the unit tests' above): what is checked here, the plan, the parallel jobs, the table and the resume,
    is the same at any step and seed count, and each child's start-up dominates the time."""
    out = tmp_path / "ablation"
    tiny = {
        "trainer.max_steps": 2,
        "trainer.val_check_interval": 2,
        "callbacks.model_checkpoint.every_n_train_steps": 2,
    }
    overrides = [o for o in micro_train_overrides if o.split("=", 1)[0] not in tiny]
    overrides += [f"{k}={v}" for k, v in tiny.items()]
    command = [
        sys.executable,
        "-m",
        "eval.ablation",
        f"--out={out}",
        "--variants",
        "dflash,dflash2",
        "--seeds",
        "1",
        "--jobs=2",
        "--num-prompts=2",
        "--max-new-tokens=16",
        "--prompt-tokens=16",
        *overrides,
    ]
    first = subprocess.run(command, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=1500)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "trained 2/2, evaluated 2/2, failed 0" in first.stdout  # the progress display's last line
    table = json.loads((out / "ablation.json").read_text())
    assert [(v["variant"], v["seeds"]) for v in table["variants"]] == [("dflash", [1]), ("dflash2", [1])]
    assert sorted((r["variant"], r["seed"]) for r in table["runs"]) == [("dflash", 1), ("dflash2", 1)]
    for r in table["runs"]:
        assert 1.0 <= r["tau"] <= 8.0 and r["lossless"] is True and r["prompts"] == 2 and r["verify_steps"] > 0
        assert len(r["per_position_acceptance"]) == 7 and all(0.0 <= a <= 1.0 for a in r["per_position_acceptance"])
        assert r["tau"] == pytest.approx(1 + sum(r["per_position_acceptance"]))
    v1, v2 = table["variants"]
    assert v1["params"][0] < v2["params"][0]  # the selector's codebooks and the conv
    assert table["deterministic"] is True and table["threads_per_run"] == 1
    text = (out / "ablation.md").read_text()
    assert "| `dflash` | DFlash v1 |" in text and "| `dflash2` | DFlash2 (conv + selector) |" in text
    assert "training deterministic: yes" in text

    trained_at = {p: p.stat().st_mtime for p in out.glob("runs/*/*/drafter/model.safetensors")}
    again = subprocess.run(command, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "2 of 2 runs already trained and evaluated" in again.stdout
    assert {p: p.stat().st_mtime for p in trained_at} == trained_at
    assert json.loads((out / "ablation.json").read_text())["runs"] == table["runs"]


def test_a_run_locked_by_another_process_is_not_started_twice(tmp_path):
    settings = Settings(out=tmp_path)
    (run,) = plan(Settings(out=tmp_path, seeds=[0], variants=["dflash"]))
    with run_lock(run) as held:
        assert held is not None and held >= 0
        problem = train_and_evaluate(settings, run, tmp_path / "target")
    assert "another process is working on" in problem and "\n" not in problem
    assert not (run.dir / "train.console.log").exists()  # nothing was started
