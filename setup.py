"""Packaging that pyproject.toml cannot say: the wheel ships the top-level `configs/` folder (the one copy
in git) as the package data `dflash2.configs`, so installed entry points find their Hydra configs
(dflash2/config_dir.py). Everything else about the distribution is in pyproject.toml."""

from setuptools import find_packages, setup

setup(
    # Only dflash2 is importable after install: eval/, runtime/, tests/ stay script folders of the repo.
    packages=[*find_packages(include=["dflash2", "dflash2.*"]), "dflash2.configs"],
    package_dir={"dflash2.configs": "configs"},
)
