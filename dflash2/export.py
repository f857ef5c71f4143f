"""Export a trained drafter for serving engines (ARCHITECTURE.md §7; issue 5).

    dflash2-export checkpoint=PATH out=DIR [format=auto|dflash|dflash2]
                   [dtype=auto|bfloat16|float32] [target=PATH_OR_ID]
    (or: python -m dflash2.export ..., which also works in a checkout without installing)

``checkpoint`` is a Lightning ``.ckpt`` from training, a run folder (its
``checkpoints/last.ckpt``, else its ``drafter/`` folder) or an exported drafter
folder. The output is the z-lab / SGLang / vLLM DFlash layout written by
:func:`dflash2.drafter.save_drafter` (``DFlashDraftModel`` for ``format=dflash``,
``DFlash2DraftModel`` for ``format=dflash2``) plus a model card ``README.md``.

Before anything is written, the checks that serving engines fail on *silently*
are run, one function each (every failure is a one-line DFlash2Error and leaves
nothing at ``out``):

* :func:`check_tensor_keys`   exact tensor names and shapes of the format (§7, §3);
* :func:`check_layer_ids`     DFlash tap ids inside the target, consistent with any
                              other record of them (a +1 shift = vLLM's aux ids);
* :func:`check_mask_token`    ``mask_token_id`` inside the target vocab;
* :func:`check_rope`          neox-style (rotate-half) RoPE, default rope type, and
                              ``rope_theta`` equal to the target's;
* :func:`check_target_sizes`  hidden size / tap width / vocab vs the target;
* :func:`check_serving_scales` no serving scale in a ``DFlashDraftModel`` (vLLM's v1
                              loader ignores them).

A DFlash2 drafter with only one of the two additions gets an exact filler for the
other (:mod:`dflash2.export_fill`), since engines always build both. Fields of a source
folder's config.json that dflash2 does not write are carried over unchanged.

The target is read as a config only (``transformers.AutoConfig``, no weights), from
``target=`` or, when that is omitted, from the drafter's recorded
``target_name_or_path`` if it exists locally. No Lightning / Hydra import here.
"""

from __future__ import annotations

import json
import logging
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dflash2.drafter.config import DrafterConfig
from dflash2.errors import DFlash2Error
from dflash2.export_fill import fill_missing_addition
from dflash2.logging_setup import configure_console_logging
from dflash2.safe_load import UnsafeFileError, load_torch_file
from dflash2.target_dtype import resolve_target_dtype
from dflash2.text_model import config_field, rope_theta, text_config

log = logging.getLogger(__spec__.name if __spec__ else __name__)  # dflash2.export under `python -m` too

FORMATS = ("auto", "dflash", "dflash2")
ARCHITECTURE = {"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel"}
# Weights dtype of the export. Serving engines run on a GPU and cast the drafter to the target's
# dtype; `auto` is what `target.dtype=auto` resolves to on a GPU (dflash2.target_dtype): bf16.
DTYPES = {
    "auto": resolve_target_dtype("auto", "cuda"),
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float32": torch.float32,
    "fp32": torch.float32,
}
EXPORT_INFO_KEY = "dflash2_export"  # namespaced: no serving loader reads it (see export_info)
USAGE = __doc__.split("\n\n")[1] if __doc__ else ""

_LAYER_V1 = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
)


# ------------------------------------------------------------------ the source
@dataclass
class DrafterSource:
    """What an export reads: the drafter's config and weights plus provenance."""

    config: DrafterConfig
    tensors: dict[str, torch.Tensor]
    path: Path  # the file / folder the weights came from
    kind: str  # "checkpoint" | "folder"
    run_dir: Path | None = None
    global_step: int | None = None
    target_id: str | None = None
    # other records of the tap ids (e.g. z-lab's dflash_config beside our dflash2 section)
    recorded_layer_ids: dict[str, list[int]] = field(default_factory=dict)
    raw_config: dict | None = None  # the source folder's config.json (None for a .ckpt)


def read_source(source) -> DrafterSource:
    """Resolve ``source`` (a .ckpt, a run folder or an exported folder) into a DrafterSource."""
    path = Path(source)
    if not path.exists():
        raise DFlash2Error(f"checkpoint {path} not found; pass a .ckpt, a run folder or an exported drafter folder")
    if path.is_file():
        return _read_ckpt(path)
    if (path / "config.json").is_file() or (path / "model.safetensors").is_file():
        return _read_folder(path)  # an exported folder, maybe missing a file: the folder check names it
    last = path / "checkpoints" / "last.ckpt"
    if last.is_file():
        return _read_ckpt(last)
    if (path / "drafter").is_dir():
        src = _read_folder(path / "drafter")
        src.run_dir = path
        return src
    raise DFlash2Error(
        f"{path} has no checkpoints/last.ckpt, drafter/ or config.json + model.safetensors; "
        "pass a training .ckpt, a run folder or an exported drafter folder"
    )


def _read_ckpt(path: Path) -> DrafterSource:
    try:  # weights-only: a crafted pickle is refused before any of it runs
        ckpt = load_torch_file(path)
    except UnsafeFileError:
        raise
    except Exception as e:
        raise DFlash2Error(f"could not read checkpoint {path} ({type(e).__name__}: {e}); pass an intact .ckpt") from e
    meta = ckpt.get("dflash2") if isinstance(ckpt, dict) else None
    if not isinstance(meta, dict) or "drafter_config" not in meta or "state_dict" not in ckpt:
        raise DFlash2Error(
            f"{path} is not a dflash2 drafter training checkpoint (no state_dict / dflash2.drafter_config); "
            "pass a checkpoint written by train.py"
        )
    config = DrafterConfig.from_dict(dict(meta["drafter_config"]))
    tensors = {k.removeprefix("drafter."): v for k, v in ckpt["state_dict"].items() if k.startswith("drafter.")}
    if not tensors:
        raise DFlash2Error(f"{path} has no 'drafter.*' weights in its state_dict; pass a drafter training checkpoint")
    run_dir = path.parent.parent if path.parent.name == "checkpoints" else None
    step = ckpt.get("global_step")
    return DrafterSource(
        config,
        tensors,
        path,
        "checkpoint",
        run_dir=run_dir,
        global_step=int(step) if step is not None else None,
        target_id=meta.get("target_id"),
    )


def _read_folder(path: Path) -> DrafterSource:
    from safetensors.torch import load_file

    from dflash2.drafter.folder_check import WEIGHTS_NAME, check_drafter_folder

    folder = check_drafter_folder(path)  # files, config fields, key set: one line before any tensor is read
    cfg, config = folder.raw_config, folder.config
    tensors = load_file(str(path / WEIGHTS_NAME), device="cpu")
    recorded = {}
    zlab_ids = (cfg.get("dflash_config") or {}).get("target_layer_ids")
    if zlab_ids is not None:
        recorded["config.json dflash_config.target_layer_ids"] = [int(i) for i in zlab_ids]
    info = cfg.get(EXPORT_INFO_KEY) or {}
    return DrafterSource(
        config,
        tensors,
        path,
        "folder",
        target_id=info.get("target") or config.target_name_or_path,
        global_step=info.get("steps"),
        recorded_layer_ids=recorded,
        raw_config=cfg,
    )


# ------------------------------------------------------------------ the target
@dataclass
class TargetInfo:
    """The few target facts the checks need (read from its config; no weights)."""

    name_or_path: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    rope_theta: float | None
    tokenizer_fingerprint: str | None = None  # None: the target folder has no tokenizer files


def read_target_info(name_or_path: str) -> TargetInfo:
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(str(name_or_path))
    except Exception as e:
        raise DFlash2Error(
            f"could not read the target config from {name_or_path} ({type(e).__name__}); "
            "pass target=<local HF folder> of the model the drafter was trained for"
        ) from e
    text = text_config(cfg)  # composite folders (Qwen3.5 with text_config + vision_config) too
    return TargetInfo(
        str(name_or_path),
        int(config_field(text, "num_hidden_layers")),
        int(config_field(text, "hidden_size")),
        int(config_field(text, "vocab_size")),
        rope_theta(text),
        _local_tokenizer_fingerprint(name_or_path),
    )


def _local_tokenizer_fingerprint(name_or_path: str) -> str | None:
    """The target's tokenizer fingerprint when its folder holds tokenizer files (hub ids: not checked)."""
    folder = Path(str(name_or_path))
    if not (folder / "tokenizer.json").is_file() and not (folder / "tokenizer_config.json").is_file():
        return None
    from transformers import AutoTokenizer

    from dflash2.tokenizer import tokenizer_fingerprint

    try:
        return tokenizer_fingerprint(AutoTokenizer.from_pretrained(str(folder)))
    except Exception as e:
        raise DFlash2Error(
            f"could not load the tokenizer of target {folder} ({type(e).__name__}); fix or remove its tokenizer files"
        ) from e


def _resolve_target(target, config: DrafterConfig, source: DrafterSource) -> TargetInfo | None:
    """Explicit ``target`` must load; a recorded one is used only when it exists locally."""
    if target is not None:
        return target if isinstance(target, TargetInfo) else read_target_info(str(target))
    for recorded in (config.target_name_or_path, source.target_id):
        if recorded and Path(recorded).is_dir() and (Path(recorded) / "config.json").is_file():
            return read_target_info(recorded)
    return None


# ------------------------------------------------------------------ checks
def expected_tensor_shapes(config: DrafterConfig, fmt: str) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of the §7 layout (``dflash``) or §7 + §3 (``dflash2``), from the spec."""
    d, hd, f = config.hidden_size, config.head_dim, config.intermediate_size
    qd, kvd = config.num_attention_heads * hd, config.num_key_value_heads * hd
    layer = dict(
        zip(_LAYER_V1, [(qd, d), (kvd, d), (kvd, d), (d, qd), (hd,), (hd,), (f, d), (f, d), (d, f), (d,), (d,)])
    )
    out = {f"layers.{n}.{k}": s for n in range(config.num_hidden_layers) for k, s in layer.items()}
    out.update(
        {"fc.weight": (d, config.num_taps * config.target_hidden_size), "hidden_norm.weight": (d,), "norm.weight": (d,)}
    )
    if fmt == "dflash2":
        taps, groups = config.conv_kernel_size, config.conv_groups
        if config.use_local_conv:
            for n in range(config.num_hidden_layers):
                for conv in ("attention_conv", "mlp_conv"):
                    out[f"layers.{n}.{conv}.base_kernel"] = (2, taps, d)
                    out[f"layers.{n}.{conv}.kernel_projection.weight"] = (2 * taps * groups, d)
        if config.use_selector:
            r = config.selector_rank
            out["candidate_selector.predecessor_codebook"] = (config.vocab_size, r)
            out["candidate_selector.successor_codebook"] = (config.vocab_size, r)
            out["candidate_selector.hidden_projection.weight"] = (r, d)
    return out


def _is_v2_tensor(name: str) -> bool:
    return name.startswith("candidate_selector.") or ".attention_conv." in name or ".mlp_conv." in name


def resolve_format(fmt: str, config: DrafterConfig, tensors: dict) -> str:
    """``auto`` -> dflash2 when the drafter has conv / selector weights, else dflash."""
    if fmt not in FORMATS:
        raise DFlash2Error(f"format={fmt!r} is not one of {list(FORMATS)}; use format=dflash (v1) or format=dflash2")
    has_v2 = config.is_v2 or any(_is_v2_tensor(k) for k in tensors)
    if fmt == "auto":
        return "dflash2" if has_v2 else "dflash"
    if fmt == "dflash" and has_v2:
        raise DFlash2Error(
            "format=dflash but the drafter has DFlash2 conv/selector weights that DFlashDraftModel would "
            "drop; use format=dflash2 (or format=auto)"
        )
    if fmt == "dflash2" and not has_v2:
        raise DFlash2Error(
            "format=dflash2 but the drafter has no conv or selector weights (a DFlash v1 drafter); "
            "use format=dflash (or format=auto)"
        )
    return fmt


def check_tensor_keys(tensors: dict, config: DrafterConfig, fmt: str) -> None:
    """The weights hold exactly the tensors of ``fmt`` (names and shapes, §7 / §3)."""
    expected = expected_tensor_shapes(config, fmt)
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise DFlash2Error(
            f"drafter weights do not match the {ARCHITECTURE[fmt]} layout: missing {missing[:4]}"
            f"{' ...' if len(missing) > 4 else ''}, unexpected {unexpected[:4]}"
            f"{' ...' if len(unexpected) > 4 else ''}; export from an unmodified dflash2 checkpoint "
            "or fix the tensor names"
        )
    bad = [(k, tuple(tensors[k].shape), s) for k, s in expected.items() if tuple(tensors[k].shape) != s]
    if bad:
        k, got, want = bad[0]
        raise DFlash2Error(
            f"drafter tensor '{k}' has shape {got} but the {ARCHITECTURE[fmt]} layout needs {want} "
            f"({len(bad)} tensor(s) differ); the weights do not match their config"
        )


def check_layer_ids(config: DrafterConfig, target: TargetInfo | None, recorded: dict | None = None) -> None:
    """DFlash tap ids are decoder-layer ids of the target (outputs = HF hidden_states[id+1]).

    vLLM's aux hidden-state ids are these + 1; writing vLLM's ids into
    ``dflash_config.target_layer_ids`` shifts every tap by one layer silently.
    """
    ids = list(config.target_layer_ids)
    for where, other in (recorded or {}).items():
        if list(other) != ids:
            hint = " (shifted by +1: those are vLLM aux-layer ids)" if [i + 1 for i in ids] == list(other) else ""
            raise DFlash2Error(
                f"{where}={list(other)} disagrees with the drafter's trained target_layer_ids={ids}"
                f"{hint}; keep DFlash ids (the trained ones) in dflash_config.target_layer_ids"
            )
    limits = []
    if config.num_target_layers is not None:
        limits.append((config.num_target_layers, "recorded num_target_layers"))
    if target is not None:
        limits.append((target.num_layers, f"target {target.name_or_path}"))
    for n, src in limits:
        outside = [i for i in ids if not 0 <= i < n]
        if outside:
            raise DFlash2Error(
                f"target_layer_ids={ids} has {outside} outside 0..{n - 1} ({src} has {n} layers); "
                "DFlash ids are 0-based decoder-layer ids (vLLM's aux ids are these + 1), "
                "use the ids the drafter was trained with"
            )
    if target and config.num_target_layers is not None and config.num_target_layers != target.num_layers:
        raise DFlash2Error(
            f"drafter was trained on a {config.num_target_layers}-layer target but {target.name_or_path} "
            f"has {target.num_layers} layers; pass the target the drafter was trained for"
        )


def check_mask_token(config: DrafterConfig, target: TargetInfo | None) -> None:
    vocab = target.vocab_size if target else config.vocab_size
    where = f"target {target.name_or_path}" if target else "the drafter's recorded vocab"
    if not 0 <= config.mask_token_id < vocab:
        raise DFlash2Error(
            f"mask_token_id={config.mask_token_id} is outside the vocab [0, {vocab}) of {where}; "
            f"pick an unused id below {vocab} and retrain"
        )


def check_rope(config: DrafterConfig, target: TargetInfo | None, hf: dict | None = None) -> None:
    """Neox-style (rotate-half) RoPE with the default rope type, theta equal to the target's.

    ``hf``: the config.json dict that will be written (its rope fields are checked too).
    """
    from dflash2.drafter.model import apply_rope

    # the implementation: neox pairs dim i with dim i + hd/2 (GPT-J would pair i with i+1)
    hd = config.head_dim
    x = torch.zeros(1, 1, 1, hd)
    x[..., 0] = 1.0
    cos, sin = torch.zeros(1, 1, 1, hd), torch.ones(1, 1, 1, hd)  # a 90° turn
    y = apply_rope(x, cos, sin)
    if not (abs(float(y[..., hd // 2]) - 1.0) < 1e-6 and abs(float(y[..., 1])) < 1e-6):
        raise DFlash2Error(
            "the drafter's RoPE is not neox-style (rotate-half), which serving engines assume; "
            "fix dflash2.drafter.model.apply_rope before exporting"
        )
    if hf is not None:
        params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        rtype = params.get("rope_type", params.get("type", "default"))
        neox = hf.get("is_neox_style", params.get("is_neox_style", True))
        partial = float(hf.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0)))
        if rtype != "default" or neox is not True or partial != 1.0:
            raise DFlash2Error(
                f"config.json declares rope_type={rtype!r}, is_neox_style={neox}, "
                f"partial_rotary_factor={partial}; the drafter uses default full neox-style RoPE, "
                "remove or fix those fields"
            )
        thetas = {float(t) for t in (hf.get("rope_theta"), params.get("rope_theta")) if t is not None}
        if thetas != {float(config.rope_theta)}:
            raise DFlash2Error(
                f"config.json rope_theta {sorted(thetas)} differs from the trained rope_theta="
                f"{config.rope_theta}; write the trained value"
            )
    if (
        target is not None
        and target.rope_theta is not None
        and not math.isclose(float(config.rope_theta), target.rope_theta, rel_tol=1e-9)
    ):
        raise DFlash2Error(
            f"drafter rope_theta={config.rope_theta} but target {target.name_or_path} uses "
            f"{target.rope_theta}; τ collapses silently with a mismatched RoPE base, "
            "retrain the drafter with the target's rope_theta"
        )


def check_target_sizes(config: DrafterConfig, target: TargetInfo | None) -> None:
    """The drafter reads the target's embedding / LM head / taps: widths, vocab and tokenizer must agree."""
    if target is None:
        return
    problems = []
    if config.hidden_size != target.hidden_size:
        problems.append(f"hidden_size {config.hidden_size} vs {target.hidden_size}")
    if config.target_hidden_size != target.hidden_size:
        problems.append(f"target_hidden_size (tap width) {config.target_hidden_size} vs {target.hidden_size}")
    if config.vocab_size != target.vocab_size:
        problems.append(f"vocab_size {config.vocab_size} vs {target.vocab_size}")
    recorded = config.target_tokenizer_fingerprint
    if recorded and target.tokenizer_fingerprint and recorded != target.tokenizer_fingerprint:
        problems.append(f"tokenizer fingerprint {recorded} vs {target.tokenizer_fingerprint}")
    if problems:
        raise DFlash2Error(
            f"drafter does not fit target {target.name_or_path} ({'; '.join(problems)}); "
            "pass the target it was trained for or retrain"
        )


def check_serving_scales(config: DrafterConfig, fmt: str) -> None:
    """vLLM applies ``input_embedding_scale`` / ``output_multiplier`` / ``final_logit_softcapping`` in its
    DFlash2 loader only; its DFlash (v1) loader ignores them (z-lab's applies them): drafts would differ."""
    if fmt != "dflash":
        return
    used = [f"{k}={v}" for k, v in config.serving_scales.items()]
    if used:
        raise DFlash2Error(
            f"the drafter sets {', '.join(used)}, which vLLM's DFlashDraftModel loader ignores (only its "
            "DFlash2 loader applies them); serve it as a DFlash2 drafter or retrain without the scales"
        )


# ------------------------------------------------------------------ export
def export_info(config: DrafterConfig, fmt: str, target: TargetInfo | None, source: DrafterSource, dtype) -> dict:
    """Informational ``config.json`` section. It lives under its own key because vLLM reads
    some top-level aux-layer fields (EAGLE-3's ``eagle_aux_hidden_state_layer_ids``); the
    +1 ids here are for humans only and are never read back."""
    return {
        "format": fmt,
        "architecture": ARCHITECTURE[fmt],
        "dtype": str(dtype).removeprefix("torch."),
        "target": target.name_or_path if target else (config.target_name_or_path or source.target_id),
        "target_checked": target is not None,
        "layer_id_convention": "dflash_config.target_layer_ids are DFlash ids: 0-based decoder layers whose outputs "
        "are tapped (HF hidden_states[id + 1]); vLLM's aux hidden-state layer ids are id + 1",
        "vllm_aux_hidden_state_layer_ids": [i + 1 for i in config.target_layer_ids],
        "source": str(source.path),
        "steps": source.global_step,
    }


def find_tau(source: DrafterSource) -> tuple[float, Path] | None:
    """mean τ from an eval.acceptance ``results.json`` in/next to the run (newest first), if any."""
    roots = [r for r in (source.run_dir, source.path if source.path.is_dir() else source.path.parent) if r]
    found = []
    for root in dict.fromkeys(roots):
        for pattern in ("results.json", "*/results.json", "*/*/results.json"):
            found += [p for p in root.glob(pattern) if p.is_file()]
    for p in sorted(set(found), key=lambda p: p.stat().st_mtime, reverse=True):
        try:
            tau = json.loads(p.read_text()).get("mean_tau")
        except (json.JSONDecodeError, AttributeError, OSError):
            continue
        if isinstance(tau, (int, float)) and math.isfinite(tau):
            return float(tau), p
    return None


def _data_summary(source: DrafterSource) -> str:
    if source.run_dir is None:
        return "not recorded"
    hydra_cfg = source.run_dir / ".hydra" / "config.yaml"
    if hydra_cfg.is_file():
        try:
            import yaml

            data = (yaml.safe_load(hydra_cfg.read_text()) or {}).get("data") or {}
            keys = ("sources", "chat", "num_train_prompts", "response_tokens", "sampling")
            return ", ".join(f"{k}={data[k]}" for k in keys if k in data) or "not recorded"
        except Exception:
            pass
    return f"see the run folder {source.run_dir}"


def model_card(config: DrafterConfig, fmt: str, info: dict, source: DrafterSource, out_dir: Path) -> str:
    tau = find_tau(source)
    tau_line = f"{tau[0]:.3f} (from `{tau[1]}`)" if tau else "not measured"
    B = config.block_size
    v2 = ""
    if fmt == "dflash2":
        v2 = (
            f"- DFlash2 additions: local conv {'on' if config.use_local_conv else 'off'} (kernel "
            f"{config.conv_kernel_size}, group {config.conv_group_size}), candidate selector "
            f"{'on' if config.use_selector else 'off'} (rank {config.selector_rank}, top-k {config.selector_top_k})\n"
        )
    for note in info.get("filled") or []:
        v2 += f"- Filled at export (the checkpoint has no such module): {note}\n"
    checked = "yes" if info["target_checked"] else "no, not available locally"
    shape = (
        f"Block size {B}, {config.num_hidden_layers} layer(s), hidden {config.hidden_size}, "
        f"mask_token_id {config.mask_token_id}, rope_theta {config.rope_theta} (neox-style)"
    )
    return f"""# {info["architecture"]} drafter

Exported by `python -m dflash2.export` ({fmt} format, {info["dtype"]} weights).

- Target: `{info["target"]}` (checked against the target's config at export: {checked})
- Source: `{info["source"]}`; training steps: {info["steps"] if info["steps"] is not None else "not recorded"}
- Training data: {_data_summary(source)}
- Measured τ (mean tokens per verify step incl. bonus, dflash2.eval.acceptance): {tau_line}
- {shape}
{_contract_lines(config)}{v2}
## Layer-id convention

`dflash_config.target_layer_ids` = {list(config.target_layer_ids)} are **DFlash ids**: 0-based decoder
layers of the target whose *outputs* are tapped (HF `hidden_states[id + 1]`). vLLM's auxiliary
hidden-state layer ids are these + 1 = {info["vllm_aux_hidden_state_layer_ids"]}; vLLM adds the 1
itself, so do not edit the ids. (`config.json` repeats the +1 ids under `{EXPORT_INFO_KEY}`, for
humans only.)

## Load it back with dflash2

```python
from dflash2.drafter import load_drafter
drafter = load_drafter("{out_dir}")
```

## Serve with vLLM

**Not tested here**: this export was not loaded by vLLM when it was written.

```python
from vllm import LLM
llm = LLM(model="{info["target"]}",
          speculative_config={{"method": "dflash", "model": "{out_dir}", "num_speculative_tokens": {B - 1}}})
```

`num_speculative_tokens` must equal `block_size − 1` = {B - 1}: the drafter was trained on blocks of {B}
(anchor + {B - 1} masks), and vLLM's DFlash2 convolution takes its block from
`1 + num_speculative_tokens`, so another value silently moves the conv's block boundaries.
"""


def _contract_lines(config: DrafterConfig) -> str:
    """Card lines for the published-contract fields a drafter sets (ARCHITECTURE.md §3.4); none by default."""
    lines = ""
    if config.has_sliding_layers:
        n = config.layer_kinds.count("sliding_attention")
        lines += (
            f"- Attention: {n} of {config.num_hidden_layers} layer(s) sliding_attention, window "
            f"{config.sliding_window} (keys with |query − key position| < window), non-causal\n"
        )
    scales = [f"{name} {value}" for name, value in config.serving_scales.items()]
    if scales:
        lines += f"- Serving scales (dflash_config): {', '.join(scales)}\n"
    return lines


def export_drafter(source, out_dir, *, fmt: str = "auto", dtype: torch.dtype = torch.bfloat16, target=None) -> Path:
    """Validate and write ``source`` (a .ckpt, run folder or exported folder) to ``out_dir``.

    fmt: "auto" | "dflash" | "dflash2"; dtype: torch.bfloat16 or torch.float32; target: a
    local HF folder / hub id (or TargetInfo) to check against, else the recorded one if local.
    Every check runs before anything is written; the folder appears atomically. Returns its Path.
    """
    from dflash2.drafter.io import hf_config, save_drafter
    from dflash2.drafter.model import DFlashDrafter

    if dtype not in (torch.bfloat16, torch.float32):
        raise DFlash2Error(f"dtype={dtype} is not supported; use torch.bfloat16 or torch.float32")
    src = read_source(source)
    config = src.config
    fmt = resolve_format(fmt, config, src.tensors)
    check_tensor_keys(src.tensors, config, fmt)
    tgt = _resolve_target(target, config, src)
    check_layer_ids(config, tgt, src.recorded_layer_ids)
    check_mask_token(config, tgt)
    check_rope(config, tgt, src.raw_config if src.raw_config is not None else hf_config(config, dtype))
    check_target_sizes(config, tgt)
    check_serving_scales(config, fmt)
    tensors, filled = src.tensors, []
    if fmt == "dflash2":
        config, tensors, filled = fill_missing_addition(config, tensors)

    if tgt is not None:  # record what was checked, so a loader / reader sees the target
        if config.target_name_or_path is None:
            config.target_name_or_path = tgt.name_or_path
        if config.num_target_layers is None:
            config.num_target_layers = tgt.num_layers
    with torch.device("meta"):
        drafter = DFlashDrafter(config)
    drafter.load_state_dict(
        {k: v.float() if v.is_floating_point() else v for k, v in tensors.items()}, strict=True, assign=True
    )
    out_dir = Path(out_dir)
    info = export_info(config, fmt, tgt, src, dtype)
    info["filled"] = filled
    card = model_card(config, fmt, info, src, out_dir.resolve())
    extra = carried_fields(src.raw_config, hf_config(config, dtype))
    extra[EXPORT_INFO_KEY] = info
    return save_drafter(drafter, out_dir, dtype=dtype, extra_config=extra, extra_files={"README.md": card})


def carried_fields(raw: dict | None, written: dict) -> dict:
    """What a source folder's config.json holds beyond what we write (``written``: ``hf_config``), kept as it was.

    E.g. a z-lab folder's token ids, ``max_window_layers`` or ``transformers_version``: re-exporting
    a published drafter keeps its config. Fields that change what engines compute are read (and,
    when dflash2 cannot honour them, refused) by the folder check before we get here."""
    if not raw:
        return {}
    out = {k: v for k, v in raw.items() if k not in written and k not in ("dflash2", EXPORT_INFO_KEY)}
    source_dc = raw.get("dflash_config")
    if isinstance(source_dc, dict):
        out["dflash_config"] = {**source_dc, **written["dflash_config"]}
    return out


# ------------------------------------------------------------------ CLI
def parse_args(argv: list[str]) -> dict:
    known = {"checkpoint", "out", "format", "dtype", "target"}
    args = {}
    for a in argv:
        key, sep, value = a.partition("=")
        key = key.lstrip("-").replace("-", "_")
        if not sep or key not in known:
            raise DFlash2Error(f"unknown argument {a!r}; use key=value with keys {sorted(known)} (see --help)")
        args[key] = value
    for need in ("checkpoint", "out"):
        if not args.get(need):
            raise DFlash2Error(f"missing {need}=...; usage: dflash2-export checkpoint=PATH out=DIR")
    if args.get("dtype", "auto") not in DTYPES:
        raise DFlash2Error(
            f"dtype={args['dtype']!r} is not supported; use dtype=auto (= bf16), dtype=bfloat16 or dtype=float32"
        )
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    configure_console_logging()
    if any(a in ("-h", "--help", "help") for a in argv):
        print(USAGE.strip() + "\n\n" + "\n\n".join(__doc__.split("\n\n")[2:4]))
        return 0
    try:
        a = parse_args(argv)
        out = export_drafter(
            a["checkpoint"],
            a["out"],
            fmt=a.get("format", "auto"),
            dtype=DTYPES[a.get("dtype", "auto")],
            target=a.get("target") or None,
        )
    except DFlash2Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    log.info(f"exported drafter to {out} (model card: {out / 'README.md'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
