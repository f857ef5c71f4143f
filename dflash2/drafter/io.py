"""Save / load a drafter as an HF-style folder that serving engines read (ARCHITECTURE.md §7).

Folder = ``config.json`` + ``model.safetensors``. The config carries the z-lab /
vLLM fields (``DFlashDraftModel`` for v1, ``DFlash2DraftModel`` when the conv or the
selector is on, Qwen3 attention fields, ``block_size``, ``dflash_config``) plus a
``dflash2`` section with our full ``DrafterConfig``. ``load_drafter`` prefers that
section and otherwise rebuilds the config from the z-lab fields and the weights.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dflash2.drafter.config import DrafterConfig
from dflash2.drafter.folder_check import CONFIG_NAME, WEIGHTS_NAME, check_drafter_folder
from dflash2.drafter.model import DFlashDrafter
from dflash2.drafter.serving_fields import contract_fields, read_contract_fields
from dflash2.errors import DFlash2Error


def hf_config(cfg: DrafterConfig, dtype: torch.dtype | None = None) -> dict:
    """The config.json dict for ``cfg`` (z-lab / vLLM fields + our ``dflash2`` section)."""
    top, contract = contract_fields(cfg)  # block, attention kinds, serving scales (§3.4)
    dflash = {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids), **contract}
    if cfg.is_v2:
        dflash.update(
            conv_kernel_size=cfg.conv_kernel_size,
            conv_group_size=cfg.conv_group_size,
            selector_rank=cfg.selector_rank,
            selector_top_k=cfg.selector_top_k,
        )
    out = {
        "architectures": ["DFlash2DraftModel" if cfg.is_v2 else "DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        **top,
        "block_size": cfg.block_size,
        "dflash_config": dflash,
        "dflash2": cfg.to_dict(),
    }
    if cfg.num_target_layers is not None:
        out["num_target_layers"] = cfg.num_target_layers
    if dtype is not None:
        out["dtype"] = str(dtype).removeprefix("torch.")
    return out


def save_drafter(
    drafter: DFlashDrafter,
    out_dir,
    *,
    dtype: torch.dtype | None = None,
    extra_config: dict | None = None,
    extra_files: dict[str, str] | None = None,
):
    """Write ``out_dir/{config.json, model.safetensors}`` atomically.

    Everything is written into a temp folder beside ``out_dir`` and renamed into
    place, so a crash never leaves a half-written folder under the final name; an
    existing ``out_dir`` is moved aside first and deleted only after the swap.
    dtype: cast floating tensors (e.g. torch.bfloat16 for serving); extra_config:
    top-level keys merged into config.json (they win); extra_files: {file name: text}
    written into the same folder before the swap (e.g. the export's README.md).
    Returns the final Path.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise DFlash2Error(f"cannot save drafter: {out_dir} exists and is not a folder; choose another path")
    parent = out_dir.parent
    parent.mkdir(parents=True, exist_ok=True)
    config = hf_config(drafter.config, dtype)
    config.update(extra_config or {})
    tensors = {}
    for k, v in drafter.state_dict().items():
        v = v.detach()
        if dtype is not None and v.is_floating_point():
            v = v.to(dtype)
        tensors[k] = v.cpu().contiguous()
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=parent))
    old = None
    try:
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
        if out_dir.exists():
            old = parent / f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(out_dir, old)
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and old.exists() and not out_dir.exists():
            os.rename(old, out_dir)  # put the previous export back
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return out_dir


def _need(cfg: dict, key: str, path: Path):
    if key not in cfg:
        raise DFlash2Error(f"{path / CONFIG_NAME} has no '{key}'; re-export the drafter or add the field")
    return cfg[key]


def _config_from_hf(cfg: dict, weights: dict, path: Path) -> DrafterConfig:
    """Rebuild a DrafterConfig from z-lab / vLLM fields (a folder we did not write)."""
    dc = _need(cfg, "dflash_config", path)
    layer_ids = [int(i) for i in _need(dc, "target_layer_ids", path)]
    hidden, heads = int(_need(cfg, "hidden_size", path)), int(_need(cfg, "num_attention_heads", path))
    theta = cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta"))
    if theta is None:  # never guess: a wrong RoPE base fails silently (§7)
        raise DFlash2Error(
            f"{path / CONFIG_NAME} has no rope_theta / rope_parameters.rope_theta; add the target's value"
        )
    fc = weights.get("fc.weight")
    if fc is None:
        raise DFlash2Error(f"{path / WEIGHTS_NAME} has no 'fc.weight'; not a DFlash drafter export")
    conv = weights.get("layers.0.attention_conv.base_kernel")
    proj = weights.get("layers.0.attention_conv.kernel_projection.weight")
    book = weights.get("candidate_selector.predecessor_codebook")
    num_layers = int(_need(cfg, "num_hidden_layers", path))
    d = dict(
        hidden_size=hidden,
        intermediate_size=int(_need(cfg, "intermediate_size", path)),
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads", heads)),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rope_theta=float(theta),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 40960)),
        vocab_size=int(_need(cfg, "vocab_size", path)),
        target_hidden_size=int(cfg.get("target_hidden_size") or fc.shape[1] // len(layer_ids)),
        target_layer_ids=layer_ids,
        mask_token_id=int(_need(dc, "mask_token_id", path)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        num_target_layers=cfg.get("num_target_layers"),
        use_local_conv=conv is not None,
        use_selector=book is not None,
        **read_contract_fields(cfg, num_layers, path / CONFIG_NAME),  # block size, window, scales
    )
    if conv is not None:
        taps = int(dc.get("conv_kernel_size", conv.shape[1]))
        d.update(
            conv_kernel_size=taps,
            conv_group_size=int(dc.get("conv_group_size", hidden // (proj.shape[0] // (2 * taps)))),
        )
    if book is not None:
        d.update(
            selector_rank=int(dc.get("selector_rank", book.shape[1])), selector_top_k=int(dc.get("selector_top_k", 16))
        )
    return DrafterConfig.from_dict(d)


def load_drafter(path, device=None, dtype: torch.dtype | None = None) -> DFlashDrafter:
    """Load a folder written by ``save_drafter`` (or a z-lab/vLLM-style DFlash folder).

    The folder is checked first (``check_drafter_folder``: files, config fields, key
    names and shapes from the safetensors header), so a damaged or foreign folder is
    one DFlash2Error line. dtype=None keeps the stored dtype. Returns the drafter in
    eval mode on ``device``.
    """
    folder = check_drafter_folder(path)
    weights = load_file(str(folder.path / WEIGHTS_NAME), device="cpu")
    with torch.device("meta"):  # no init work: every tensor comes from the file
        model = DFlashDrafter(folder.config)
    model.load_state_dict(weights, strict=True, assign=True)
    return model.to(device=device, dtype=dtype).eval()
