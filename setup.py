"""Packaging that pyproject.toml cannot say: the wheel ships the top-level `configs/` folder (the one copy
in git) as the package data `dflash2.configs`, so installed entry points find their Hydra configs
(dflash2/config_dir.py). Everything else about the distribution is in pyproject.toml."""

from pathlib import Path

from setuptools import find_packages, setup

CONFIGS = Path(__file__).resolve().parent / "configs"
# configs/ and every folder below it (configs/trainer -> dflash2.configs.trainer,
# configs/hydra/job_logging -> dflash2.configs.hydra.job_logging, ...).
CONFIG_PACKAGES = [
    "dflash2.configs",
    *(f"dflash2.configs.{'.'.join(d.relative_to(CONFIGS).parts)}" for d in sorted(CONFIGS.rglob("*")) if d.is_dir()),
]

setup(
    # Only dflash2 is importable after install: eval/, runtime/, tests/ stay script folders of the repo.
    packages=[*find_packages(include=["dflash2", "dflash2.*"]), *CONFIG_PACKAGES],
    package_dir={"dflash2.configs": "configs"},
    package_data={package: ["*.yaml"] for package in CONFIG_PACKAGES},
)
