"""Every way of loading a drafter checks the folder first (issue 12): a damaged or foreign folder is one
DFlash2Error line naming the file and the problem. Here through ``load_drafter``; the eval, export and
``init_from`` entry points (nothing written) are in test_eval_acceptance.py, test_export.py and
test_train_drafter.py."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash2.drafter import DFlashDrafter, DrafterConfig, load_drafter, save_drafter
from dflash2.drafter.folder_check import check_drafter_folder
from dflash2.errors import DFlash2Error

SMALL = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    rope_theta=10000.0,
    max_position_embeddings=256,
    vocab_size=96,
    target_hidden_size=16,
    target_layer_ids=[1, 3],
    mask_token_id=95,
    block_size=4,
    conv_group_size=8,
    selector_rank=8,
    selector_top_k=5,
)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A DFlash2 and a DFlash v1 drafter folder, and a Hugging Face Qwen3 model folder (a target)."""
    from conftest import spec_target_config
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("folders")
    torch.manual_seed(0)
    save_drafter(DFlashDrafter(DrafterConfig(**SMALL, use_local_conv=True, use_selector=True)), root / "v2")
    save_drafter(DFlashDrafter(DrafterConfig(**SMALL)), root / "v1")
    AutoModelForCausalLM.from_config(spec_target_config("qwen3")).save_pretrained(root / "qwen3")
    return root


def config_of(folder):
    return json.loads((folder / "config.json").read_text())


def write_config(folder, cfg):
    (folder / "config.json").write_text(json.dumps(cfg))


def without_dflash2_section(folder):
    cfg = config_of(folder)
    del cfg["dflash2"]
    write_config(folder, cfg)
    return cfg


def drop_field(section, name):
    def damage(d):
        if section == "dflash2":  # our full DrafterConfig section
            cfg = config_of(d)
            del cfg["dflash2"][name]
        else:  # a z-lab / vLLM folder: only the top-level fields
            cfg = without_dflash2_section(d)
            del cfg[name]
        write_config(d, cfg)

    return damage


def truncate(keep):
    def damage(d):
        data = (d / "model.safetensors").read_bytes()
        (d / "model.safetensors").write_bytes(data[: keep(len(data))])

    return damage


def set_field(name, value):
    def damage(d):
        cfg = config_of(d)
        cfg["dflash2"][name] = value
        write_config(d, cfg)

    return damage


def v1_weights(folders):
    def damage(d):
        shutil.copy(folders / "v1" / "model.safetensors", d / "model.safetensors")

    return damage


def reshaped_tensor(d):
    w = load_file(str(d / "model.safetensors"))
    w["fc.weight"] = torch.zeros(32, 31)
    save_file(w, str(d / "model.safetensors"))


CASES = {
    "no config.json": (lambda d: (d / "config.json").unlink(), r"{d} has no config\.json"),
    "no weights": (lambda d: (d / "model.safetensors").unlink(), r"{d} has no model\.safetensors"),
    "bad json": (lambda d: (d / "config.json").write_text('{"hidden_size": 3'), r"{c} is not valid JSON"),
    "json list": (lambda d: (d / "config.json").write_text("[1, 2]"), r"{c} holds a JSON list, not an object"),
    "missing field (dflash2 section)": (
        drop_field("dflash2", "hidden_size"),
        r"{c}: drafter config is missing required field\(s\) \['hidden_size'\]",
    ),
    "missing field (z-lab fields)": (drop_field("zlab", "vocab_size"), r"{c} has no 'vocab_size'"),
    "field of the wrong type": (set_field("rope_theta", "big"), r"{c} has a field of the wrong type or value"),
    "header only": (truncate(lambda n: 8), r"weights file {w} is corrupted or truncated \(.*invalid header length"),
    "half the weights": (truncate(lambda n: n // 2), r"weights file {w} is corrupted or truncated \(.*incomplete"),
    "empty weights": (truncate(lambda n: 0), r"weights file {w} is corrupted or truncated"),
    "a tensor of another shape": (reshaped_tensor, r"{w}: 'fc\.weight' has shape \(32, 31\), {c} implies \(32, 32\)"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_damaged_folder_is_one_line_naming_the_file(folders, tmp_path, case):
    damage, pattern = CASES[case]
    d = shutil.copytree(folders / "v2", tmp_path / "drafter")
    damage(d)
    names = {"d": d, "c": d / "config.json", "w": d / "model.safetensors"}
    with pytest.raises(DFlash2Error, match=pattern.format(**{k: re.escape(str(v)) for k, v in names.items()})) as e:
        load_drafter(d)
    assert "\n" not in str(e.value)


def test_a_missing_folder_or_a_file_is_named(tmp_path):
    with pytest.raises(DFlash2Error, match=rf"drafter folder {tmp_path / 'nope'} not found"):
        load_drafter(tmp_path / "nope")
    (tmp_path / "weights.safetensors").write_bytes(b"")
    with pytest.raises(DFlash2Error, match=r"weights\.safetensors is a file, not a folder"):
        load_drafter(tmp_path / "weights.safetensors")


def test_a_hugging_face_model_folder_is_not_a_drafter(folders, tmp_path):
    with pytest.raises(DFlash2Error, match=r"config\.json is not a DFlash drafter config \(architecture Qwen3For"):
        load_drafter(folders / "qwen3")
    # a drafter config.json beside a language model's weights: the key set names the format
    d = shutil.copytree(folders / "qwen3", tmp_path / "mixed")
    shutil.copy(folders / "v2" / "config.json", d / "config.json")
    with pytest.raises(DFlash2Error, match=r"model\.safetensors holds a Hugging Face language model's tensors"):
        load_drafter(d)


def test_dflash_v1_weights_where_dflash2_keys_are_expected(folders, tmp_path):
    d = shutil.copytree(folders / "v2", tmp_path / "ours")
    v1_weights(folders)(d)  # our config (dflash2 section) with the conv and selector on
    with pytest.raises(DFlash2Error, match=r"\(DFlash v1 weights under a config that turns on the DFlash2 conv"):
        load_drafter(d)
    without_dflash2_section(d)  # z-lab / vLLM fields only: the architecture says DFlash2
    with pytest.raises(DFlash2Error, match=r"holds no DFlash2 conv / selector tensor but .*declares DFlash2DraftModel"):
        load_drafter(d)
    d1 = shutil.copytree(folders / "v1", tmp_path / "v1")
    shutil.copy(folders / "v2" / "model.safetensors", d1 / "model.safetensors")  # and the other way round
    with pytest.raises(DFlash2Error, match=r"\(DFlash2 weights under a config that turns the conv / selector off"):
        load_drafter(d1)
    without_dflash2_section(d1)
    with pytest.raises(DFlash2Error, match=r"holds the DFlash2 conv / selector tensors but .*DFlashDraftModel"):
        load_drafter(d1)


def test_intact_folders_pass_and_read_no_tensor(folders):
    for name, v2 in (("v1", False), ("v2", True)):
        checked = check_drafter_folder(folders / name)
        assert checked.config.is_v2 == v2 and checked.shapes["fc.weight"] == (32, 32)
        assert load_drafter(folders / name).config == checked.config
