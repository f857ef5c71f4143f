"""The one place that finds a target's text config and its language-model module (ARCHITECTURE.md §2.1).

Targets come in three shapes, and every module that reads a config field or
walks the decoder goes through here instead of ``model.config.x`` / ``model.model``:

* a plain causal LM (``Qwen3ForCausalLM``, ``LlamaForCausalLM``): the config *is*
  the text config, the decoder is ``model.model``;
* a composite config with ``text_config`` (+ ``vision_config``), e.g. the published
  Qwen3.5 checkpoints (``Qwen3_5ForConditionalGeneration``). ``AutoModelForCausalLM``
  loads such a folder as the text-only ``Qwen3_5ForCausalLM`` with the text config
  (transformers 5.17 and 5.2x alike), but code that reads the folder's
  ``AutoConfig`` (export) sees the composite one;
* a conditional-generation model kept whole (``*ForConditionalGeneration``): the
  decoder is ``model.model.language_model`` and a vision tower sits beside it.

Field values are read from the config object transformers built, never filled in
here: when a ``config.json`` omits a field, the HF config class's own default
applies (e.g. ``rms_norm_eps``, or ``rope_theta`` = the class's ``default_theta``,
10000 for Qwen3 / Llama, when transformers 5 standardises ``rope_parameters``); a
field the config object does not have at all is a one-line :class:`DFlash2Error`
naming it.
"""

from __future__ import annotations

import contextlib
from typing import Any

from torch import nn

from dflash2.errors import DFlash2Error


def text_config(config: Any) -> Any:
    """The text (decoder) config of any HF config: ``config.text_config`` for composite ones, else ``config``."""
    getter = getattr(config, "get_text_config", None)
    if getter is None:
        return config
    try:
        return getter(decoder=True)
    except ValueError as e:  # several candidate sub-configs: HF refuses to guess, so do we
        raise DFlash2Error(
            f"target config {type(config).__name__} has several text configs ({_first_line(e)}); "
            "dflash2 cannot tell which one drives the decoder"
        ) from e


def config_field(text: Any, name: str, fix: str = "add it to the target's config.json") -> Any:
    """``text.<name>``; absent or None -> one line naming the field and the config class."""
    value = getattr(text, name, None)
    if value is None:
        raise DFlash2Error(f"target text config {type(text).__name__} has no {name}; {fix}")
    return value


def rope_theta(text: Any, fix: str = "add it to the target's config.json") -> float:
    """The RoPE base of a text config: ``rope_parameters['rope_theta']`` (transformers 5) or ``rope_theta``
    (transformers 4 and configs saved by it). Per-layer-type parameters (``{'full_attention': {...},
    'sliding_attention': {...}}``, Gemma 3 style) give the full-attention entry's base: the drafter's
    layers attend over the whole context. A config with neither is a one-line error."""
    params = getattr(text, "rope_parameters", None)
    if isinstance(params, dict):
        if "full_attention" in params and isinstance(params["full_attention"], dict):
            params = params["full_attention"]
        if params.get("rope_theta") is not None:
            return float(params["rope_theta"])
    theta = getattr(text, "rope_theta", None)
    if theta is None:
        raise DFlash2Error(
            f"target text config {type(text).__name__} has no rope_theta (neither rope_parameters.rope_theta "
            f"nor rope_theta); {fix}"
        )
    return float(theta)


def language_model(model: nn.Module, num_layers: int | None = None) -> nn.Module:
    """The text decoder module of ``model`` (the one holding ``layers``, ``embed_tokens`` and ``norm``).

    ``get_decoder()`` finds it for plain causal LMs (``model.model``) and composite models
    (``model.model.language_model``) in transformers 5.17 and later; a module with a
    ``layers`` list of ``num_layers`` decoder layers is what counts. Anything else is a
    one-line error: searching any ModuleList of the right length could pick a vision tower.
    """
    candidates = []
    getter = getattr(model, "get_decoder", None)
    if callable(getter):
        with contextlib.suppress(AttributeError, NotImplementedError, ValueError):
            candidates.append(getter())
    inner = getattr(model, "model", None)
    candidates += [getattr(inner, "language_model", None), getattr(model, "language_model", None), inner, model]
    for module in candidates:
        layers = getattr(module, "layers", None)
        if isinstance(layers, nn.ModuleList) and (num_layers is None or len(layers) == num_layers):
            return module
    want = f"{num_layers} " if num_layers is not None else ""
    raise DFlash2Error(
        f"cannot find the language model of {type(model).__name__} (a module with {want}decoder `layers`, looked at "
        "get_decoder(), model.language_model, model.model.language_model and model.model); "
        "this architecture is not supported"
    )


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
