"""The distribution (issue 10): the wheel ships configs/ as dflash2/configs and no top-level eval/runtime/tests
modules, and its console entry points run from a non-editable install outside the source tree."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml
from conftest import REPO, subprocess_env

import dflash2.config_dir as config_dir_module
from dflash2.errors import DFlash2Error

ENTRY_POINTS = ("dflash2-train", "dflash2-eval-acceptance", "dflash2-eval-speedup", "dflash2-export")


def test_a_checkout_reads_its_own_configs():
    assert config_dir_module.config_dir() == REPO / "configs"


def test_an_install_reads_the_packaged_configs(tmp_path, monkeypatch):
    package = tmp_path / "site-packages" / "dflash2"  # an installed package: no pyproject.toml one level up
    (package / "configs").mkdir(parents=True)
    monkeypatch.setattr(config_dir_module, "PACKAGE_ROOT", package)
    with pytest.raises(DFlash2Error, match="the dflash2 configs are missing") as err:
        config_dir_module.config_dir()
    assert "\n" not in str(err.value)
    (package / "configs" / "train.yaml").write_text("seed: 0\n")
    assert config_dir_module.config_dir() == package / "configs"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built offline from a copy of the source tree (the build leaves build/ and *.egg-info behind)."""
    tmp = tmp_path_factory.mktemp("wheel")
    ignore = shutil.ignore_patterns(".*", "__pycache__", "outputs", "multirun", "wandb", "build", "dist", "*.egg-info")
    shutil.copytree(REPO, tmp / "src", ignore=ignore)
    offline = ["--no-deps", "--no-build-isolation", "--no-index"]  # setuptools and wheel are already installed
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", *offline, ".", "-w", "out"],
        cwd=tmp / "src",
        env=subprocess_env(),
        check=True,
        capture_output=True,
    )
    (built,) = (tmp / "src" / "out").glob("dflash2-*.whl")
    return built


@pytest.mark.slow
def test_the_wheel_ships_the_configs_and_only_the_dflash2_package(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    shipped = {n.removeprefix("dflash2/configs/") for n in names if n.startswith("dflash2/configs/")}
    assert shipped == {str(p.relative_to(REPO / "configs")) for p in (REPO / "configs").rglob("*.yaml")}
    assert {"train.yaml", "eval_acceptance.yaml", "trainer/ddp.yaml"} <= shipped
    dist_info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/RECORD"))
    assert {n.split("/")[0] for n in names} == {"dflash2", dist_info}  # no eval/, runtime/, tests/, train.py
    scripts = zipfile.ZipFile(wheel).read(f"{dist_info}/entry_points.txt").decode()
    assert all(f"{name} = " in scripts for name in ENTRY_POINTS)


@pytest.mark.slow
def test_entry_points_of_a_regular_install_run_outside_the_tree(wheel, tmp_path):
    venv = tmp_path / "venv"
    # --system-site-packages: torch, Lightning, Hydra come from the system; only dflash2 is installed here.
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True)
    python, bin_dir = venv / "bin" / "python", venv / "bin"
    install = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index"]
    subprocess.run([*install, str(wheel)], check=True, capture_output=True)

    env = subprocess_env()
    # Drop every PYTHONPATH entry that would import dflash2 from a checkout (the repo itself, among them).
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in env["PYTHONPATH"].split(os.pathsep) if p and not (Path(p) / "dflash2").is_dir()
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    def run(*cmd: str) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, cwd=elsewhere, env=env, capture_output=True, text=True)

    where = run(str(python), "-c", "import dflash2.config_dir as c; print(c.__file__); print(c.config_dir())")
    module_file, configs = where.stdout.split()
    assert Path(module_file).is_relative_to(venv) and Path(configs) == Path(module_file).parent / "configs"

    job = run(str(bin_dir / "dflash2-train"), "trainer=ddp", "--cfg", "job")
    assert job.returncode == 0, job.stderr
    assert yaml.safe_load(job.stdout)["trainer"]["strategy"] == "ddp"
    usage = run(str(bin_dir / "dflash2-train"), "--help")
    assert usage.returncode == 0 and "drafter: dflash, dflash2" in usage.stdout
    typo = run(str(bin_dir / "dflash2-train"), "-m", "drafter=dflash,dflsh")
    assert typo.returncode == 2 and typo.stderr.count("\n") == 1 and "'drafter/dflsh'" in typo.stderr
    eval_job = run(str(bin_dir / "dflash2-eval-acceptance"), "--cfg", "job", "num_prompts=3")
    assert eval_job.returncode == 0 and yaml.safe_load(eval_job.stdout)["num_prompts"] == 3
    speedup_job = run(str(bin_dir / "dflash2-eval-speedup"), "--cfg", "job", "runs=2")
    assert speedup_job.returncode == 0 and yaml.safe_load(speedup_job.stdout)["runs"] == 2
    export = run(str(bin_dir / "dflash2-export"), "--help")
    assert export.returncode == 0 and "dflash2-export checkpoint=PATH out=DIR" in export.stdout
    assert list(elsewhere.iterdir()) == []  # none of these runs a job
