"""`python -m eval.speedup shape=small_hybrid`: the pair `experiment=drafter_small` trains, at random weights.

Structure only (no decode: the 90 M-parameter target's random init alone takes seconds on the CPU; the
command itself is covered on shape=tiny by test_eval_speedup.py). The HF model is built on the meta device.
"""

import sys

import pytest
import torch

from dflash2.eval import speedup_cli
from dflash2.eval.speedup_setup import random_model, shape_config, shape_drafter_config
from dflash2.target import default_target_layer_ids
from dflash2.target_recipe import hybrid_target_config
from dflash2.tokenizer import EOS_TOKEN, MASK_TOKEN, PAD_TOKEN, SPECIAL_TOKENS
from dflash2.train_config import compose_train

META = torch.device("meta")


def test_target_config_is_what_target_small_trains():
    """Equal to the config dflash2.training.build_target builds for experiment=target_small (its recipe,
    the trained tokenizer's eos / pad ids), and the recipe's numbers are the ones the shape promises."""
    recipe = compose_train(["experiment=target_small"]).target.recipe
    eos, pad = SPECIAL_TOKENS.index(EOS_TOKEN), SPECIAL_TOKENS.index(PAD_TOKEN)
    trained = hybrid_target_config(recipe, eos_token_id=eos, pad_token_id=pad)
    config = shape_config("small_hybrid")
    assert config.to_dict() == trained.to_dict()

    assert config.model_type == "qwen3_5_text"
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (768, 2048, 12)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (8, 2, 96)
    assert (config.linear_num_key_heads, config.linear_num_value_heads) == (4, 8)
    assert (config.linear_key_head_dim, config.linear_value_head_dim, config.linear_conv_kernel_dim) == (96, 96, 4)
    assert config.vocab_size == 8192 and config.tie_word_embeddings and config.max_position_embeddings == 4096
    assert config.layer_types == (["linear_attention"] * 3 + ["full_attention"]) * 3  # 9 GDN + 3 attention
    assert config.rope_parameters["rope_theta"] == 10000.0 and config.rope_parameters["partial_rotary_factor"] == 1.0


def _drafter_config(block_size=None, drafter_layers=None):
    hf = random_model("small_hybrid", dtype=torch.bfloat16, device=META, seed=0)
    return shape_drafter_config("small_hybrid", hf, None, block_size=block_size, drafter_layers=drafter_layers)


def test_drafter_is_drafter_small():
    """drafter=dflash2 with experiment=drafter_small's depth on target=small: 4 / 2 heads at the target's width
    (head_dim 768 / 4), local conv + selector at the released settings, the §2 taps of 12 layers."""
    c = _drafter_config()
    assert (c.num_hidden_layers, c.block_size) == (3, 8)
    assert c.target_layer_ids == default_target_layer_ids(12, 5) == [1, 3, 5, 7, 9]
    assert (c.hidden_size, c.target_hidden_size, c.intermediate_size, c.vocab_size) == (768, 768, 2048, 8192)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (4, 2, 192)
    assert c.use_local_conv and (c.conv_kernel_size, c.conv_group_size) == (2, 16)
    assert c.use_selector and (c.selector_rank, c.selector_top_k) == (256, 16)
    assert c.rope_theta == 10000.0 and c.max_position_embeddings == 4096 and c.layer_types is None
    assert c.mask_token_id == SPECIAL_TOKENS.index(MASK_TOKEN)  # the trained tokenizer's mask


def test_block_size_and_depth_of_the_command_line_override_the_experiments():
    c = _drafter_config(block_size=16, drafter_layers=2)
    assert (c.num_hidden_layers, c.block_size, c.target_layer_ids, c.head_dim) == (2, 16, [1, 3, 5, 7, 9], 192)


def test_generic_shapes_keep_their_defaults():
    """Null block size and depth on a shape without an experiment: block 16, 5 layers, the target's heads."""
    from dflash2.runtime.models import from_hf_model

    hf = random_model("tiny", dtype=torch.float32, device="cpu", seed=0)
    c = shape_drafter_config("tiny", hf, from_hf_model(hf), block_size=None, drafter_layers=None)
    assert (c.num_hidden_layers, c.block_size, c.num_attention_heads, c.head_dim) == (5, 16, 4, 16)


@pytest.mark.parametrize(("overrides", "layers", "block"), [([], 3, 8), (["block_size=16", "drafter_layers=2"], 2, 16)])
def test_command_builds_the_pair(overrides, layers, block, tmp_path, monkeypatch):
    """`python -m eval.speedup shape=small_hybrid` composes, and its pair (on the meta device: no decode, the
    measurement replaced) has the recipe's target and the experiment's drafter, or the command line's."""
    from hydra.core.global_hydra import GlobalHydra

    import dflash2.eval.speedup as speedup

    seen = {}
    monkeypatch.setattr(speedup, "run_speedup", lambda pair, **kw: seen.update(pair=pair, **kw) or {})
    argv = ["eval.speedup", "shape=small_hybrid", "device=meta", "hydra/job_logging=none", "hydra/hydra_logging=none"]
    monkeypatch.setattr(sys, "argv", [*argv, *overrides, f"paths.output_dir={tmp_path}"])
    GlobalHydra.instance().clear()
    speedup_cli.main()
    pair = seen["pair"]
    c = pair.drafter.config
    built = {**pair.hf.config.to_dict(), "dtype": None}  # the weights' dtype is the command's (bf16)
    assert pair.random and built == shape_config("small_hybrid").to_dict()
    assert (c.num_hidden_layers, c.block_size, c.target_layer_ids) == (layers, block, [1, 3, 5, 7, 9])
    assert pair.target.num_layers == 12 and pair.target.embed.weight.dtype == torch.bfloat16
    assert f"shape=small_hybrid (drafter: {layers} layers, block {block}" in pair.label
    assert seen["predict_taus"] == [3.0, 5.0]  # random weights: predictions
    mask = c.mask_token_id
    assert all(mask not in p for p in pair.prompts) and max(map(max, pair.prompts)) < 8192
