"""Load a runtime target from an HF folder: config.json + safetensors, through a declarative key map.

A :class:`KeyMap` is a list of (runtime name, HF name) templates, ``{i}`` standing for
a layer index and ``{rest}`` for a tail shared by both sides; the same map converts
in both directions (import here, export later). Checkpoint quirks handled before the
map: composite (vision-language) checkpoints keep the text model under
``model.language_model.``, which is read as ``model.``; the vision tower, multi-token
prediction heads (``mtp.``) and saved RoPE buffers are skipped; a missing
``lm_head.weight`` with ``tie_word_embeddings`` reuses the embedding.

The model is built on the meta device and the checkpoint tensors are assigned to it
(cast to the requested dtype on the way), so memory holds one copy of the weights.
"""

from __future__ import annotations

import glob
import json
import os
import re
from dataclasses import dataclass

import torch

# Checkpoint prefixes read as the plain causal-LM layout (composite Qwen3.5 / VL checkpoints).
PREFIX_ALIASES = (("model.language_model.", "model."), ("language_model.model.", "model."), ("language_model.", ""))
# Checkpoint keys that belong to no runtime parameter and are skipped on purpose.
SKIPPED = re.compile(r"^(model\.visual\.|visual\.|mtp\.)|rotary_emb\.inv_freq$")

DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float64": torch.float64,  # for exactness tests
}


def _template_regex(template: str) -> re.Pattern:
    body = re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{rest\}", r"(?P<rest>.+)")
    return re.compile(f"^{body}$")


@dataclass(frozen=True)
class KeyMap:
    """Runtime <-> HF parameter names: pairs of templates with ``{i}`` (layer) and ``{rest}`` (a shared tail)."""

    pairs: tuple[tuple[str, str], ...]

    def _convert(self, name: str, src: int) -> str | None:
        for pair in self.pairs:
            m = _template_regex(pair[src]).match(name)
            if m:
                return pair[1 - src].format(**m.groupdict())
        return None

    def to_hf(self, name: str) -> str | None:
        return self._convert(name, 0)

    def from_hf(self, name: str) -> str | None:
        return self._convert(name, 1)


def read_text_config(folder: str):
    """(full HF config, its text config): ``dflash2.text_model.text_config`` unwraps composite configs (Qwen3.5 VL)."""
    from transformers import AutoConfig

    from dflash2.text_model import text_config

    config = AutoConfig.from_pretrained(folder)
    return config, text_config(config)


def _weight_files(folder: str) -> list[str]:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as fh:
            shards = sorted(set(json.load(fh)["weight_map"].values()))
        return [os.path.join(folder, s) for s in shards]
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {folder}")
    return files


def _normalise_key(key: str) -> str:
    for old, new in PREFIX_ALIASES:
        if key.startswith(old):
            return new + key[len(old) :]
    return key


def checkpoint_dtype(folder: str) -> torch.dtype:
    """The dtype the floating-point weights were stored in (first floating tensor of the first shard)."""
    from safetensors import safe_open

    with safe_open(_weight_files(folder)[0], framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            t = f.get_slice(key)
            dtype = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}.get(t.get_dtype())
            if dtype is not None:
                return dtype
    return torch.float32


def load_weights(model: torch.nn.Module, folder: str, dtype: torch.dtype, device, tie: bool) -> None:
    """Assign the checkpoint's tensors to ``model``'s (meta) parameters through ``model.KEY_MAP``.

    Raises KeyError naming the parameters with no checkpoint tensor, or checkpoint tensors
    that map to nothing (a wrong key map must fail loudly, not leave random weights).
    """
    from safetensors import safe_open

    def tensors():
        for path in _weight_files(folder):
            with safe_open(path, framework="pt") as f:
                for key in f.keys():  # noqa: SIM118
                    yield key, lambda f=f, key=key: f.get_tensor(key)

    # copy=True: a fresh, aligned allocation even when nothing is converted (safetensors' tensors can
    # sit at unaligned offsets of the file buffer, which picks slower and differently-rounding CPU matmul paths)
    assign_weights(model, tensors(), dtype, device, tie, source=f"checkpoint {folder}", copy=True)


def assign_weights(model: torch.nn.Module, tensors, dtype, device, tie: bool, *, source: str, copy: bool) -> None:
    """Assign (HF key, tensor or a function returning one) pairs to ``model``'s parameters via its KEY_MAP.

    copy=False shares the tensors when no conversion is needed (a runtime model over an HF model's
    weights). Raises KeyError for missing / unexpected keys and ValueError for shape mismatches.
    """
    key_map: KeyMap = model.KEY_MAP
    wanted = dict(model.named_parameters())
    state, unexpected = {}, []
    for key, tensor in tensors:
        hf = _normalise_key(key)
        if SKIPPED.search(key) or SKIPPED.search(hf):
            continue
        name = key_map.from_hf(hf)
        if name is None or name not in wanted:
            unexpected.append(key)
            continue
        t = tensor() if callable(tensor) else tensor
        state[name] = t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype, copy=copy)
    if tie:
        state.pop("lm_head.weight", None)
    missing = [n for n in wanted if n not in state and not (tie and n == "lm_head.weight")]
    if missing or unexpected:
        raise KeyError(
            f"{source} does not match the runtime {type(model).__name__}: "
            f"missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
            f"unexpected {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}"
        )
    for name, tensor in state.items():
        shape = tuple(wanted[name].shape)
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != expected {shape}")
    if tie:
        state["lm_head.weight"] = state["embed.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    if tie:
        model.lm_head.weight = model.embed.weight  # one tensor, as in HF


def parse_dtype(dtype, folder: str) -> torch.dtype:
    """None/'auto' -> the checkpoint's dtype; a torch.dtype or a name in DTYPES -> that dtype."""
    if dtype is None or dtype == "auto":
        return checkpoint_dtype(folder)
    if isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).lower().removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not understood; use one of {sorted(DTYPES)} or 'auto'")
    return DTYPES[name]
