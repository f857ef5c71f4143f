"""python -m dflash2.export (issue 5, ARCHITECTURE.md §7): round trip to identical drafts, and every
pre-write validation catching its broken case with nothing left at ``out``."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from dflash2.decoding.decoder import speculative_generate
from dflash2.drafter import ContextCache, DFlashDrafter, DrafterConfig, load_drafter, save_drafter
from dflash2.errors import DFlash2Error
from dflash2.export import export_drafter, main, read_target_info
from dflash2.target import TargetModel

TAPS = [0, 1, 2]
PROMPTS = [[5, 17, 42, 99, 7], [200, 3, 3, 64], [11, 250, 31, 8, 120, 77]]


@pytest.fixture(scope="module")
def micro_target(micro_target_dir):
    return TargetModel.from_pretrained(str(micro_target_dir), target_layer_ids=TAPS, dtype="float32")


def drafter_config(target_dir, v2: bool, **kw) -> DrafterConfig:
    t = read_target_info(str(target_dir))
    base = dict(
        hidden_size=t.hidden_size,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        rope_theta=t.rope_theta,
        max_position_embeddings=1024,
        vocab_size=t.vocab_size,
        target_hidden_size=t.hidden_size,
        target_layer_ids=list(TAPS),
        mask_token_id=t.vocab_size - 1,
        block_size=4,
        use_local_conv=v2,
        conv_group_size=8,
        use_selector=v2,
        selector_rank=8,
        selector_top_k=4,
        num_target_layers=t.num_layers,
        target_name_or_path=str(target_dir),
    )
    base.update(kw)
    return DrafterConfig(**base)


def fake_ckpt(tmp_path, cfg: DrafterConfig, seed: int = 0, name: str = "run"):
    """A Lightning-style training checkpoint at <run>/checkpoints/last.ckpt (what train.py writes)."""
    torch.manual_seed(seed)
    drafter = DFlashDrafter(cfg)
    with torch.no_grad():  # non-trivial weights everywhere (norms included)
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    ckpt_dir = tmp_path / name / "checkpoints"
    ckpt_dir.mkdir(parents=True)
    ckpt = {
        "state_dict": {f"drafter.{k}": v for k, v in drafter.state_dict().items()},
        "global_step": 6,
        "dflash2": {"drafter_config": cfg.to_dict(), "target_id": cfg.target_name_or_path},
    }
    torch.save(ckpt, ckpt_dir / "last.ckpt")
    return ckpt_dir / "last.ckpt", drafter.eval()


@pytest.mark.parametrize("v2", [False, True])
def test_round_trip_identical_drafts(tmp_path, micro_target_dir, micro_target, v2):
    _, drafter = fake_ckpt(tmp_path, drafter_config(micro_target_dir, v2))
    (tmp_path / "run" / "eval").mkdir()
    (tmp_path / "run" / "eval" / "results.json").write_text(json.dumps({"mean_tau": 2.5}))
    out = export_drafter(tmp_path / "run", tmp_path / "export", dtype=torch.float32, target=str(micro_target_dir))
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    c = json.loads((out / "config.json").read_text())
    assert c["architectures"] == (["DFlash2DraftModel"] if v2 else ["DFlashDraftModel"])
    assert c["dflash_config"]["target_layer_ids"] == TAPS and c["block_size"] == 4
    assert c["dflash2_export"]["vllm_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert c["dflash2_export"]["format"] == ("dflash2" if v2 else "dflash") and c["dflash2_export"]["steps"] == 6
    assert any(k.startswith("candidate_selector.") for k in load_file(str(out / "model.safetensors"))) == v2
    card = (out / "README.md").read_text()
    assert "2.500" in card and "not tested here" in card.lower() and '"num_speculative_tokens": 3' in card
    assert str(micro_target_dir) in card and "load_drafter" in card

    loaded = load_drafter(out)
    assert loaded.config == drafter.config
    a = speculative_generate(micro_target, drafter, PROMPTS, max_new_tokens=12)
    b = speculative_generate(micro_target, loaded, PROMPTS, max_new_tokens=12)
    assert a.sequences == b.sequences and a.accepted == b.accepted and a.mean_tau == b.mean_tau
    assert all(len(s) == 12 for s in a.sequences)

    # re-exporting the exported folder (auto format, bf16 default, recorded target) works too
    bf = export_drafter(out, tmp_path / "bf16")
    w = load_file(str(bf / "model.safetensors"))
    assert all(v.dtype == torch.bfloat16 for v in w.values())
    assert load_drafter(bf).fc.weight.dtype == torch.bfloat16
    assert "not measured" in (bf / "README.md").read_text()


def test_cli_writes_folder_and_reports_errors(tmp_path, micro_target_dir, capsys):
    ckpt, _ = fake_ckpt(tmp_path, drafter_config(micro_target_dir, False))
    assert main([f"checkpoint={ckpt}", f"out={tmp_path / 'e'}", "dtype=float32", "format=dflash"]) == 0
    assert load_drafter(tmp_path / "e").fc.weight.dtype == torch.float32
    assert main(["--help"]) == 0 and "checkpoint=PATH" in capsys.readouterr().out
    assert main([f"checkpoint={ckpt}", "out=x", "dtype=int8"]) == 2
    assert main([f"checkpoint={ckpt}", "oot=x"]) == 2
    err = capsys.readouterr().err
    assert "dtype=bfloat16" in err and "unknown argument 'oot=x'" in err


@pytest.mark.parametrize("how", ["touch", "shell"])
def test_cli_refuses_a_crafted_checkpoint_without_running_it(tmp_path, micro_target_dir, capsys, how):
    """A shared .ckpt whose pickle runs code (issue 12): refused in one line, the code never runs, nothing written."""
    from conftest import crafted_checkpoint

    ckpt, _ = fake_ckpt(tmp_path, drafter_config(micro_target_dir, True))
    marker = tmp_path / "pwned"
    crafted_checkpoint(ckpt, marker, torch.load(ckpt, weights_only=True), how=how)  # a valid checkpoint + payload
    capsys.readouterr()
    assert main([f"checkpoint={tmp_path / 'run'}", f"out={tmp_path / 'out'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {ckpt} was not loaded: ") and "could run code" in err and err.count("\n") == 1
    assert not marker.exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("damage", ["truncated weights", "no config fields", "a target folder"])
def test_cli_checks_a_drafter_folder_first_and_writes_nothing(tmp_path, micro_target_dir, capsys, damage):
    """Exporting a folder goes through the same folder check as load_drafter (issue 12)."""
    import shutil

    ckpt, _ = fake_ckpt(tmp_path, drafter_config(micro_target_dir, True))
    folder = export_drafter(ckpt, tmp_path / "exported", dtype=torch.float32)
    if damage == "truncated weights":
        (folder / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes()[:-10])
        needle = f"drafter weights file {folder / 'model.safetensors'} is corrupted or truncated"
    elif damage == "no config fields":
        (folder / "config.json").write_text(json.dumps({"architectures": ["DFlash2DraftModel"], "dflash_config": {}}))
        needle = f"{folder / 'config.json'} has no 'target_layer_ids'"
    else:
        shutil.rmtree(folder)
        folder = micro_target_dir
        needle = f"{folder / 'config.json'} is not a DFlash drafter config"
    capsys.readouterr()
    assert main([f"checkpoint={folder}", f"out={tmp_path / 'out'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {needle}") and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def _expect_error(tmp_path, source, match, **kw):
    out = tmp_path / "out"
    with pytest.raises(DFlash2Error, match=match) as e:
        export_drafter(source, out, **kw)
    assert "\n" not in str(e.value)
    assert not out.exists() and not any(p.name.startswith(".out") for p in tmp_path.iterdir())


def test_wrong_key_and_v2_weights_in_v1_format(tmp_path, micro_target_dir):
    cfg = drafter_config(micro_target_dir, True)
    ckpt, _ = fake_ckpt(tmp_path, cfg)
    _expect_error(tmp_path, ckpt, r"format=dflash but .*use format=dflash2", fmt="dflash")
    data = torch.load(ckpt, weights_only=True)
    sd = data["state_dict"]
    sd["drafter.layers.0.self_attn.qproj.weight"] = sd.pop("drafter.layers.0.self_attn.q_proj.weight")
    torch.save(data, ckpt)
    _expect_error(
        tmp_path, ckpt, r"missing \['layers\.0\.self_attn\.q_proj\.weight'\].*unexpected \['layers\.0\.self_attn\.qproj"
    )
    # a v1 drafter cannot be exported as DFlash2
    v1, _ = fake_ckpt(tmp_path, drafter_config(micro_target_dir, False), name="v1")
    _expect_error(tmp_path, v1, r"format=dflash2 but .*use format=dflash", fmt="dflash2")


def test_wrong_shape(tmp_path, micro_target_dir):
    ckpt, _ = fake_ckpt(tmp_path, drafter_config(micro_target_dir, True))
    data = torch.load(ckpt, weights_only=True)
    data["state_dict"]["drafter.candidate_selector.hidden_projection.weight"] = torch.zeros(9, 32)
    torch.save(data, ckpt)
    _expect_error(tmp_path, ckpt, r"'candidate_selector\.hidden_projection\.weight' has shape \(9, 32\).*\(8, 32\)")


def test_shifted_layer_ids(tmp_path, micro_target_dir):
    # vLLM's +1 aux ids written as DFlash ids: layer 4 does not exist in the 4-layer target
    ckpt, _ = fake_ckpt(
        tmp_path, drafter_config(micro_target_dir, False, target_layer_ids=[1, 2, 3, 4], num_target_layers=None)
    )
    _expect_error(
        tmp_path, ckpt, r"target_layer_ids=\[1, 2, 3, 4\] has \[4\] outside 0\.\.3.*vLLM", target=str(micro_target_dir)
    )
    # an exported folder whose z-lab ids were shifted by hand disagrees with the trained ids
    good, _ = fake_ckpt(tmp_path, drafter_config(micro_target_dir, False), name="good")
    folder = export_drafter(good, tmp_path / "exp", dtype=torch.float32)
    c = json.loads((folder / "config.json").read_text())
    c["dflash_config"]["target_layer_ids"] = [1, 2, 3]
    (folder / "config.json").write_text(json.dumps(c))
    _expect_error(tmp_path, folder, r"\[1, 2, 3\] disagrees .*\[0, 1, 2\] \(shifted by \+1: those are vLLM aux")


def test_mask_id_outside_target_vocab(tmp_path, micro_target_dir):
    # the drafter's own vocab (400) admits the id; the target's 320-token vocab does not
    ckpt, _ = fake_ckpt(tmp_path, drafter_config(micro_target_dir, False, vocab_size=400, mask_token_id=350))
    _expect_error(tmp_path, ckpt, r"mask_token_id=350 is outside the vocab \[0, 320\)", target=str(micro_target_dir))


def test_hidden_size_mismatch(tmp_path, micro_target_dir):
    ckpt, _ = fake_ckpt(tmp_path, drafter_config(micro_target_dir, False, hidden_size=48, target_hidden_size=48))
    _expect_error(tmp_path, ckpt, r"does not fit target .*hidden_size 48 vs 32", target=str(micro_target_dir))


def test_drafter_of_another_tokenizer_is_refused(tmp_path, micro_target_dir):
    # same vocab size and widths, but the drafter recorded another tokenizer: its ids mean other tokens
    ckpt, _ = fake_ckpt(
        tmp_path, drafter_config(micro_target_dir, False, target_tokenizer_fingerprint="0123456789abcdef")
    )
    _expect_error(
        tmp_path,
        ckpt,
        r"does not fit target .*tokenizer fingerprint 0123456789abcdef vs [0-9a-f]{16}",
        target=str(micro_target_dir),
    )
    # the target's own fingerprint passes
    from transformers import AutoTokenizer

    from dflash2.tokenizer import tokenizer_fingerprint

    own = tokenizer_fingerprint(AutoTokenizer.from_pretrained(str(micro_target_dir)))
    good, _ = fake_ckpt(
        tmp_path, drafter_config(micro_target_dir, False, target_tokenizer_fingerprint=own), name="good"
    )
    assert (export_drafter(good, tmp_path / "exp", target=str(micro_target_dir)) / "model.safetensors").is_file()


def test_rope_theta_mismatch_and_non_neox_config(tmp_path, micro_target_dir):
    theta = read_target_info(str(micro_target_dir)).rope_theta
    ckpt, _ = fake_ckpt(tmp_path, drafter_config(micro_target_dir, False, rope_theta=theta * 100))
    # the target is recorded in the checkpoint (target_name_or_path) and exists locally: checked without target=
    _expect_error(tmp_path, ckpt, rf"rope_theta={theta * 100} but target .* uses {theta}")
    good, _ = fake_ckpt(tmp_path, drafter_config(micro_target_dir, False), name="good")
    folder = export_drafter(good, tmp_path / "exp", dtype=torch.float32)
    c = json.loads((folder / "config.json").read_text())
    c["rope_parameters"]["rope_type"] = "linear"
    (folder / "config.json").write_text(json.dumps(c))
    _expect_error(tmp_path, folder, r"rope_type='linear'.*neox-style RoPE")


def test_save_drafter_extra_files_are_atomic(tmp_path, micro_target_dir):
    d = DFlashDrafter(drafter_config(micro_target_dir, False))
    out = save_drafter(d, tmp_path / "d", extra_files={"README.md": "hi\n"})
    assert (out / "README.md").read_text() == "hi\n" and sorted(p.name for p in tmp_path.iterdir()) == ["d"]


@pytest.mark.parametrize("on", ["conv", "selector"])
def test_one_addition_off_is_filled_exactly(tmp_path, micro_target_dir, micro_target, on):
    """Engines build both DFlash2 additions: the missing one is written as an exact no-op (issue 12)."""
    from vllm_reference import VllmStyleDFlash2

    cfg = drafter_config(micro_target_dir, False, use_local_conv=on == "conv", use_selector=on == "selector")
    _, drafter = fake_ckpt(tmp_path, cfg)
    out = export_drafter(tmp_path / "run", tmp_path / "export", dtype=torch.float32, target=str(micro_target_dir))
    c = json.loads((out / "config.json").read_text())
    assert (
        c["architectures"] == ["DFlash2DraftModel"] and c["dflash2"]["use_local_conv"] and c["dflash2"]["use_selector"]
    )
    assert {"conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"} <= set(c["dflash_config"])
    (note,) = c["dflash2_export"]["filled"]
    assert note.startswith("candidate selector" if on == "conv" else "local conv")
    w = load_file(str(out / "model.safetensors"))
    if on == "conv":
        assert not w["candidate_selector.successor_codebook"].any()
        assert w["candidate_selector.predecessor_codebook"].std() > 0.01  # trainable after init_from
    else:
        assert torch.equal(w["layers.0.mlp_conv.base_kernel"][:, 0], torch.ones(2, 32))
        assert (
            not w["layers.0.mlp_conv.base_kernel"][:, 1].any()
            and not w["layers.0.attention_conv.kernel_projection.weight"].any()
        )
    card = (out / "README.md").read_text()
    assert "Filled at export" in card and "`num_speculative_tokens` must equal `block_size − 1` = 3" in card

    # the export drafts exactly as the checkpoint did: T=0, through dflash2's loader ...
    loaded = load_drafter(out)
    a = speculative_generate(micro_target, drafter, PROMPTS, max_new_tokens=16)
    b = speculative_generate(micro_target, loaded, PROMPTS, max_new_tokens=16)
    assert a.sequences == b.sequences and a.accepted == b.accepted
    # ... and through the independent vLLM-style step, block by block
    ref = VllmStyleDFlash2(out, micro_target.embed_tokens.weight, micro_target.lm_head.weight, num_speculative_tokens=3)
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt + a.sequences[PROMPTS.index(prompt)]])
            taps = micro_target.tap_features(ids)
            for pos in range(1, ids.shape[1]):
                cache = ContextCache()
                cache.append(drafter, drafter.fuse_context(taps[:, :pos]), torch.arange(pos)[None])
                blk = torch.tensor([[int(ids[0, pos])] + [cfg.mask_token_id] * 3])
                h = drafter.draft_block(micro_target.embed_tokens(blk), pos + torch.arange(4)[None], cache)
                ours = drafter.drafted_tokens(h, micro_target.lm_head, ids[:, pos])[0].tolist()
                assert ref.draft(taps[0, :pos], int(ids[0, pos]), pos)[0] == ours, (prompt, pos)
    # T > 0: the identity conv changes nothing, not even a sample; the filled selector samples its top-k
    if on == "selector":
        runs = [
            speculative_generate(
                micro_target, d, PROMPTS, max_new_tokens=16, temperature=0.8, generator=torch.Generator().manual_seed(3)
            )
            for d in (drafter, loaded)
        ]
        assert runs[0].sequences == runs[1].sequences and runs[0].accepted == runs[1].accepted
    else:
        h = torch.randn(2, 4, 32)
        _, q = loaded.drafted_tokens(h, micro_target.lm_head, torch.tensor([5, 6]), temperature=0.8)
        full = torch.softmax(micro_target.lm_head(h[:, 1:]) / 0.8, -1)
        top = full.topk(cfg.selector_top_k, dim=-1)
        expect = torch.zeros_like(full).scatter(-1, top.indices, top.values / top.values.sum(-1, keepdim=True))
        torch.testing.assert_close(q, expect)


def test_serving_scales_are_refused_in_the_v1_format(tmp_path, micro_target_dir):
    ckpt, _ = fake_ckpt(tmp_path, drafter_config(micro_target_dir, False, output_multiplier=0.5))
    _expect_error(tmp_path, ckpt, r"sets output_multiplier=0\.5, which vLLM's DFlashDraftModel loader ignores")
