"""The config.json fields of the published DFlash2 contract, both ways (ARCHITECTURE.md §3.4, §7.1).

Block size, attention kind per layer (full or sliding window, never causal) and the
three serving scales, read the way vLLM's ``qwen3_dflash`` / ``qwen3_dflash2`` loaders
and z-lab's reference model read them:

* ``layer_types`` (HF derives it from ``use_sliding_window`` + ``max_window_layers`` when
  absent); ``sliding_window`` counts only with ``use_sliding_window: true`` (HF's
  ``Qwen3Config`` drops it otherwise, and vLLM then has no window);
* causality: ``is_causal``, else ``dflash_config.causal``, else "causal iff the layer
  is sliding" (both engines' fallback). dflash2 drafters attend bidirectionally inside
  the block, so every folder we write says ``is_causal: false`` and a causal one is refused;
* ``dflash_config.{block_size, input_embedding_scale, output_multiplier,
  final_logit_softcapping}`` (vLLM reads the scales only there; a cap of 0 means none).

Whatever the engines would read differently (a scale only at the top level, MiMo's
``use_swa`` / ``swa_window_size``) is refused in one line rather than guessed.
"""

from __future__ import annotations

from pathlib import Path

from dflash2.drafter.config import DrafterConfig
from dflash2.errors import DFlash2Error

SCALES = ("input_embedding_scale", "output_multiplier", "final_logit_softcapping")
HF_MAX_WINDOW_LAYERS = 28  # transformers' Qwen3Config default, used when a config derives layer_types


def contract_fields(cfg: DrafterConfig) -> tuple[dict, dict]:
    """(top-level fields, dflash_config fields) that config.json gets for ``cfg``."""
    top: dict = {"layer_types": cfg.layer_kinds, "is_causal": False}  # one entry per layer, or vLLM rejects it
    if cfg.has_sliding_layers:
        top.update(sliding_window=cfg.sliding_window, use_sliding_window=True)
    # block_size: z-lab reads it here (vLLM takes B from num_speculative_tokens); scales only when set
    return top, {"block_size": cfg.block_size, **cfg.serving_scales}


def read_contract_fields(raw: dict, num_layers: int, file: Path) -> dict:
    """DrafterConfig keyword arguments (block_size, layer_types, sliding_window, scales) from a config.json dict."""
    dc = raw.get("dflash_config") or {}
    if not isinstance(dc, dict):
        raise DFlash2Error(f"{file}: dflash_config is a {type(dc).__name__}, not an object; fix config.json")
    for key in ("use_swa", "swa_window_size"):
        if dc.get(key) not in (None, False):
            raise DFlash2Error(
                f"{file}: dflash_config.{key} is not supported (engines read it differently); "
                "give the window as layer_types + sliding_window + use_sliding_window: true"
            )
    out = {"block_size": _block_size(raw, dc, file)}
    kinds = _layer_kinds(raw, num_layers)
    _refuse_causal(raw, dc, kinds, file)
    sliding = "sliding_attention" in kinds
    out["layer_types"] = kinds if sliding else None  # all full attention: the default
    if sliding:
        if raw.get("use_sliding_window") is not True or raw.get("sliding_window") is None:
            raise DFlash2Error(
                f"{file}: layer_types has sliding_attention layers but no window is read "
                f"(sliding_window={raw.get('sliding_window')!r}, use_sliding_window={raw.get('use_sliding_window')!r}; "
                "HF's Qwen3Config drops the window unless use_sliding_window is true); set both"
            )
        out["sliding_window"] = int(raw["sliding_window"])
    for key in SCALES:
        if key in raw and key not in dc:
            raise DFlash2Error(
                f"{file}: {key} is at the top level, where vLLM does not read it (z-lab does); "
                f"move it into dflash_config"
            )
    out["input_embedding_scale"] = float(dc.get("input_embedding_scale", 1.0))
    out["output_multiplier"] = float(dc.get("output_multiplier", 1.0))
    cap = float(dc.get("final_logit_softcapping") or 0.0)
    out["final_logit_softcapping"] = cap if cap > 0 else None  # vLLM and z-lab: 0 / null = no cap
    return out


def check_contract_fields(raw: dict, config: DrafterConfig, file: Path) -> None:
    """A folder with our ``dflash2`` section: the engine-facing fields must say what the section says.

    Engines never read the section, so a hand edit of one side would otherwise serve another
    drafter than the one dflash2 loads (a different window, block or scale, silently)."""
    read = read_contract_fields(raw, config.num_hidden_layers, file)
    ours = {k: getattr(config, k) for k in read}
    if not config.has_sliding_layers:
        ours["layer_types"] = None
    for key, value in read.items():
        if ours[key] != value:
            raise DFlash2Error(
                f"{file}: the serving fields give {key}={value!r} but the dflash2 section has {ours[key]!r}; "
                "re-export the drafter (or fix config.json by hand on both sides)"
            )


def _block_size(raw: dict, dc: dict, file: Path) -> int:
    inner, top = dc.get("block_size"), raw.get("block_size")
    values = {int(v) for v in (inner, top) if v is not None}
    if not values:
        raise DFlash2Error(f"{file} has no 'block_size' (top level or dflash_config); add the drafter's block size")
    if len(values) > 1:
        raise DFlash2Error(
            f"{file}: block_size {top} and dflash_config.block_size {inner} differ; "
            "keep the one the drafter was trained with in both"
        )
    return values.pop()


def _layer_kinds(raw: dict, num_layers: int) -> list[str]:
    kinds = raw.get("layer_types")
    if kinds is not None:
        return [str(k) for k in kinds]
    # no layer_types: what HF's Qwen3Config (and so vLLM) derives
    if raw.get("use_sliding_window") is True and raw.get("sliding_window") is not None:
        first = int(raw.get("max_window_layers", HF_MAX_WINDOW_LAYERS))
        return ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    return ["full_attention"] * num_layers


def _refuse_causal(raw: dict, dc: dict, kinds: list[str], file: Path) -> None:
    explicit = raw.get("is_causal")
    if explicit is None:
        explicit = dc.get("causal")
    # both engines' fallback without an explicit value: a sliding_attention layer is causal
    causal = [
        i for i, kind in enumerate(kinds) if (kind == "sliding_attention" if explicit is None else bool(explicit))
    ]
    if causal:
        why = "is_causal / dflash_config.causal is true" if explicit else "sliding_attention without is_causal: false"
        raise DFlash2Error(
            f"{file}: layer(s) {causal} attend causally inside the block ({why}), which dflash2 drafters do not; "
            "if the drafter was trained bidirectionally, set is_causal: false"
        )
