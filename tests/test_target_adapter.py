"""TargetModel: loading saved HF folders, taps equal to HF's own hidden states, frozen-ness, errors.

Three tiny random targets (fp32, seeded) are built and saved once per module:
Qwen3, a Qwen3.5 3:1 GDN/attention hybrid, and Llama.
"""

import os

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast, Qwen3Config

from dflash2.errors import DFlash2Error
from dflash2.target import TargetModel, default_target_layer_ids, tap_settings, validate_target_layer_ids

VOCAB = 256
COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16
)


def _configs():
    return {
        "qwen3": Qwen3Config(num_hidden_layers=6, **COMMON),
        "qwen3_5": transformers.Qwen3_5TextConfig(
            num_hidden_layers=4,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            **COMMON,
        ),
        "llama": LlamaConfig(num_hidden_layers=5, **COMMON),
    }


def _tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, **{f"w{i}": i for i in range(1, 32)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{name: folder} of save_pretrained'd tiny targets; the Qwen3 one also has a tokenizer."""
    folders = {}
    for name, cfg in _configs().items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg).float()
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder)
        if name == "qwen3":
            _tiny_tokenizer().save_pretrained(folder)
        folders[name] = str(folder)
    return folders


@pytest.fixture(scope="module")
def targets(saved):
    ids = {"qwen3": [0, 2, 3], "qwen3_5": [0, 1, 2], "llama": None}  # llama: the ARCHITECTURE.md §2.1 default
    return {n: TargetModel.from_pretrained(f, target_layer_ids=ids[n]) for n, f in saved.items()}


def _inputs(n=2, length=11, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n, length), generator=g)


# --------------------------------------------------------------- layer ids
def test_default_target_layer_ids_follow_section2_rule():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(28) == [1, 7, 13, 19, 25]
    assert default_target_layer_ids(5, 5) == [1, 2]  # duplicates dropped, order kept
    assert default_target_layer_ids(4) == [1]
    assert default_target_layer_ids(3) == [0, 1]  # L-3 < 1: spread over range(L-1)
    assert default_target_layer_ids(1) == [0]
    assert default_target_layer_ids(36, 1) == [1]
    for num_layers in range(1, 80):
        ids = default_target_layer_ids(num_layers, 5)
        assert ids == validate_target_layer_ids(ids, num_layers)


def test_validate_target_layer_ids_errors_name_the_valid_range():
    assert validate_target_layer_ids((3, 0, 1), 4) == [3, 0, 1]  # order kept
    for bad in ([0, 4], [-1], [], [1, 1], [1.5], "1,2", 2):
        with pytest.raises(DFlash2Error, match=r"0\.\.3"):
            validate_target_layer_ids(bad, 4)


def test_tap_settings_of_a_target_group():
    """What training passes to TargetModel from its ``target`` group: null ids = the §2 rule over num_taps."""
    assert tap_settings({"target_layer_ids": None, "num_taps": 3}) == {"target_layer_ids": None, "num_taps": 3}
    assert tap_settings({"target_layer_ids": (0, 2)}) == {"target_layer_ids": [0, 2], "num_taps": 5}


# ------------------------------------------------------------ taps + logits
@pytest.mark.parametrize("name", ["qwen3", "qwen3_5", "llama"])
def test_taps_and_logits_equal_hf_forward(targets, name):
    target = targets[name]
    ids = _inputs()
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding on one row: the mask must reach the model unchanged
    with torch.no_grad():
        ref = target.model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    hooks = [len(m._forward_hooks) for m in target.model.modules()]
    assert len(ref.hidden_states) == target.num_layers + 1
    expected = torch.cat([ref.hidden_states[i + 1] for i in target.target_layer_ids], dim=-1)

    out = target(ids, attention_mask=mask)
    k = len(target.target_layer_ids)
    assert out.taps.shape == (2, 11, k * target.hidden_size)
    assert out.logits.shape == (2, 11, VOCAB)
    torch.testing.assert_close(out.taps, expected, rtol=0, atol=0)
    torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=0)
    assert out.past_key_values is None
    torch.testing.assert_close(target.tap_features(ids, attention_mask=mask), expected, rtol=0, atol=0)
    # Our hooks are removed after each call (HF's output_hidden_states installs its own, kept).
    assert [len(m._forward_hooks) for m in target.model.modules()] == hooks


def test_loaded_weights_equal_the_saved_model(targets):
    for name, cfg in _configs().items():
        torch.manual_seed(0)
        original = AutoModelForCausalLM.from_config(cfg).float().eval()
        ids = _inputs()
        with torch.no_grad():
            torch.testing.assert_close(targets[name](ids).logits, original(ids).logits, rtol=0, atol=0)


def test_last_layer_tap_is_the_raw_layer_output_before_final_norm(saved):
    # HF overwrites hidden_states[-1] with the final-normed state; a tap is the decoder layer's own output.
    target = TargetModel.from_pretrained(saved["llama"], target_layer_ids=[4])
    ids = _inputs()
    with torch.no_grad():
        ref = target.model(ids, output_hidden_states=True)
        torch.testing.assert_close(target.final_norm(target(ids).taps), ref.hidden_states[-1])


def test_hybrid_cache_continues_like_a_full_forward(targets):
    target = targets["qwen3_5"]
    ids = _inputs(length=9)
    full = target(ids)
    prefix = target(ids[:, :6], use_cache=True)
    cache = prefix.past_key_values
    assert cache is not None and cache.get_seq_length() == 6
    step = target(ids[:, 6:], past_key_values=cache)
    torch.testing.assert_close(step.logits, full.logits[:, 6:], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(step.taps, full.taps[:, 6:], rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------- what it is
def test_loaded_class_and_layer_types(targets):
    hybrid = targets["qwen3_5"]
    assert type(hybrid.model).__name__ == "Qwen3_5ForCausalLM"
    assert hybrid.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert hybrid.has_linear_attention
    for name in ("qwen3", "llama"):
        assert targets[name].layer_types == ["full_attention"] * targets[name].num_layers
        assert not targets[name].has_linear_attention
    llama = targets["llama"]
    assert llama.target_layer_ids == default_target_layer_ids(5) == [1, 2]
    assert (llama.num_layers, llama.hidden_size, llama.vocab_size) == (5, 64, VOCAB)
    assert llama.embed_tokens.weight.shape == (VOCAB, 64)
    assert llama.lm_head.weight.shape == (VOCAB, 64)
    assert llama.final_norm is llama.model.model.norm


def test_describe_mentions_layer_kinds_and_taps(targets):
    text = targets["qwen3_5"].describe()
    assert "3 linear_attention + 1 full_attention" in text
    assert "Qwen3_5ForCausalLM" in text and "[0, 1, 2]" in text and "hidden 64" in text
    assert "\n" not in text


def test_tokenizer_loaded_only_when_saved(targets):
    assert targets["qwen3"].tokenizer is not None
    assert targets["qwen3"].tokenizer("w3 w5")["input_ids"] == [3, 5]
    assert targets["llama"].tokenizer is None


def test_frozen_eval_and_train_is_a_noop(targets):
    target = targets["qwen3"]
    assert all(not p.requires_grad for p in target.parameters())
    target.train()
    assert not any(m.training for m in target.model.modules())
    target.train(False)
    # The taps carry no graph but can feed a trainable module (no_grad, not inference_mode).
    taps = target(_inputs()).taps
    assert not taps.requires_grad
    head = torch.nn.Linear(taps.shape[-1], 1)
    head(taps).sum().backward()
    assert head.weight.grad is not None
    # The decoder layers are registered once: state_dict is exactly the HF model's, under "model.".
    assert set(target.state_dict()) == {f"model.{k}" for k in target.model.state_dict()}


# ------------------------------------------------------------------ errors
def test_nonexistent_path_names_it(tmp_path):
    for missing in (str(tmp_path / "nope"), "./no/such/target", "a/b/c"):
        with pytest.raises(DFlash2Error, match="does not exist") as err:
            TargetModel.from_pretrained(missing)
        assert missing in str(err.value)


def test_folder_without_weights(saved, tmp_path):
    folder = tmp_path / "cfg_only"
    folder.mkdir()
    with open(os.path.join(saved["llama"], "config.json")) as src:
        (folder / "config.json").write_text(src.read())
    with pytest.raises(DFlash2Error, match="has no weights") as err:
        TargetModel.from_pretrained(str(folder))
    assert str(folder) in str(err.value)


def test_layer_ids_out_of_range_on_load(saved):
    with pytest.raises(DFlash2Error, match=r"0\.\.5"):
        TargetModel.from_pretrained(saved["qwen3"], target_layer_ids=[1, 6])


def test_truncated_safetensors_is_named(saved, tmp_path):
    folder = tmp_path / "truncated"
    folder.mkdir()
    for f in os.listdir(saved["llama"]):
        with open(os.path.join(saved["llama"], f), "rb") as src:
            (folder / f).write_bytes(src.read())
    weights = folder / "model.safetensors"
    with open(weights, "r+b") as fh:
        fh.truncate(os.path.getsize(weights) // 2)
    with pytest.raises(DFlash2Error, match="corrupted or truncated") as err:
        TargetModel.from_pretrained(str(folder))
    assert str(weights) in str(err.value)


def test_bad_dtype(saved):
    with pytest.raises(DFlash2Error, match="dtype"):
        TargetModel.from_pretrained(saved["llama"], dtype="float8")


def test_hub_id_offline_says_hub_unreachable():
    from huggingface_hub import constants

    if not constants.HF_HUB_OFFLINE:
        pytest.skip("only meaningful (and fast) with HF_HUB_OFFLINE=1")
    with pytest.raises(DFlash2Error, match="Hub can't be reached"):
        TargetModel.from_pretrained("nobody-dflash2/no-such-model")
