"""A drafter folder shaped like z-lab's published DFlash2 checkpoints, at test size (issue 12).

Same config.json fields as z-lab's DFlash2 config fixture (2026: ``DFlash2DraftModel``,
``is_causal: false``, ``dflash_config`` holding block 16, conv kernel 2 / group 16, selector
rank 256 / top-k 16, ``final_logit_softcapping`` 20.0 and an ``output_multiplier``; five
``sliding_attention`` layers with ``sliding_window``, ``use_sliding_window``,
``max_window_layers``; token ids, ``num_target_layers``, ``transformers_version``, bf16)
and the same tensor names, but the sizes of a given target and random bf16 weights.
Written with plain json + safetensors, never through dflash2, so loading it tests how
dflash2 reads a folder it did not write.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

ZLAB_OUTPUT_MULTIPLIER = 0.19611613513818404  # the value in z-lab's fixture
ZLAB_SOFTCAP = 20.0
FINAL_NORM_GAIN = 300.0  # tied-embedding micro target: raw logits ~100, i.e. ~20 after the multiplier


def zlab_dflash2_config(target: dict, *, target_layer_ids, mask_token_id: int, sliding_window: int, layers: int = 5):
    """config.json for a drafter of ``target`` (its config.json dict), z-lab's field set and layout."""
    heads, kv, head_dim = target["num_attention_heads"], target["num_key_value_heads"], target["head_dim"]
    theta = (target.get("rope_parameters") or {}).get("rope_theta", target.get("rope_theta"))
    return {
        "architectures": ["DFlash2DraftModel"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": target.get("bos_token_id"),
        "is_causal": False,
        "dflash_config": {
            "block_size": 16,
            "conv_group_size": 16,
            "conv_kernel_size": 2,
            "final_logit_softcapping": ZLAB_SOFTCAP,
            "mask_token_id": mask_token_id,
            "output_multiplier": ZLAB_OUTPUT_MULTIPLIER,
            "selector_rank": 256,
            "selector_top_k": 16,
            "target_layer_ids": list(target_layer_ids),
        },
        "dtype": "bfloat16",
        "eos_token_id": target.get("eos_token_id"),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "hidden_size": target["hidden_size"],
        "initializer_range": 0.02,
        "intermediate_size": 2 * target["hidden_size"],
        "layer_types": ["sliding_attention"] * layers,
        "max_position_embeddings": target["max_position_embeddings"],
        "max_window_layers": layers,
        "model_type": "qwen3",
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": kv,
        "num_target_layers": target["num_hidden_layers"],
        "pad_token_id": target.get("pad_token_id"),
        "rms_norm_eps": 1e-05,
        "rope_parameters": {"rope_theta": float(theta), "rope_type": "default"},
        "sliding_window": sliding_window,
        "tie_word_embeddings": False,
        "transformers_version": "5.15.0",
        "use_cache": False,
        "use_sliding_window": True,
        "vocab_size": target["vocab_size"],
    }


def zlab_dflash2_tensors(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random bf16 tensors with the names and shapes of ``config`` (z-lab's header layout).

    Scales are chosen so that every part matters: norms and conv taps away from identity; a
    final-norm gain that puts logits × output_multiplier in the softcap's curved range
    (|x| ≈ 20, as a real model's top logits are); selector tensors sized so that the pair
    term changes about a third of the T=0 picks."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *shape, std=0.1, mean=0.0: mean + std * torch.randn(*shape, generator=g)
    d, f, V = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    hd, h, kv = config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]
    dc = config["dflash_config"]
    taps, groups, r = dc["conv_kernel_size"], d // dc["conv_group_size"], dc["selector_rank"]
    t = {
        "fc.weight": rnd(d, len(dc["target_layer_ids"]) * d),
        "hidden_norm.weight": rnd(d, mean=1.0),
        "norm.weight": rnd(d, mean=1.0) * FINAL_NORM_GAIN,
        "candidate_selector.predecessor_codebook": rnd(V, r),
        "candidate_selector.successor_codebook": rnd(V, r),
        "candidate_selector.hidden_projection.weight": rnd(r, d, std=0.003),
    }
    for n in range(config["num_hidden_layers"]):
        p = f"layers.{n}."
        t |= {
            p + "self_attn.q_proj.weight": rnd(h * hd, d, std=0.3),
            p + "self_attn.k_proj.weight": rnd(kv * hd, d, std=0.3),
            p + "self_attn.v_proj.weight": rnd(kv * hd, d, std=0.3),
            p + "self_attn.o_proj.weight": rnd(d, h * hd),
            p + "self_attn.q_norm.weight": rnd(hd, mean=1.0),
            p + "self_attn.k_norm.weight": rnd(hd, mean=1.0),
            p + "mlp.gate_proj.weight": rnd(f, d),
            p + "mlp.up_proj.weight": rnd(f, d),
            p + "mlp.down_proj.weight": rnd(d, f),
            p + "input_layernorm.weight": rnd(d, mean=1.0),
            p + "post_attention_layernorm.weight": rnd(d, mean=1.0),
        }
        for conv in ("attention_conv", "mlp_conv"):
            base = rnd(2, taps, d, std=0.3)
            base[:, 0] += 1.0
            t[p + f"{conv}.base_kernel"] = base
            t[p + f"{conv}.kernel_projection.weight"] = rnd(2 * taps * groups, d)
    return {k: v.to(torch.bfloat16).contiguous() for k, v in t.items()}


def write_zlab_dflash2_folder(folder: Path, target_dir: Path, **config_kw) -> Path:
    """config.json + model.safetensors of a z-lab-shaped DFlash2 drafter for the target at ``target_dir``."""
    target = json.loads((Path(target_dir) / "config.json").read_text())
    target = target.get("text_config", target)
    config = zlab_dflash2_config(target, **config_kw)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(zlab_dflash2_tensors(config), str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder
