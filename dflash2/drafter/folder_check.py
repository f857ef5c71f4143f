"""Check a drafter folder before any tensor is read from it (issue 12), as ``dflash2.target`` does for targets.

Every way of loading a drafter (``load_drafter``: eval, ``init_from``, the runtime;
the export of a folder) goes through :func:`check_drafter_folder`. It reads only
``config.json`` and the safetensors *header* (names, shapes), so a missing or
truncated file, a config without the fields a drafter needs, or the weights of
another format (a Hugging Face model folder, a DFlash v1 drafter under a DFlash2
config) is one DFlash2Error line naming the file, raised before anything is built
or written.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash2.drafter.config import DrafterConfig
from dflash2.drafter.serving_fields import check_contract_fields
from dflash2.errors import DFlash2Error

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
DRAFTER_ARCHITECTURES = {"DFlashDraftModel": False, "DFlash2DraftModel": True}  # name -> has DFlash2 additions
_FIX = "pass a drafter folder written by train.py (run/drafter) or python -m dflash2.export"


@dataclass
class DrafterFolder:
    """What the checks read: the folder, its config.json, the drafter config and the tensor shapes."""

    path: Path
    raw_config: dict
    config: DrafterConfig
    shapes: dict[str, tuple[int, ...]]


def check_drafter_folder(path) -> DrafterFolder:
    """Raise a one-line DFlash2Error naming the file and the problem, or return what was read."""
    path = Path(path)
    if not path.exists():
        raise DFlash2Error(f"drafter folder {path} not found; {_FIX}")
    if not path.is_dir():
        raise DFlash2Error(f"drafter path {path} is a file, not a folder; {_FIX}")
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        if not (path / name).is_file():
            raise DFlash2Error(f"drafter folder {path} has no {name}; re-export the drafter into this folder")
    raw = _read_config(path / CONFIG_NAME)
    shapes = _read_header(path / WEIGHTS_NAME)
    config = _drafter_config(raw, shapes, path)
    _check_key_set(raw, config, shapes, path)
    return DrafterFolder(path, raw, config, shapes)


def _read_config(file: Path) -> dict:
    try:
        raw = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DFlash2Error(f"{file} is not valid JSON ({e}); re-export the drafter") from e
    if not isinstance(raw, dict):
        raise DFlash2Error(f"{file} holds a JSON {type(raw).__name__}, not an object; re-export the drafter")
    return raw


def _read_header(file: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from the safetensors header; safetensors also checks the file covers every tensor."""
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            names = f.keys()  # a list: safe_open is not iterable itself
            return {k: tuple(f.get_slice(k).get_shape()) for k in names}
    except Exception as e:  # SafetensorError or OSError
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise DFlash2Error(
            f"drafter weights file {file} is corrupted or truncated ({first}); re-export or re-download it"
        ) from e


def _drafter_config(raw: dict, shapes: dict, path: Path) -> DrafterConfig:
    """Our ``dflash2`` section, else the z-lab / vLLM fields; anything else is another model's folder."""
    from dflash2.drafter.io import _config_from_hf

    file = path / CONFIG_NAME
    if "dflash2" not in raw and "dflash_config" not in raw:
        arch = ", ".join(map(str, raw.get("architectures") or [])) or raw.get("model_type") or "unknown"
        raise DFlash2Error(
            f"{file} is not a DFlash drafter config (architecture {arch}, no dflash2 / dflash_config section; "
            f"a target model folder?); {_FIX}"
        )
    try:
        if "dflash2" in raw:
            section = raw["dflash2"]
            if not isinstance(section, dict):
                raise DFlash2Error(f"its 'dflash2' section is a {type(section).__name__}, not an object")
            config = DrafterConfig.from_dict(dict(section))
            check_contract_fields(raw, config, file)  # what engines read == what we load
            return config
        # _config_from_hf reads only shapes: meta tensors carry them without memory
        return _config_from_hf(raw, {k: torch.empty(s, device="meta") for k, s in shapes.items()}, path)
    except DFlash2Error as e:
        message = str(e)
        raise DFlash2Error(message if str(path) in message else f"{file}: {message}") from None
    except (TypeError, ValueError, KeyError, AttributeError) as e:  # e.g. "hidden_size": "big"
        raise DFlash2Error(f"{file} has a field of the wrong type or value ({type(e).__name__}: {e}); {_FIX}") from e


def _is_v2_tensor(name: str) -> bool:
    return name.startswith("candidate_selector.") or ".attention_conv." in name or ".mlp_conv." in name


def _check_key_set(raw: dict, config: DrafterConfig, shapes: dict, path: Path) -> None:
    """The weights are exactly the tensors the config implies; other formats get named."""
    from dflash2.drafter.model import DFlashDrafter

    weights, file = path / WEIGHTS_NAME, path / CONFIG_NAME
    has_v2 = any(_is_v2_tensor(k) for k in shapes)
    with torch.device("meta"):  # no init work: only the names and shapes are wanted
        expected = {k: tuple(v.shape) for k, v in DFlashDrafter(config).state_dict().items()}
    missing, unexpected = sorted(set(expected) - set(shapes)), sorted(set(shapes) - set(expected))
    if missing or unexpected:
        if any(k.startswith(("model.", "lm_head.")) for k in unexpected):
            raise DFlash2Error(
                f"{weights} holds a Hugging Face language model's tensors (model.* / lm_head.*, e.g. "
                f"{unexpected[0]}), not a DFlash drafter's; {_FIX}"
            )
        hint = ""
        if missing and all(_is_v2_tensor(k) for k in missing) and not has_v2:
            hint = " (DFlash v1 weights under a config that turns on the DFlash2 conv / selector)"
        elif unexpected and all(_is_v2_tensor(k) for k in unexpected) and not config.is_v2:
            hint = " (DFlash2 weights under a config that turns the conv / selector off)"
        raise DFlash2Error(
            f"{weights} does not match {file}{hint}: missing keys {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''}, unexpected keys {unexpected[:5]}"
            f"{' ...' if len(unexpected) > 5 else ''}; re-export the drafter or fix config.json"
        )
    for k, shape in expected.items():
        if shapes[k] != shape:
            raise DFlash2Error(
                f"{weights}: '{k}' has shape {shapes[k]}, {file} implies {shape}; "
                "re-export the drafter or fix config.json"
            )
    # z-lab / vLLM fields alone: the config follows the weights, so only the declared architecture can disagree
    arch = [a for a in raw.get("architectures") or [] if a in DRAFTER_ARCHITECTURES]
    if arch and DRAFTER_ARCHITECTURES[arch[0]] != has_v2:
        held = "the DFlash2 conv / selector tensors" if has_v2 else "no DFlash2 conv / selector tensor"
        raise DFlash2Error(
            f"{weights} holds {held} but {file} declares {arch[0]}; the weights and the config come "
            f"from different drafters, {_FIX}"
        )
