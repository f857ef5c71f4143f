"""One resolver for a target's text config and language model (issue 12 item 2, dflash2/text_model.py).

Plain causal LMs, a composite Qwen3.5 folder saved the way the published checkpoints are
(``Qwen3_5ForConditionalGeneration``: ``text_config`` + ``vision_config``), and a whole
conditional-generation model: each gives the text decoder and its text config, and the
drafter config takes its fields from there with no silent default.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers
from conftest import MICRO_DRAFTER_OVERRIDES
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash2.decoding import greedy_generate, speculative_generate
from dflash2.drafter import load_drafter
from dflash2.drafter.from_target import drafter_config_for_target
from dflash2.errors import DFlash2Error
from dflash2.eval import acceptance_cli
from dflash2.export import export_drafter, read_target_info
from dflash2.target import TargetModel
from dflash2.text_model import config_field, language_model, rope_theta, text_config
from dflash2.training.cli import CONFIG_DIR
from dflash2.training.run import run_from_config

TAPS = [0, 1, 2]
ROPE_THETA = 1e7  # the published Qwen3.5 value, far from every default (10000)
MAX_POSITIONS = 2048  # neither the tiny target's 1024 nor the old silent default 4096
DRAFTER_SETTINGS = {
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "block_size": 4,
    "use_local_conv": False,
    "conv_kernel_size": 2,
    "conv_group_size": 16,
    "use_selector": False,
    "selector_rank": 16,
    "selector_top_k": 4,
}


def composite_qwen35_config(vocab_size: int, eos_token_id: int, pad_token_id: int) -> transformers.Qwen3_5Config:
    """Shaped like the published Qwen3.5 config.json (composite, multimodal RoPE, partial rotary), micro sizes."""
    text = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        max_position_embeddings=MAX_POSITIONS,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": ROPE_THETA,
            "partial_rotary_factor": 0.25,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        },
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        tie_word_embeddings=False,
    )
    vision = dict(
        depth=1,
        hidden_size=16,
        intermediate_size=32,
        num_heads=2,
        out_hidden_size=32,
        patch_size=4,
        spatial_merge_size=2,
        temporal_patch_size=2,
        num_position_embeddings=16,
    )
    return transformers.Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def composite_dir(micro_target_dir, tmp_path_factory):
    """A random Qwen3_5ForConditionalGeneration saved with save_pretrained + the micro BPE tokenizer."""
    tokenizer = AutoTokenizer.from_pretrained(str(micro_target_dir))
    config = composite_qwen35_config(len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForConditionalGeneration(config).float().eval()
    folder = tmp_path_factory.mktemp("qwen35_composite")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def whole(composite_dir):
    """The saved checkpoint loaded whole, vision tower included."""
    return transformers.Qwen3_5ForConditionalGeneration.from_pretrained(str(composite_dir)).float().eval()


# ------------------------------------------------------------------ the resolver
def test_plain_causal_lm_is_its_own_text_config_and_model_model_its_decoder():
    config = transformers.Qwen3Config(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, head_dim=8
    )
    model = AutoModelForCausalLM.from_config(config)
    assert text_config(model.config) is model.config
    assert language_model(model, 2) is model.model


def test_composite_gives_the_text_config_and_the_language_model_not_the_vision_tower(whole):
    assert text_config(whole.config) is whole.config.text_config
    assert language_model(whole, 4) is whole.model.language_model
    with pytest.raises(DFlash2Error, match="cannot find the language model") as err:
        language_model(whole, 7)  # no decoder of 7 layers: never a guess at another ModuleList
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "config, theta",
    [
        (SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 1e6}), 1e6),  # transformers 5
        (SimpleNamespace(rope_theta=5e5), 5e5),  # transformers 4 / a config.json written by it
        (SimpleNamespace(rope_parameters=None, rope_theta=5e5), 5e5),
        (
            SimpleNamespace(
                rope_parameters={"full_attention": {"rope_theta": 1e6}, "sliding_attention": {"rope_theta": 1e4}}
            ),
            1e6,
        ),  # per layer type (Gemma 3 style): the full-attention base
    ],
)
def test_rope_theta_from_either_place(config, theta):
    assert rope_theta(config) == theta


def test_rope_theta_of_the_installed_transformers_configs():
    qwen3 = transformers.Qwen3Config(rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    assert rope_theta(qwen3) == 1e6
    # no rope value at all in the config: the HF class's own default (its default_theta), not ours
    assert rope_theta(transformers.LlamaConfig()) == 10000.0


def test_a_config_without_rope_theta_is_one_line_naming_it():
    with pytest.raises(DFlash2Error, match="has no rope_theta") as err:
        rope_theta(SimpleNamespace(rope_parameters={"rope_type": "default"}))
    assert "\n" not in str(err.value)
    with pytest.raises(DFlash2Error, match="has no rms_norm_eps"):
        config_field(SimpleNamespace(), "rms_norm_eps")


# ------------------------------------------------------------------ through the target adapter
def test_composite_folder_loads_as_the_text_model_with_its_text_config(composite_dir, whole):
    target = TargetModel.from_pretrained(str(composite_dir), target_layer_ids=TAPS)
    assert isinstance(target.text_config, transformers.Qwen3_5TextConfig)
    assert rope_theta(target.text_config) == ROPE_THETA
    assert target.text_config.max_position_embeddings == MAX_POSITIONS
    assert target.num_layers == 4 and target.hidden_size == 32 and target.has_linear_attention
    assert target.language_model.layers is not None and target.final_norm is target.language_model.norm
    # the checkpoint's text weights were loaded (not a fresh init): taps equal the whole model's hidden states
    ids = torch.randint(3, target.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hs = whole.model.language_model(input_ids=ids, output_hidden_states=True).hidden_states
        logits = whole(input_ids=ids).logits
    out = target(ids)
    torch.testing.assert_close(out.taps, torch.cat([hs[i + 1] for i in TAPS], dim=-1))
    torch.testing.assert_close(out.logits, logits)

    config = drafter_config_for_target(DRAFTER_SETTINGS, target)
    assert config.rope_theta == ROPE_THETA and config.max_position_embeddings == MAX_POSITIONS
    assert config.intermediate_size == 64 and config.rms_norm_eps == target.text_config.rms_norm_eps


def test_a_whole_conditional_generation_model_is_a_target_too(composite_dir, whole):
    """Kept whole (vision tower beside the decoder): the taps come from the text layers and decoding stays lossless."""
    from dflash2.drafter import DFlashDrafter

    text_only = TargetModel.from_pretrained(str(composite_dir), target_layer_ids=TAPS)
    target = TargetModel(whole, target_layer_ids=TAPS, tokenizer=text_only.tokenizer)
    assert target.text_config is whole.config.text_config and target.language_model is whole.model.language_model
    assert target.final_norm is whole.model.language_model.norm
    ids = torch.randint(3, target.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(target.tap_features(ids), text_only.tap_features(ids))
    torch.testing.assert_close(target(ids).logits, text_only(ids).logits)

    torch.manual_seed(3)
    drafter = DFlashDrafter(drafter_config_for_target(DRAFTER_SETTINGS, target)).eval()
    prompts = [ids[0, :7].tolist(), ids[1].tolist()]
    spec = speculative_generate(target, drafter, prompts, max_new_tokens=20)
    assert spec.sequences == greedy_generate(target, prompts, 20)
    assert spec.sequences == greedy_generate(text_only, prompts, 20)


@pytest.mark.parametrize(
    "field, setting",
    [
        ("intermediate_size", "drafter.intermediate_size"),
        ("rms_norm_eps", None),
        ("max_position_embeddings", None),
        ("rope_theta", "drafter.rope_theta"),
    ],
)
def test_a_field_the_target_config_lacks_is_one_line_naming_it(composite_dir, field, setting):
    """E.g. a remote-code config class that names the field otherwise: every field of the real text
    config but one, in a config object of another class (HF's own classes always define them)."""

    class ForeignTextConfig(SimpleNamespace):
        pass

    target = TargetModel.from_pretrained(str(composite_dir), target_layer_ids=TAPS)
    fields = {k: v for k, v in target.text_config.to_dict().items() if k != field}
    if field == "rope_theta":
        fields["rope_parameters"] = {"rope_type": "default"}
    target.text_config = ForeignTextConfig(**fields)
    with pytest.raises(DFlash2Error, match=f"has no {field}") as err:
        drafter_config_for_target(DRAFTER_SETTINGS, target)
    assert "\n" not in str(err.value) and "ForeignTextConfig" in str(err.value)
    if setting is not None:  # the drafter setting that supplies it instead
        assert setting in str(err.value)
        value = {"intermediate_size": 48, "rope_theta": 5e5}[field]
        config = drafter_config_for_target({**DRAFTER_SETTINGS, field: value}, target)
        assert getattr(config, field) == value


# ------------------------------------------------------------------ train -> export -> eval on the composite folder
@pytest.mark.slow
def test_composite_folder_trains_exports_and_evaluates(composite_dir, tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="dflash2")
    with safe_open(str(composite_dir / "model.safetensors"), "pt") as f:  # saved like the published checkpoints
        names = list(f.keys())
    assert any(k.startswith("model.language_model.") for k in names)
    assert any(k.startswith("model.visual.") for k in names)
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(
            "train",
            overrides=[
                f"paths.output_dir={tmp_path / 'run'}",
                f"paths.cache_dir={tmp_path / 'cache'}",
                f"target.path={composite_dir}",
                *MICRO_DRAFTER_OVERRIDES,
            ],
        )
    GlobalHydra.instance().clear()
    run = Path(run_from_config(cfg)["output_dir"])
    trained = load_drafter(run / "drafter")
    assert trained.config.rope_theta == ROPE_THETA and trained.config.max_position_embeddings == MAX_POSITIONS

    info = read_target_info(str(composite_dir))  # AutoConfig gives the composite config: its text part is read
    assert (info.num_layers, info.hidden_size, info.rope_theta) == (4, 32, ROPE_THETA)
    exported = export_drafter(run / "checkpoints" / "last.ckpt", tmp_path / "export", target=str(composite_dir))
    assert json.loads((exported / "config.json").read_text())["rope_theta"] == ROPE_THETA

    out = tmp_path / "eval"
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "eval.acceptance",
            f"target={composite_dir}",
            f"drafter={exported}",
            "num_prompts=4",
            "prompt_tokens=16",
            "max_new_tokens=24",
            f"paths.output_dir={out}",
            "hydra/job_logging=none",
            "hydra/hydra_logging=none",
        ],
    )
    acceptance_cli.main()
    res = json.loads((out / "results.json").read_text())
    assert res["lossless"] is True and res["num_prompts"] == 4 and res["settings"]["dtype"] == "float32"
    assert any(m.startswith("mean tau ") and "lossless true" in m for m in caplog.messages)
