"""Where the Hydra configs (`configs/` of the repository) are read from.

The top-level `configs/` folder of the repository is the only copy in git. A
wheel ships it as the package data `dflash2/configs/` (setup.py maps the
package `dflash2.configs` onto that folder). So:

* in a source checkout (editable install, or the repo on PYTHONPATH) the
  checkout's own `configs/` is used, so that edits show up at once and each
  checkout reads its own configs, not those of whichever one was installed;
* in a regular install it is the `dflash2.configs` package data.

No Hydra import here: the eval and export entry points use it too.
"""

from __future__ import annotations

from pathlib import Path

from dflash2.errors import DFlash2Error

PACKAGE_ROOT = Path(__file__).resolve().parent


def source_checkout() -> Path | None:
    """The repository root when dflash2 is imported from a source checkout, else None."""
    root = PACKAGE_ROOT.parent
    if (root / "pyproject.toml").is_file() and (root / "configs" / "train.yaml").is_file():
        return root
    return None


def config_dir() -> Path:
    """The folder holding `train.yaml`, `eval_acceptance.yaml` and the config groups."""
    checkout = source_checkout()
    if checkout is not None:
        return checkout / "configs"
    packaged = PACKAGE_ROOT / "configs"  # where a wheel puts the package data dflash2.configs
    if not (packaged / "train.yaml").is_file():
        raise DFlash2Error(
            f"the dflash2 configs are missing: no configs/ beside {PACKAGE_ROOT} and no dflash2/configs package data;"
            " reinstall with `pip install .` from the repository"
        )
    return packaged
