"""Hydra's own command line through `python train.py` (issue 10): --cfg/-p/--resolve, --info, --help,
-m sweeps with one folder per job, and the one-line typo check that runs before Hydra."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml
from conftest import REPO, subprocess_env
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from dflash2.training.cli import CONFIG_DIR
from dflash2.training.override_check import jobs_to_check


def train_py(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "train.py"), *args], cwd=cwd, env=subprocess_env(), capture_output=True, text=True
    )


def test_cfg_job_prints_the_composed_job_config(tmp_path):
    out = train_py("trainer=ddp", "--cfg", "job", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    job = yaml.safe_load(out.stdout)
    assert job["trainer"]["strategy"] == "ddp" and job["trainer"]["accelerator"] == "gpu"
    assert job["drafter"]["version"] == "dflash2" and "hydra" not in job
    assert not (tmp_path / "outputs").exists()  # printing the config runs nothing


def test_cfg_hydra_shows_the_run_and_sweep_folders(tmp_path):
    out = train_py("-c", "hydra", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    hydra = yaml.safe_load(out.stdout)["hydra"]
    assert hydra["run"]["dir"] == hydra["sweep"]["dir"] == "${paths.output_dir}"
    assert hydra["sweep"]["subdir"] == "${hydra.job.num}"


def test_cfg_package_and_resolve(tmp_path):
    out = train_py(
        "--cfg", "job", "--package", "trainer", "--resolve", f"paths.output_dir={tmp_path}/run", cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    trainer = yaml.safe_load(out.stdout)
    assert trainer["default_root_dir"] == f"{tmp_path}/run"  # ${paths.output_dir}, resolved
    assert "drafter" not in trainer  # only the trainer package


def test_info_shows_the_defaults_of_the_given_overrides(tmp_path):
    out = train_py("--info", "defaults", "drafter=dflash", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "drafter/dflash " in out.stdout + out.stderr and "drafter/dflash2" not in out.stdout + out.stderr


def test_help_lists_groups_and_hydra_help_lists_flags(tmp_path):
    app = train_py("--help", cwd=tmp_path)
    assert app.returncode == 0, app.stderr
    assert "drafter: dflash, dflash2" in app.stdout and "trainer: cpu, ddp, ddp_cpu, default, fsdp, gpu" in app.stdout
    hydra = train_py("--hydra-help", cwd=tmp_path)
    assert hydra.returncode == 0 and "--multirun,-m" in hydra.stdout


@pytest.mark.parametrize(
    "args, names",
    [
        (["-m", "seed=0,1", "trainer.max_step=3"], "'trainer.max_step'"),
        (["-m", "drafter=dflash,dflsh"], "'drafter/dflsh'"),
        (["-m", "seed=range(0,2)", "drafter=glob(*)", "nosuchkey=1"], "'nosuchkey'"),
        (["--cfg", "job", "drafter=dflsh"], "'drafter/dflsh'"),
        (["seed=0,1"], "seed=0,1 is a sweep"),
        (["-m", "seed=0,1", "--cfg", "job"], "only one of --run, --multirun, --cfg"),
        (["--resolve"], "--resolve goes with --cfg"),
    ],
)
def test_a_mistyped_override_or_flag_stops_in_one_line(args, names, tmp_path):
    out = train_py(*args, cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr.startswith("error: ") and out.stderr.count("\n") == 1 and names in out.stderr
    assert out.stdout == "" and list(tmp_path.iterdir()) == []  # stopped before Hydra made a folder


def _jobs(overrides: list[str], multirun: bool = True) -> list[list[str]]:
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
            return jobs_to_check(overrides, GlobalHydra.instance().config_loader(), multirun)
    finally:
        GlobalHydra.instance().clear()


def test_a_sweep_is_checked_with_every_group_option_but_one_value_per_plain_key():
    jobs = _jobs(["seed=range(0,100)", "drafter=dflash,dflash2", "~callbacks.progress_bar", "hydra.verbose=true"])
    assert jobs == [
        ["seed=0", "drafter=dflash", "~callbacks.progress_bar"],
        ["seed=0", "drafter=dflash2", "~callbacks.progress_bar"],
    ]
    globbed = _jobs(["trainer=glob(*,exclude=default)"])
    assert sorted(job[0] for job in globbed) == [f"trainer={t}" for t in ("cpu", "ddp", "ddp_cpu", "fsdp", "gpu")]


@pytest.mark.slow
def test_multirun_writes_one_complete_run_folder_per_job(tmp_path, micro_train_overrides):
    sweep = tmp_path / "sweep"
    out = train_py(
        "-m", "seed=0,1", "debug=fast_dev_run", *micro_train_overrides, f"paths.output_dir={sweep}", cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert (sweep / "multirun.yaml").is_file()
    for num, seed in ((0, 0), (1, 1)):
        job = sweep / str(num)
        assert yaml.safe_load((job / ".hydra" / "overrides.yaml").read_text())[0] == f"seed={seed}"
        assert json.loads((job / "run_summary.json").read_text())["output_dir"] == str(job)
        assert (job / "train_summary.json").is_file() and (job / "train.log").is_file()
        assert (job / "drafter" / "model.safetensors").is_file()
    assert sorted(p.name for p in sweep.iterdir()) == ["0", "1", "multirun.yaml"]
    weights = [(sweep / num / "drafter" / "model.safetensors").read_bytes() for num in ("0", "1")]
    assert weights[0] != weights[1]  # each job ran with its own seed
