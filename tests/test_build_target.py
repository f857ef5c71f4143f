"""The embedded target recipe end to end, at micro size (issue 2): build, cache, reuse, determinism."""

from __future__ import annotations

import json

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from dflash2.training.cli import CONFIG_DIR
from dflash2.training.run import run_from_config

pytestmark = pytest.mark.slow

MICRO = [
    "experiment=target_tiny",
    "target.recipe.vocab_size=320",
    "target.recipe.hidden_size=32",
    "target.recipe.intermediate_size=64",
    "target.recipe.num_attention_heads=2",
    "target.recipe.num_key_value_heads=1",
    "target.recipe.head_dim=16",
    "target.recipe.linear_num_key_heads=2",
    "target.recipe.linear_num_value_heads=2",
    "target.recipe.linear_key_head_dim=8",
    "target.recipe.linear_value_head_dim=8",
    "target.recipe.seq_len=32",
    "target.recipe.batch_size=4",
    "target.recipe.max_steps=3",
    "target.recipe.warmup_steps=1",
    "target.recipe.eval_windows=4",
    "target.recipe.tokenizer_train_bytes=300000",
    "target.recipe.max_train_tokens=20000",
    "trainer.enable_progress_bar=false",
]


def build(tmp_path, name, cache):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("train", overrides=[*MICRO, f"paths.output_dir={tmp_path / name}", f"paths.cache_dir={cache}"])
    GlobalHydra.instance().clear()
    return run_from_config(cfg)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("build")
    summary = build(tmp, "a", tmp / "cache_a")
    return tmp, summary


def test_built_target_loads_with_plain_transformers(built):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp, summary = built
    folder = tmp / "a" / "target"
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert "linear_attention" in model.config.layer_types and "full_attention" in model.config.layer_types
    assert tokenizer.mask_token_id is not None and tokenizer.mask_token_id < model.config.vocab_size
    assert tokenizer.decode(tokenizer("def f(x):\n    return x")["input_ids"]) == "def f(x):\n    return x"
    info = json.loads((folder / "build_info.json").read_text())
    for key in ("heldout_cross_entropy", "heldout_unigram_train_cross_entropy", "heldout_unigram_oracle_cross_entropy"):
        assert info[key] > 0
    assert summary["target_build"]["heldout_cross_entropy"] == info["heldout_cross_entropy"]


def test_cached_target_is_reused(built, monkeypatch):
    import dflash2.training.build_target as bt

    tmp, _ = built

    def must_not_build(*args, **kwargs):
        raise AssertionError("the cached target was rebuilt")

    monkeypatch.setattr(bt, "build_embedded_target", must_not_build)
    build(tmp, "b", tmp / "cache_a")
    assert (tmp / "b" / "target" / "model.safetensors").exists()


def test_rebuild_from_the_seed_is_identical(built):
    from safetensors.torch import load_file

    tmp, _ = built
    build(tmp, "c", tmp / "cache_c")  # a fresh cache: built again from scratch
    a = load_file(tmp / "a" / "target" / "model.safetensors")
    c = load_file(tmp / "c" / "target" / "model.safetensors")
    assert a.keys() == c.keys() and all(torch.equal(a[k], c[k]) for k in a)
    assert (tmp / "a" / "target" / "tokenizer.json").read_text() == (tmp / "c" / "target" / "tokenizer.json").read_text()
