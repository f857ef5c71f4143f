"""Export folder (ARCHITECTURE.md §7): round trip, config.json fields, strict keys, atomic write."""

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash2.drafter import DFlashDrafter, DrafterConfig, load_drafter, save_drafter
from dflash2.errors import DFlash2Error

V, D, B = 96, 32, 4
V2_ONLY = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def tiny(**kw):
    base = dict(
        hidden_size=D,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        rope_theta=10000.0,
        max_position_embeddings=256,
        vocab_size=V,
        target_hidden_size=16,
        target_layer_ids=[1, 3],
        mask_token_id=V - 1,
        block_size=B,
        conv_group_size=8,
        selector_rank=8,
        selector_top_k=5,
        num_target_layers=6,
    )
    base.update(kw)
    return DrafterConfig(**base)


def trained_like(cfg):
    torch.manual_seed(0)
    m = DFlashDrafter(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return m.eval()


def outputs(m):
    g = torch.Generator().manual_seed(0)
    emb = torch.nn.Embedding(V, D)
    lm_head = torch.nn.Linear(D, V, bias=False)
    torch.nn.init.normal_(emb.weight, generator=g)
    torch.nn.init.normal_(lm_head.weight, generator=g)
    taps, ids = torch.randn(1, 12, 32, generator=g), torch.randint(0, V - 1, (1, 12), generator=g)
    with torch.no_grad():
        h = m.training_forward(taps, ids, emb, torch.tensor([[3, 8]]), torch.tensor([[True, True]]))
        toks = m.drafted_tokens(h[:, 0], lm_head, ids[:, 3])
    return h, toks


@pytest.mark.parametrize("v2", [False, True])
def test_round_trip_and_config_fields(tmp_path, v2):
    cfg = tiny(use_local_conv=v2, use_selector=v2)
    m = trained_like(cfg)
    out = save_drafter(m, tmp_path / "drafter", extra_config={"note": "x"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter"]  # no temp dir left behind
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    c = json.loads((out / "config.json").read_text())
    assert c["architectures"] == (["DFlash2DraftModel"] if v2 else ["DFlashDraftModel"])
    assert c["model_type"] == "qwen3" and c["attention_bias"] is False and c["hidden_act"] == "silu"
    assert c["layer_types"] == ["full_attention"] * 2 and c["block_size"] == B
    assert c["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert c["num_target_layers"] == 6 and c["tie_word_embeddings"] is False and c["note"] == "x"
    dc = c["dflash_config"]
    assert dc["mask_token_id"] == V - 1 and dc["target_layer_ids"] == [1, 3]
    assert ("selector_top_k" in dc) == v2 and ("conv_kernel_size" in dc) == v2
    assert DrafterConfig.from_dict(c["dflash2"]) == cfg
    assert set(load_file(str(out / "model.safetensors"))) == set(m.state_dict())

    loaded = load_drafter(out)
    assert loaded.config == cfg and not loaded.training
    (h0, t0), (h1, t1) = outputs(m), outputs(loaded)
    assert torch.equal(h0, h1) and torch.equal(t0, t1)

    # a z-lab style folder (no dflash2 section) rebuilds the same config from its fields
    del c["dflash2"]
    (out / "config.json").write_text(json.dumps(c))
    zlab = load_drafter(out)
    expected = cfg
    if not v2:  # a v1 export carries no conv/selector settings: they come back as defaults
        defaults = {f.name: f.default for f in dataclasses.fields(DrafterConfig)}
        expected = dataclasses.replace(cfg, **{k: defaults[k] for k in V2_ONLY})
    assert zlab.config == expected
    assert torch.equal(outputs(zlab)[0], h0)


def test_bf16_export_and_overwrite(tmp_path):
    m = trained_like(tiny())
    out = tmp_path / "d"
    save_drafter(m, out)
    save_drafter(m, out, dtype=torch.bfloat16)  # replaces the existing export
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = load_drafter(out)
    assert loaded.fc.weight.dtype == torch.bfloat16
    assert load_drafter(out, dtype=torch.float32).fc.weight.dtype == torch.float32


def test_renamed_key_and_missing_folder_raise(tmp_path):
    out = save_drafter(trained_like(tiny()), tmp_path / "d")
    w = load_file(str(out / "model.safetensors"))
    w["layers.0.self_attn.qproj.weight"] = w.pop("layers.0.self_attn.q_proj.weight")
    save_file(w, str(out / "model.safetensors"))
    with pytest.raises(DFlash2Error, match=r"layers\.0\.self_attn\.q_proj\.weight.*qproj"):
        load_drafter(out)
    with pytest.raises(DFlash2Error, match="not found"):
        load_drafter(tmp_path / "nope")
    (out / "model.safetensors").unlink()
    with pytest.raises(DFlash2Error, match=r"model\.safetensors"):
        load_drafter(out)


def test_failed_save_keeps_previous_export(tmp_path, monkeypatch):
    import dflash2.drafter.io as io

    m = trained_like(tiny())
    out = save_drafter(m, tmp_path / "d")
    before = (out / "model.safetensors").read_bytes()

    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(io, "save_file", boom)
    with pytest.raises(RuntimeError):
        save_drafter(m, out, dtype=torch.bfloat16)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]
    assert (out / "model.safetensors").read_bytes() == before
