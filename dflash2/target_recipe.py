"""The embedded default target's architecture (ARCHITECTURE.md §8).

A small hybrid causal LM built from transformers' own Qwen3.5 text classes
(`Qwen3_5TextConfig` / `Qwen3_5ForCausalLM`), so that every HF tool loads the
saved folder and the project exercises the same Gated-DeltaNet code paths as
real Qwen3.5 / Qwen3-Next targets. Layers follow the 3 GDN : 1 attention
pattern of those models.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dflash2.errors import DFlash2Error


def hybrid_layer_types(num_layers: int, full_attention_interval: int = 4) -> list[str]:
    """Every `full_attention_interval`-th layer is attention, the rest GDN.

    4 layers, interval 4 -> [linear, linear, linear, full] (3:1 as in Qwen3.5).
    """
    if num_layers < 1 or full_attention_interval < 1:
        raise DFlash2Error(
            "target recipe needs num_hidden_layers >= 1 and full_attention_interval >= 1 "
            f"(got {num_layers}, {full_attention_interval})"
        )
    return [
        "full_attention" if (i + 1) % full_attention_interval == 0 else "linear_attention" for i in range(num_layers)
    ]


def hybrid_target_config(recipe: Mapping[str, Any], *, eos_token_id: int, pad_token_id: int):
    """Build the `Qwen3_5TextConfig` of the embedded target from a recipe mapping.

    `recipe` holds the architecture fields of `configs/target/*.yaml` (extra
    training fields are ignored). Returns a transformers config.
    """
    from transformers import Qwen3_5TextConfig

    r = dict(recipe)
    layer_types = hybrid_layer_types(int(r["num_hidden_layers"]), int(r.get("full_attention_interval", 4)))
    config = Qwen3_5TextConfig(
        vocab_size=int(r["vocab_size"]),
        hidden_size=int(r["hidden_size"]),
        intermediate_size=int(r["intermediate_size"]),
        num_hidden_layers=int(r["num_hidden_layers"]),
        num_attention_heads=int(r["num_attention_heads"]),
        num_key_value_heads=int(r["num_key_value_heads"]),
        head_dim=int(r["head_dim"]),
        linear_num_key_heads=int(r["linear_num_key_heads"]),
        linear_num_value_heads=int(r["linear_num_value_heads"]),
        linear_key_head_dim=int(r["linear_key_head_dim"]),
        linear_value_head_dim=int(r["linear_value_head_dim"]),
        linear_conv_kernel_dim=4,
        layer_types=layer_types,
        max_position_embeddings=int(r.get("max_position_embeddings", 4096)),
        # Full rotary on the attention layers: simpler to reason about than
        # Qwen3.5's partial rotary, and irrelevant to the drafter.
        rope_parameters={
            "rope_type": "default",
            "rope_theta": float(r.get("rope_theta", 10000.0)),
            "partial_rotary_factor": 1.0,
        },
        tie_word_embeddings=True,  # halves the parameters of a tiny model; HF handles it
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
        initializer_range=0.02,
    )
    return config
