"""`target.dtype` is honoured everywhere (issue 12 item 1, dflash2/target_dtype.py, ARCHITECTURE.md §2.1).

auto = bf16 on a GPU, fp32 on the CPU; the chosen dtype loads the target, keys the
regenerated data, computes the training taps (outside the drafter's autocast) and
the measured τ, and eval decodes in it. The drafter keeps fp32 master weights. End
to end on CPU: a bf16 micro target trains a drafter (train.py), which exports and
then evaluates losslessly against bf16 greedy decoding of the same target.
"""

from __future__ import annotations

import csv
import json
import logging
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from dflash2.data.regenerate import regeneration_cache_key
from dflash2.drafter import DFlashDrafter, DrafterConfig, load_drafter
from dflash2.drafter.from_target import drafter_config_for_target
from dflash2.errors import DFlash2Error
from dflash2.export import export_drafter
from dflash2.target import TargetModel
from dflash2.target_dtype import resolve_target_dtype
from dflash2.training.cli import CONFIG_DIR
from dflash2.training.drafter_module import DrafterTrainingModule
from dflash2.training.run import run_from_config

TAPS = [0, 1, 2]
ONE_STEP = ["trainer.max_steps=1", "trainer.val_check_interval=1", "callbacks.model_checkpoint.every_n_train_steps=1"]
DATA = {
    "sources": [{"kind": "stdlib"}],
    "validation_fraction": 0.1,
    "heldout_fraction": 0.1,
    "prompt_min_tokens": 8,
    "prompt_max_tokens": 16,
    "response_tokens": 24,
    "sampling": "greedy",
    "temperature": 1.0,
}
SETTINGS = {
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "block_size": 4,
    "use_local_conv": True,
    "conv_kernel_size": 2,
    "conv_group_size": 16,
    "use_selector": True,
    "selector_rank": 16,
    "selector_top_k": 4,
}


# ------------------------------------------------------------------ resolution and loading
@pytest.mark.parametrize(
    "value, device, expected",
    [
        ("auto", "cpu", torch.float32),
        ("auto", None, torch.float32),
        ("auto", "cuda", torch.bfloat16),
        (None, torch.device("cuda", 0), torch.bfloat16),
        ("bfloat16", "cpu", torch.bfloat16),
        ("bf16", "cuda", torch.bfloat16),
        ("float32", "cuda", torch.float32),
        ("fp16", "cpu", torch.float16),
        (torch.bfloat16, "cpu", torch.bfloat16),
    ],
)
def test_auto_is_bf16_on_a_gpu_and_fp32_on_the_cpu(value, device, expected):
    assert resolve_target_dtype(value, device) == expected


@pytest.mark.parametrize("value", ["float8", "int8", torch.int64])
def test_an_unknown_dtype_is_one_line(value):
    with pytest.raises(DFlash2Error, match="dtype") as err:
        resolve_target_dtype(value, "cpu")
    assert "\n" not in str(err.value)


@pytest.fixture(scope="module")
def targets(micro_target_dir):
    """The micro target loaded twice from the same folder: auto on the CPU (fp32) and bf16."""
    return {
        "auto": TargetModel.from_pretrained(str(micro_target_dir), target_layer_ids=TAPS),
        "bf16": TargetModel.from_pretrained(str(micro_target_dir), target_layer_ids=TAPS, dtype="bfloat16"),
    }


def test_the_loaded_target_runs_in_the_resolved_dtype(targets):
    assert targets["auto"].dtype == torch.float32 and targets["bf16"].dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in targets["bf16"].model.parameters())
    out = targets["bf16"](torch.tensor([[5, 6, 7]]))
    assert out.taps.dtype == out.logits.dtype == torch.bfloat16


def test_the_regeneration_cache_key_includes_the_dtype(targets, micro_target_dir):
    def key(target):
        folder = str(micro_target_dir)
        return regeneration_cache_key(target, DATA, split="train", num_prompts=8, seed=0, target_id=folder)

    assert key(targets["auto"]) != key(targets["bf16"])
    assert key(targets["bf16"]) == key(targets["bf16"])  # and nothing else changed it


def test_the_drafter_casts_taps_to_its_own_dtype():
    cfg = DrafterConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        rope_theta=1e4,
        max_position_embeddings=64,
        vocab_size=64,
        target_hidden_size=32,
        target_layer_ids=[0, 1],
        mask_token_id=2,
    )
    drafter = DFlashDrafter(cfg)
    taps = torch.randn(2, 5, 64).to(torch.bfloat16)
    c = drafter.fuse_context(taps)
    assert c.dtype == torch.float32
    torch.testing.assert_close(c, drafter.fuse_context(taps.float()))


@pytest.mark.parametrize("chunk", [0, 5], ids=["plain-loss", "chunked-loss"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32-trainer", "bf16-mixed"])
def test_training_taps_come_from_the_target_in_its_dtype_outside_autocast(targets, autocast, chunk):
    """A bf16 target beside an fp32 drafter: taps computed by the target in bf16 and never under the
    drafter's autocast; the step backpropagates into fp32 master weights (fp32 trainer or bf16-mixed),
    through the plain or the chunked loss (drafter.loss_chunk_positions)."""
    target = targets["bf16"]
    torch.manual_seed(0)
    drafter = DFlashDrafter(drafter_config_for_target(SETTINGS, target))
    module = DrafterTrainingModule(
        drafter,
        target,
        num_anchors=4,
        loss_gamma=4.0,
        selector_loss_weight=1.0,
        lr=1e-3,
        weight_decay=0.0,
        warmup_ratio=0.0,
        total_steps=1,
        seed=0,
        loss_chunk_positions=chunk,
    )
    seen = []
    real = target.tap_features

    def spy(ids, *args, **kwargs):
        taps = real(ids, *args, **kwargs)
        seen.append((torch.is_autocast_enabled("cpu"), taps.dtype))
        return taps

    target.tap_features = spy
    try:
        ids = torch.randint(3, target.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
        batch = {"input_ids": ids, "loss_mask": torch.cat([torch.zeros(2, 8), torch.ones(2, 16)], 1).long()}
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = module.block_outputs(batch, torch.Generator().manual_seed(0))
        out["loss"].backward()
    finally:
        del target.tap_features
    assert seen == [(False, torch.bfloat16)]
    assert torch.isfinite(out["loss"])
    assert all(p.dtype == torch.float32 for p in drafter.parameters())
    assert drafter.fc.weight.grad is not None and drafter.fc.weight.grad.dtype == torch.float32


# ------------------------------------------------------------------ end to end on CPU
def compose_run(tmp: Path, overrides: list[str], name: str):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("train", overrides=[f"paths.output_dir={tmp / name}", *overrides])
    GlobalHydra.instance().clear()
    return cfg


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory, micro_train_overrides):
    tmp = tmp_path_factory.mktemp("bf16")
    cfg = compose_run(tmp, [*micro_train_overrides, "target.dtype=bfloat16"], "run")
    summary = run_from_config(cfg)
    return tmp, Path(summary["output_dir"]), OmegaConf.to_container(cfg, resolve=True)


def _ckpt_drafter_dtypes(ckpt: Path) -> set[torch.dtype]:
    state = torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]
    return {v.dtype for k, v in state.items() if k.startswith("drafter.") and v.is_floating_point()}


@pytest.mark.slow
def test_a_bf16_target_trains_a_drafter_with_fp32_master_weights(bf16_run):
    _, run, cfg = bf16_run
    assert (run / "drafter" / "model.safetensors").is_file()
    assert _ckpt_drafter_dtypes(run / "checkpoints" / "last.ckpt") == {torch.float32}
    with open(run / "csv" / "metrics.csv") as fh:
        rows = list(csv.DictReader(fh))
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    measured = [float(r["val/tau_measured"]) for r in rows if r.get("val/tau_measured")]
    assert len(losses) == 6 and all(torch.isfinite(torch.tensor(losses)))
    assert len(measured) == 2 and all(1.0 <= t <= 8.0 for t in measured)  # the τ callback decoded in bf16
    # the training data was regenerated by the bf16 target, under the bf16 key
    bf16_target = TargetModel.from_pretrained(str(run / "target"), target_layer_ids=TAPS, dtype="bfloat16")
    data_key = regeneration_cache_key(
        bf16_target, cfg["data"], split="train", num_prompts=24, seed=0, target_id=str(run / "target")
    )
    assert (Path(cfg["paths"]["cache_dir"]) / "data" / f"train-{data_key}" / "dataset_info.json").is_file()


@pytest.mark.slow
def test_the_bf16_drafter_exports_and_evaluates_losslessly_against_bf16_greedy(
    bf16_run, micro_target_dir, monkeypatch, caplog
):
    from dflash2.eval import acceptance_cli

    caplog.set_level(logging.INFO, logger="dflash2")  # the CLI's console lines are log records

    tmp, run, _ = bf16_run
    exported = export_drafter(run / "checkpoints" / "last.ckpt", tmp / "export", target=str(micro_target_dir))
    assert load_drafter(exported).fc.weight.dtype == torch.bfloat16  # export dtype auto = bf16
    out = tmp / "eval"
    GlobalHydra.instance().clear()
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "eval.acceptance",
            f"target={micro_target_dir}",
            f"drafter={exported}",
            "dtype=bfloat16",
            "num_prompts=6",
            "prompt_tokens=16",
            "max_new_tokens=40",
            f"paths.output_dir={out}",
            "hydra/job_logging=none",
            "hydra/hydra_logging=none",
        ],
    )
    acceptance_cli.main()
    res = json.loads((out / "results.json").read_text())
    assert res["settings"]["dtype"] == "bfloat16" and res["num_prompts"] == 6
    assert res["lossless"] is True and res["first_mismatch"] is None, res["first_mismatch"]
    assert any(m.startswith("mean tau ") and "lossless true" in m for m in caplog.messages)


class ScriptedDrafts:
    """A Proposer that drafts a known continuation, right for a seeded random number of positions per step
    (all of them for ``always_right``): the 6-step micro drafter above accepts nothing (τ = 1), so this is
    what exercises accepted drafts, the cache rollback and the GDN replay in bf16."""

    def __init__(self, full: list[list[int]], block_size: int, vocab: int, always_right: bool, seed: int = 0):
        self.full, self.block_size, self.vocab, self.always_right = full, block_size, vocab, always_right
        self.rng = torch.Generator().manual_seed(seed)

    def add_context(self, taps, positions, num_valid):
        pass

    def propose(self, anchor_ids, anchor_pos, params, generator):
        rows = []
        for n, pos in enumerate(anchor_pos.tolist()):
            truth = self.full[n][pos + 1 : pos + self.block_size]
            right = int(torch.randint(self.block_size, (1,), generator=self.rng))
            right = self.block_size if self.always_right else right
            rows.append([t if i < right else (t + 1) % self.vocab for i, t in enumerate(truth)])
        return torch.tensor(rows), None


@pytest.mark.slow
@pytest.mark.parametrize("always_right", [True, False], ids=["all-accepted", "partly-accepted"])
def test_bf16_speculative_decoding_with_accepted_drafts_equals_bf16_greedy(targets, always_right):
    from dflash2.decoding import greedy_generate, speculative_generate
    from dflash2.eval.prompts import load_prompts

    target, B, n = targets["bf16"], 8, 40
    prompts = [p.ids for p in load_prompts("heldout", target.tokenizer, num_prompts=4, prompt_tokens=16)]
    greedy = greedy_generate(target, prompts, n + B)
    proposer = ScriptedDrafts([p + g for p, g in zip(prompts, greedy)], B, target.vocab_size, always_right)
    res = speculative_generate(target, proposer, prompts, max_new_tokens=n)
    assert res.sequences == [g[:n] for g in greedy]
    accepted = [a for row in res.accepted_drafts for a in row]
    assert max(accepted) == B - 1 and (always_right or min(accepted) == 0)


@pytest.mark.slow
def test_init_from_a_bf16_export_keeps_fp32_master_weights(bf16_run, micro_train_overrides):
    tmp, run, _ = bf16_run
    exported = export_drafter(run / "drafter", tmp / "export_init", dtype=torch.bfloat16)
    cfg = compose_run(
        tmp,
        [*micro_train_overrides, "target.dtype=bfloat16", f"drafter.init_from={exported}", *ONE_STEP],
        "init",
    )
    summary = run_from_config(cfg)
    assert _ckpt_drafter_dtypes(Path(summary["output_dir"]) / "checkpoints" / "last.ckpt") == {torch.float32}
