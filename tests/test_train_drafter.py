"""The main job end to end on the micro target (issue 3): fast_dev_run of the real
configs, artifacts, save/load, exact resume, and bad input."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from dflash2.data.split_record import read_training_data
from dflash2.drafter import DFlashDrafter, DrafterConfig, load_drafter
from dflash2.errors import DFlash2Error
from dflash2.eval.prompts import prompt_set
from dflash2.target import TargetModel
from dflash2.training.cli import CONFIG_DIR
from dflash2.training.run import run_from_config
from dflash2.training.schedule import cosine_with_warmup
from dflash2.training.train_drafter import heldout_report_lines, measured_tau_line

pytestmark = pytest.mark.slow


def compose_run(tmp_path: Path, overrides: list[str], name: str = "run"):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(
            "train",
            overrides=[f"paths.output_dir={tmp_path / name}", f"paths.cache_dir={tmp_path / 'cache'}", *overrides],
        )
    GlobalHydra.instance().clear()
    return cfg


def train_losses(run_dir: Path) -> dict[int, float]:
    with open(run_dir / "csv" / "metrics.csv") as fh:
        rows = list(csv.DictReader(fh))
    return {int(r["step"]): float(r["train/loss"]) for r in rows if r.get("train/loss")}


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, micro_train_overrides):
    tmp = tmp_path_factory.mktemp("train")
    # Checkpoints at steps 2, 4 and 6: resuming at 2 (not half-way) is where a loader that fixes
    # its start step when built would replay batches (Lightning iterates it again mid-run).
    summary = run_from_config(
        compose_run(tmp, [*micro_train_overrides, "callbacks.model_checkpoint.every_n_train_steps=2"])
    )
    return tmp, summary


def test_default_run_writes_every_artifact(trained_run):
    tmp, summary = trained_run
    run = tmp / "run"
    assert (run / "target" / "config.json").exists()
    assert (run / "drafter" / "config.json").exists() and (run / "drafter" / "model.safetensors").exists()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "last.ckpt",
        "step000002.ckpt",
        "step000004.ckpt",
        "step000006.ckpt",
    ]
    report = summary["drafter"]
    assert report["steps"] == 6
    assert len(report["heldout_acc_per_position"]) == 7
    assert (run / "train_summary.json").exists() and (run / "run_summary.json").exists()
    losses = train_losses(run)
    assert sorted(losses) == list(range(6)) and all(torch.isfinite(torch.tensor(v)) for v in losses.values())


def test_the_summary_leads_with_tau_measured_by_lossless_decoding_of_heldout_prompts(trained_run):
    tmp, summary = trained_run
    run = tmp / "run"
    on_disk = json.loads((run / "train_summary.json").read_text())
    assert next(iter(on_disk)) == "heldout_tau_measured" and on_disk == summary["drafter"]
    measured = on_disk["heldout_tau_measured"]
    results = json.loads((run / "heldout_eval" / "results.json").read_text())
    assert measured["tau"] == results["mean_tau"] and 1.0 <= measured["tau"] <= 8.0
    assert measured["lossless"] is True and results["lossless"] is True
    assert measured["num_prompts"] == results["num_prompts"] == 2  # heldout_tau.num_prompts of the micro run
    assert measured["fewer_prompts"] == []
    assert results["settings"]["temperature"] == 0.0 and results["settings"]["max_new_tokens"] == 16
    # the prompts: the prompts API's seeded sample of the held-out split the drafter records, at the set length
    target = TargetModel.from_pretrained(str(run / "target"))
    expected = prompt_set(
        "heldout",
        target.tokenizer,
        num_prompts=2,
        prompt_tokens=16,
        seed=0,
        training_data=read_training_data(run / "drafter"),
    )
    assert results["prompt_set"]["prompts"] == expected.info["prompts"]  # document keys and offsets

    result, estimate = measured_tau_line(measured, 1.5), heldout_report_lines(on_disk)
    assert result.startswith(f"RESULT: measured tau = {measured['tau']:.3f} tokens per verify step")
    assert "of 2 held-out prompts x 16 new tokens; output == greedy: yes" in result
    assert estimate[0].startswith("  estimate, not a decode: tau ~ ")


def test_the_result_line_says_when_fewer_prompts_were_decoded_or_output_differed():
    measured = {
        "tau": 2.5,
        "lossless": False,
        "first_mismatch": {"prompt_index": 0, "token_index": 3},
        "num_prompts": 2,
        "fewer_prompts": ["3 of 8 prompts asked: the held-out split has 3 documents"],
        "max_new_tokens": 32,
        "results_dir": "RUN/heldout_eval",
    }
    line = measured_tau_line(measured, 3.0)
    assert "of 2 held-out prompts (3 of 8 prompts asked: the held-out split has 3 documents) x 32 new tokens" in line
    assert "output == greedy: NO, first mismatch {'prompt_index': 0, 'token_index': 3}" in line
    assert "\n" not in line


def test_checkpoints_hold_only_tensors_and_plain_data(trained_run):
    """What lets every load be weights-only (issue 12): no class or function is pickled in a checkpoint."""
    tmp, _ = trained_run
    for ckpt in sorted((tmp / "run" / "checkpoints").iterdir()):
        assert torch.serialization.get_unsafe_globals_in_checkpoint(str(ckpt)) == [], ckpt.name
        assert torch.load(ckpt, map_location="cpu", weights_only=True)["dflash2"]["drafter_config"]["block_size"] == 8


def test_the_learning_rate_is_one_column_on_the_schedule(trained_run):
    tmp, _ = trained_run
    with open(tmp / "run" / "csv" / "metrics.csv") as fh:
        reader = csv.DictReader(fh)
        rows = list(reader)
    assert [c for c in reader.fieldnames if c.startswith("lr")] == ["lr-AdamW"]  # not one per parameter group
    rates = {int(r["step"]): float(r["lr-AdamW"]) for r in rows if r.get("lr-AdamW")}
    assert sorted(rates) == list(range(6))  # logged every step (log_every_n_steps=1), before its update
    # the schedule of the micro run: drafter.lr 3e-3, warmup_ratio 0.04 of 6 steps (none), cosine
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=3e-3)
    schedule = cosine_with_warmup(optimizer, int(0.04 * 6), 6)
    for step in range(6):
        assert rates[step] == pytest.approx(optimizer.param_groups[0]["lr"], rel=1e-6), step  # logged as fp32
        optimizer.step()
        schedule.step()


def test_measured_tau_is_logged_at_each_validation(trained_run):
    tmp, _ = trained_run
    with open(tmp / "run" / "csv" / "metrics.csv") as fh:
        rows = list(csv.DictReader(fh))
    measured = {int(r["step"]): float(r["val/tau_measured"]) for r in rows if r.get("val/tau_measured")}
    estimated = {int(r["step"]): float(r["val/tau_estimate"]) for r in rows if r.get("val/tau_estimate")}
    assert sorted(measured) == sorted(estimated) and len(measured) == 2  # validations at steps 3 and 6
    assert all(1.0 <= t <= 8.0 for t in measured.values())  # 1 <= tau <= block size


def test_saved_drafter_reloads_with_identical_logits(trained_run):
    tmp, _ = trained_run
    loaded = load_drafter(tmp / "run" / "drafter")
    ckpt = torch.load(tmp / "run" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    fresh = DFlashDrafter(DrafterConfig.from_dict(ckpt["dflash2"]["drafter_config"]))
    fresh.load_state_dict({k.removeprefix("drafter."): v for k, v in ckpt["state_dict"].items()})
    assert loaded.config.use_local_conv and loaded.config.use_selector
    torch.manual_seed(1)
    n, length, d = 2, 20, loaded.config.hidden_size
    taps = torch.randn(n, length, loaded.config.num_taps * loaded.config.target_hidden_size)
    ids = torch.randint(0, loaded.config.vocab_size, (n, length))
    embed = torch.nn.Embedding(loaded.config.vocab_size, d)
    anchors, valid = torch.tensor([[3, 9], [5, 12]]), torch.ones(2, 2, dtype=torch.bool)
    with torch.no_grad():
        a = loaded.training_forward(taps, ids, embed, anchors, valid)
        b = fresh.training_forward(taps, ids, embed, anchors, valid)
    assert torch.equal(a, b)


def test_drafter_and_checkpoints_record_the_data_split(trained_run):
    """Evaluation reads this record to draw held-out prompts from the run's own split (issue 11)."""
    tmp, _ = trained_run
    record = load_drafter(tmp / "run" / "drafter").config.training_data
    assert record["sources"] == [{"kind": "stdlib"}] and record["seed"] == 0
    assert (record["validation_fraction"], record["heldout_fraction"], record["near_duplicate_threshold"]) == (
        0.02,
        0.02,
        0.5,
    )
    assert record["split_rule"].startswith("near-duplicate clusters")
    ckpt = torch.load(tmp / "run" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["dflash2"]["drafter_config"]["training_data"] == record


@pytest.mark.parametrize("resume_step", [2, 4])
def test_resume_from_mid_run_checkpoint_continues_the_same_loss_curve(trained_run, micro_train_overrides, resume_step):
    tmp, _ = trained_run
    original = train_losses(tmp / "run")
    mid = tmp / "run" / "checkpoints" / f"step{resume_step:06d}.ckpt"
    run_from_config(compose_run(tmp, [*micro_train_overrides, f"ckpt_path={mid}"], name=f"resumed{resume_step}"))
    resumed = train_losses(tmp / f"resumed{resume_step}")
    assert sorted(resumed) == list(range(resume_step, 6))
    for step in range(resume_step, 6):
        assert resumed[step] == pytest.approx(original[step], rel=1e-5, abs=1e-6), step


@pytest.mark.parametrize("drafter", ["dflash", "dflash2"])
def test_fast_dev_run_of_the_real_configs(tmp_path, micro_train_overrides, drafter):
    cfg = compose_run(tmp_path, [*micro_train_overrides, f"drafter={drafter}", "debug=fast_dev_run"])
    summary = run_from_config(cfg)
    loaded = load_drafter(Path(summary["output_dir"]) / "drafter")
    has_extras = any(k.startswith("candidate_selector") or "_conv" in k for k in loaded.state_dict())
    assert has_extras == (drafter == "dflash2")


@pytest.mark.parametrize(
    "override,needle",
    [
        ("drafter.hidden_size=48", "hidden size"),
        ("drafter.mask_token_id=100000", "outside the target vocab"),
        ("ckpt_path=/nonexistent/x.ckpt", "no checkpoint file"),
        ("drafter.block_size=32", "block_size=32 is larger than data.response_tokens=24"),
        ("drafter.num_anchors=24", "num_anchors=24 but .* at most 23 anchor positions"),
        ("drafter.loss_chunk_positions=-3", "loss_chunk_positions=-3 must be an integer >= 0"),
        ("drafter.loss_kernels=3", "loss_kernels=3 must be true or false"),
        ("drafter.attention=sparse", "attention='sparse' must be one of auto, flex, dense"),
        ("drafter.attention=flex", "attention=flex on the CPU: FlexAttention has no backward there"),
        (
            "data.prompt_max_tokens=1010",
            r"1010 \+ data.response_tokens=24 = 1034 exceeds the target's context of 1024 positions",
        ),
    ],
)
def test_bad_input_is_a_clear_error_and_writes_no_drafter(tmp_path, micro_train_overrides, override, needle):
    cfg = compose_run(tmp_path, [*micro_train_overrides, override])
    with pytest.raises(DFlash2Error, match=needle) as err:
        run_from_config(cfg)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "run" / "drafter").exists()


@pytest.mark.parametrize(
    "damage,needle",
    [
        ("missing", "does not exist"),
        ("no_weights", "has no weights"),
        ("truncated", "corrupted or truncated"),
    ],
)
def test_a_missing_or_damaged_target_is_a_one_line_error_and_writes_nothing(
    tmp_path, micro_train_overrides, micro_target_dir, damage, needle
):
    import shutil

    target = tmp_path / "target"
    if damage != "missing":
        shutil.copytree(micro_target_dir, target)
        weights = target / "model.safetensors"
        if damage == "no_weights":
            weights.unlink()
        else:
            weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(DFlash2Error, match=needle) as err:
        run_from_config(compose_run(tmp_path, [*micro_train_overrides, f"target.path={target}"]))
    assert "\n" not in str(err.value)
    run = tmp_path / "run"
    assert not any(
        (run / name).exists() for name in ("drafter", "checkpoints", "target", "train_summary.json", "run_summary.json")
    )


def test_a_malformed_dataset_line_names_file_and_line_and_writes_nothing(tmp_path, micro_train_overrides):
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "def f():\\n    return 1"}\n{"text": "x = 2"}\n{"text": "unterminated\n')
    source = f"data.sources=[{{kind:hf,path:{broken}}}]"
    with pytest.raises(DFlash2Error, match=r"broken.jsonl.*line 3") as err:
        run_from_config(
            compose_run(tmp_path, [*micro_train_overrides, source, f"paths.cache_dir={tmp_path / 'own_cache'}"])
        )
    assert "\n" not in str(err.value)
    assert not any((tmp_path / "run" / name).exists() for name in ("drafter", "checkpoints", "train_summary.json"))
    assert not list((tmp_path / "own_cache").glob("data/*"))  # no dataset (or partial one) cached


def test_data_without_any_anchor_is_empty_after_filtering(tmp_path, micro_train_overrides, monkeypatch):
    """A target that ends every response at once (EOS first) leaves no block to train on."""
    import dflash2.data.regenerate as regenerate_mod

    def eos_at_once(target, prompt_ids, *, max_new_tokens, eos_token_id, pad_token_id, **kwargs):
        out = torch.full((prompt_ids.shape[0], max_new_tokens), pad_token_id, dtype=torch.long)
        out[:, 0] = eos_token_id
        return out

    monkeypatch.setattr(regenerate_mod, "generate_responses", eos_at_once)
    own_cache = f"paths.cache_dir={tmp_path / 'own_cache'}"  # this fake data must not reach the session's shared cache
    with pytest.raises(DFlash2Error, match=r"the train data is empty after filtering.*data\.response_tokens") as err:
        run_from_config(compose_run(tmp_path, [*micro_train_overrides, own_cache]))
    assert "\n" not in str(err.value)
    assert not (tmp_path / "run" / "drafter").exists()


def test_nan_loss_stops_with_a_message_and_keeps_the_last_good_checkpoint(tmp_path, micro_train_overrides, monkeypatch):
    from dflash2.training.drafter_module import DrafterTrainingModule

    real = DrafterTrainingModule.block_outputs

    def poisoned(self, batch, generator, **kw):
        out = real(self, batch, generator, **kw)
        if self.training and self.global_step >= 4:
            out["loss"] = out["loss"] * float("nan")
        return out

    monkeypatch.setattr(DrafterTrainingModule, "block_outputs", poisoned)
    with pytest.raises(DFlash2Error, match=r"step 4.*last good checkpoint"):
        run_from_config(compose_run(tmp_path, micro_train_overrides))
    kept = tmp_path / "run" / "checkpoints" / "step000003.ckpt"
    state = torch.load(kept, map_location="cpu", weights_only=True)
    assert state["global_step"] == 3
    assert all(torch.isfinite(v).all() for v in state["state_dict"].values())
    assert not (tmp_path / "run" / "drafter").exists()


@pytest.mark.parametrize(
    "field,value,needle",
    [
        ("vocab_size", 999, "vocab 999"),
        ("target_layer_ids", [0, 1, 7], "taps"),
        ("target_tokenizer_fingerprint", "0123456789abcdef", "tokenizer fingerprint 0123456789abcdef vs target"),
    ],
)
def test_init_from_a_drafter_of_another_target_is_refused(
    trained_run, micro_train_overrides, tmp_path, field, value, needle
):
    from dflash2.drafter import save_drafter

    tmp, _ = trained_run
    config = load_drafter(tmp / "run" / "drafter").config.to_dict()
    config[field] = value
    foreign = tmp_path / "foreign"
    save_drafter(DFlashDrafter(DrafterConfig.from_dict(config)), foreign)
    with pytest.raises(DFlash2Error, match=needle):
        run_from_config(compose_run(tmp_path, [*micro_train_overrides, f"drafter.init_from={foreign}"]))
    assert not (tmp_path / "run" / "drafter").exists()


def test_a_damaged_init_from_folder_is_refused_before_the_target_is_used(trained_run, micro_train_overrides, tmp_path):
    import shutil

    tmp, _ = trained_run
    damaged = shutil.copytree(tmp / "run" / "drafter", tmp_path / "damaged")
    (damaged / "model.safetensors").write_bytes((damaged / "model.safetensors").read_bytes()[:8])
    with pytest.raises(DFlash2Error, match=r"damaged/model\.safetensors is corrupted or truncated") as err:
        run_from_config(compose_run(tmp_path, [*micro_train_overrides, f"drafter.init_from={damaged}"]))
    assert "\n" not in str(err.value)
    assert not any((tmp_path / "run" / name).exists() for name in ("target", "drafter", "checkpoints"))


def _truncated_copy(src: Path, dest: Path) -> Path:
    data = src.read_bytes()
    dest.write_bytes(data[: len(data) // 2])  # what a crash during a non-atomic copy leaves
    return dest


@pytest.mark.parametrize(
    "make,needle",
    [
        (
            lambda run, tmp: _truncated_copy(run / "checkpoints" / "last.ckpt", tmp / "half.ckpt"),
            "truncated or not a checkpoint",
        ),
        (
            lambda run, tmp: (tmp / "notes.ckpt").write_text("not a checkpoint") and tmp / "notes.ckpt",
            "truncated or not a checkpoint",
        ),
        (
            lambda run, tmp: torch.save({"weights": torch.zeros(2)}, tmp / "other.ckpt") or tmp / "other.ckpt",
            "not a dflash2 drafter training checkpoint",
        ),
    ],
)
def test_a_broken_or_foreign_ckpt_path_is_refused_before_any_work(
    trained_run, micro_train_overrides, tmp_path, monkeypatch, make, needle
):
    import dflash2.training.train_drafter as train_drafter_mod

    tmp, _ = trained_run
    ckpt = make(tmp / "run", tmp_path)

    def no_regeneration(*args, **kwargs):
        raise AssertionError("the checkpoint should be refused before any data work")

    monkeypatch.setattr(train_drafter_mod, "regenerate_split", no_regeneration)
    with pytest.raises(DFlash2Error, match=needle) as err:
        run_from_config(compose_run(tmp_path, [*micro_train_overrides, f"ckpt_path={ckpt}"]))
    assert "\n" not in str(err.value) and str(ckpt) in str(err.value)
    assert not (tmp_path / "run" / "drafter").exists() and not (tmp_path / "run" / "checkpoints").exists()


def test_train_py_refuses_a_crafted_ckpt_path_without_running_it(trained_run, micro_train_overrides, tmp_path):
    """`python train.py ... ckpt_path=FILE` with a pickle that runs code (issue 12): one line, exit 2, the code
    never runs, and the file is refused before the target is copied into the run."""
    import subprocess
    import sys

    from conftest import REPO, crafted_checkpoint, subprocess_env

    tmp, _ = trained_run
    marker = tmp_path / "pwned"
    base = torch.load(tmp / "run" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    crafted = crafted_checkpoint(tmp_path / "shared.ckpt", marker, base, how="shell")
    run = tmp_path / "run"
    args = [*micro_train_overrides, f"paths.output_dir={run}", f"ckpt_path={crafted}", f"hydra.run.dir={run}"]
    out = subprocess.run(
        [sys.executable, "train.py", *args], cwd=REPO, env=subprocess_env(), capture_output=True, text=True
    )
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: ckpt_path refused: {crafted} was not loaded: ")
    assert "posix.system" in lines[0] and "could run code" in lines[0]
    assert not marker.exists()
    left = {p.name for p in run.iterdir()}
    assert not left & {"target", "checkpoints", "drafter", "run_summary.json", "train_summary.json"}, left


def test_resuming_with_another_drafter_config_names_the_field(trained_run, micro_train_overrides, tmp_path):
    tmp, _ = trained_run
    ckpt = tmp / "run" / "checkpoints" / "last.ckpt"
    with pytest.raises(DFlash2Error, match=r"another drafter config .*num_hidden_layers: checkpoint 1 vs now 2") as err:
        run_from_config(
            compose_run(tmp_path, [*micro_train_overrides, "drafter.num_hidden_layers=2", f"ckpt_path={ckpt}"])
        )
    assert "\n" not in str(err.value)
    assert not (tmp_path / "run" / "drafter").exists()


def _raise_oom(*args, **kwargs):
    # What a CUDA allocation failure raises (torch.cuda.OutOfMemoryError is the same class); CPU runs can raise it too.
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (GPU 0; 79.11 GiB total capacity)")


@pytest.mark.parametrize(
    "where,needle",
    [
        (
            "training_step",
            r"out of GPU memory during drafter training; lower one of data.batch_size=4, drafter.num_anchors=6, "
            r"data.response_tokens=24.*bf16-mixed.*accumulate_grad_batches.*ckpt_path=last",
        ),
        (
            "regenerate_split",
            r"out of GPU memory during regeneration of training data by the target; lower one of "
            r"data.generation_batch_size=8",
        ),
    ],
)
def test_gpu_out_of_memory_names_the_knobs_and_writes_no_drafter(
    micro_train_overrides, tmp_path, monkeypatch, where, needle
):
    import dflash2.training.train_drafter as train_drafter_mod
    from dflash2.training.drafter_module import DrafterTrainingModule

    if where == "training_step":
        monkeypatch.setattr(DrafterTrainingModule, "training_step", _raise_oom)
    else:
        monkeypatch.setattr(train_drafter_mod, "regenerate_split", _raise_oom)
    with pytest.raises(DFlash2Error, match=needle) as err:
        run_from_config(compose_run(tmp_path, micro_train_overrides))
    assert "\n" not in str(err.value) and isinstance(err.value.__cause__, torch.OutOfMemoryError)
    assert not (tmp_path / "run" / "drafter").exists()


def test_trained_run_exports_and_reloads_with_identical_drafts_and_tau(trained_run, micro_target_dir, tmp_path):
    """Issue 5 round trip on a real (micro) training run: train -> export -> load -> same drafts, same τ."""
    from dflash2.decoding import speculative_generate
    from dflash2.export import export_drafter
    from dflash2.target import TargetModel

    tmp, _ = trained_run
    run = tmp / "run"
    out = export_drafter(
        run / "checkpoints" / "last.ckpt", tmp_path / "export", dtype=torch.float32, target=str(micro_target_dir)
    )
    exported = load_drafter(out)
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    original = DFlashDrafter(DrafterConfig.from_dict(ckpt["dflash2"]["drafter_config"]))
    original.load_state_dict({k.removeprefix("drafter."): v for k, v in ckpt["state_dict"].items()})
    target = TargetModel.from_pretrained(str(micro_target_dir), target_layer_ids=[0, 1, 2])
    prompts = [target.tokenizer(t)["input_ids"] for t in ("import os\n", "def main(args):\n    ", "class A:\n")]
    a = speculative_generate(target, original.eval(), prompts, max_new_tokens=24)
    b = speculative_generate(target, exported.eval(), prompts, max_new_tokens=24)
    assert (
        a.sequences == b.sequences
        and a.accepted_drafts == b.accepted_drafts
        and a.emitted == b.emitted
        and a.mean_tau == b.mean_tau
    )
    assert (out / "README.md").exists() and "DFlash2DraftModel" in (out / "config.json").read_text()


def test_every_variant_trains_from_the_same_backbone_at_one_seed(tmp_path, micro_train_overrides, monkeypatch):
    """The Lightning path (train.py's seeding and build): the weights a run starts from are, on the backbone,
    bitwise the same for v1 and every DFlash2 variant, and they follow the seed (issue 11, fair ablation)."""
    from dflash2.drafter.initialisation import is_backbone_parameter
    from dflash2.training.drafter_module import DrafterTrainingModule

    initial = {}
    real_on_fit_start = DrafterTrainingModule.on_fit_start

    def record_initial_weights(module):
        initial[current] = {k: v.clone() for k, v in module.drafter.state_dict().items()}
        real_on_fit_start(module)

    monkeypatch.setattr(DrafterTrainingModule, "on_fit_start", record_initial_weights)
    runs = [("dflash", 0), ("dflash2_conv_only", 0), ("dflash2_selector_only", 0), ("dflash2", 0), ("dflash", 1)]
    for current in runs:
        drafter, seed = current
        overrides = [*micro_train_overrides, f"drafter={drafter}", f"seed={seed}", "debug=fast_dev_run"]
        run_from_config(compose_run(tmp_path, overrides, name=f"{drafter}-{seed}"))
    v1 = initial[("dflash", 0)]
    assert all(is_backbone_parameter(k) for k in v1)
    for run in runs[1:4]:
        assert {k for k in initial[run] if is_backbone_parameter(k)} == set(v1), run
        assert [k for k in v1 if not torch.equal(v1[k], initial[run][k])] == [], run
    assert not torch.equal(v1["fc.weight"], initial[("dflash", 1)]["fc.weight"])  # another seed, other weights
