"""Runtime target families and :func:`load_model` (an HF folder -> the runtime model of its family)."""

from __future__ import annotations

import torch

from dflash2.runtime.gdn_state import GDN_MODE_CHOICES
from dflash2.runtime.models.base import ModelOutput, RuntimeCausalLM
from dflash2.runtime.models.llama import Llama
from dflash2.runtime.models.loading import assign_weights, load_weights, parse_dtype, read_text_config
from dflash2.runtime.models.qwen3 import Qwen3
from dflash2.runtime.models.qwen3_5 import Qwen3_5
from dflash2.text_model import text_config

# HF text model_type -> runtime class
FAMILIES: dict[str, type[RuntimeCausalLM]] = {
    "qwen3": Qwen3,
    "llama": Llama,
    "qwen3_5_text": Qwen3_5,
}


def load_model(folder, *, dtype=None, device="cpu", target_layer_ids=(), gdn_mode="auto") -> RuntimeCausalLM:
    """The runtime model of the HF checkpoint in ``folder`` (config.json + *.safetensors).

    dtype: None/'auto' keeps the stored dtype; else a torch.dtype or 'bfloat16'/'float16'/'float32'.
    target_layer_ids: layers whose outputs the forward returns as taps (see ``RuntimeCausalLM.set_taps``).
    gdn_mode: GDN state implementation of hybrids, 'auto' (default: 'replay' for states on CUDA,
    'reference' on the CPU, decided when a state is made) | 'reference' (plain PyTorch) | 'replay'
    (Triton ReplaySSM) | 'native' (Triton, native rollback); see dflash2.runtime.gdn_state.
    The result is in eval mode with gradients off (a frozen target), its q|k|v and gate|up
    projections fused (``fuse_projections``): move it afterwards only if you accept a copy.
    """
    folder = str(folder)
    config, text = read_text_config(folder)
    family = FAMILIES.get(text.model_type)
    if family is None:
        raise NotImplementedError(
            f"{folder}: model_type {text.model_type!r} has no runtime forward (supported: {sorted(FAMILIES)})"
        )
    dtype = parse_dtype(dtype, folder)
    with torch.device("meta"):
        model = family(text)
    tie = bool(getattr(text, "tie_word_embeddings", False) or getattr(config, "tie_word_embeddings", False))
    load_weights(model, folder, dtype, device, tie)
    model.to(device)  # non-parameter state (RoPE frequencies) built on the CPU
    model.set_taps(target_layer_ids)
    model.gdn_mode = _gdn_mode(gdn_mode)
    return model.eval().requires_grad_(False).fuse_projections()


def _gdn_mode(mode: str) -> str:
    """Checked at load, not at the first state: a typo should fail where it was written."""
    if mode not in GDN_MODE_CHOICES:
        raise ValueError(f"gdn_mode {mode!r}: expected one of {GDN_MODE_CHOICES}")
    return mode


def from_hf_model(hf_model, *, target_layer_ids=(), gdn_mode="auto") -> RuntimeCausalLM:
    """The runtime model over an in-memory HF causal LM's weights (same device and dtype; benchmarks, tests).

    The weights are shared with ``hf_model`` until ``fuse_projections`` concatenates the fused groups
    (those become copies); the rest stays shared. gdn_mode: as in :func:`load_model` (default 'auto').
    """
    config = hf_model.config
    text = text_config(config)
    family = FAMILIES.get(text.model_type)
    if family is None:
        raise NotImplementedError(
            f"model_type {text.model_type!r} has no runtime forward (supported: {sorted(FAMILIES)})"
        )
    weight = hf_model.get_input_embeddings().weight
    with torch.device("meta"):
        model = family(text)
    tie = bool(getattr(text, "tie_word_embeddings", False) or getattr(config, "tie_word_embeddings", False))
    items = hf_model.state_dict().items()
    assign_weights(model, items, weight.dtype, weight.device, tie, source="the HF model", copy=False)
    model.to(weight.device)
    model.set_taps(target_layer_ids)
    model.gdn_mode = _gdn_mode(gdn_mode)
    return model.eval().requires_grad_(False).fuse_projections()


__all__ = ["FAMILIES", "Llama", "ModelOutput", "Qwen3", "Qwen3_5", "RuntimeCausalLM", "from_hf_model", "load_model"]
