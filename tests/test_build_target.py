"""The embedded target recipe end to end, at micro size (issue 2): build, cache, reuse, determinism;
and a build SIGKILLed mid-pretraining resumes to the same weights (issue 6)."""

from __future__ import annotations

import json
import logging
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import MICRO_TARGET_OVERRIDES as MICRO
from conftest import subprocess_env
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from dflash2.training.build_target import build_work_dir, target_cache_key
from dflash2.training.cli import CONFIG_DIR
from dflash2.training.run import run_from_config

pytestmark = pytest.mark.slow


REPO = Path(__file__).resolve().parents[1]


def compose_cfg(overrides):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    GlobalHydra.instance().clear()
    return cfg


def build_overrides(tmp_path, name, cache, *extra):
    return [*MICRO, *extra, f"paths.output_dir={tmp_path / name}", f"paths.cache_dir={cache}"]


def build(tmp_path, name, cache, *extra):
    return run_from_config(compose_cfg(build_overrides(tmp_path, name, cache, *extra)))


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


def test_the_run_seed_does_not_rebuild_the_target_but_the_target_seed_does(built, monkeypatch):
    """`-m seed=0,1,2` sweeps drafters over one cached target; `target.seed` picks another target."""
    import dflash2.training.build_target as bt

    tmp, _ = built
    key = target_cache_key(compose_cfg(build_overrides(tmp, "k", tmp / "cache_a")))
    assert target_cache_key(compose_cfg(build_overrides(tmp, "k", tmp / "cache_a", "seed=7"))) == key
    assert target_cache_key(compose_cfg(build_overrides(tmp, "k", tmp / "cache_a", "target.seed=7"))) != key

    def must_not_build(*args, **kwargs):
        raise AssertionError("another run seed rebuilt the target")

    monkeypatch.setattr(bt, "build_embedded_target", must_not_build)
    build(tmp, "seed7", tmp / "cache_a", "seed=7")
    assert (tmp / "seed7" / "target" / "model.safetensors").exists()


def test_rebuild_from_the_seed_is_identical(built):
    from safetensors.torch import load_file

    tmp, _ = built
    build(tmp, "c", tmp / "cache_c")  # a fresh cache: built again from scratch
    a = load_file(tmp / "a" / "target" / "model.safetensors")
    c = load_file(tmp / "c" / "target" / "model.safetensors")
    assert a.keys() == c.keys() and all(torch.equal(a[k], c[k]) for k in a)
    assert (tmp / "a" / "target" / "tokenizer.json").read_text() == (
        tmp / "c" / "target" / "tokenizer.json"
    ).read_text()


# ----------------------------------------------------------------- SIGKILL mid-build, then resume

# `python train.py` with the target's training step wrapped to SIGKILL the process when it
# reaches a given step: a kill at a known point, between two checkpoints, with nothing else changed.
KILLING_CHILD = """
import os, signal, sys
from dflash2.training.target_pretrain import CausalLMPretrainModule

kill_at, train_step = int(sys.argv[1]), CausalLMPretrainModule.training_step

def training_step(self, batch, batch_idx):
    if self.global_step == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
    return train_step(self, batch, batch_idx)

CausalLMPretrainModule.training_step = training_step
from dflash2.training.cli import main

sys.argv = ["train.py", *sys.argv[2:]]
main()
"""
KILL_AT = 5  # the step-4 checkpoint is written, step 4 is trained and lost, the step-6 checkpoint never comes
EIGHT_STEPS = [o for o in MICRO if not o.startswith("target.recipe.max_steps=")] + ["target.recipe.max_steps=8"]
EVERY = ["target.recipe.checkpoint_every_steps=2"]


def build8(tmp_path, name, cache, *extra):
    return run_from_config(
        compose_cfg([*EIGHT_STEPS, *extra, f"paths.output_dir={tmp_path / name}", f"paths.cache_dir={cache}"])
    )


@pytest.fixture(scope="module")
def reference8(tmp_path_factory):
    """The 8-step build done without interruption (and without checkpoints: the default interval 50 > 8)."""
    tmp = tmp_path_factory.mktemp("reference8")
    build8(tmp, "reference", tmp / "cache")
    return tmp / "reference" / "target", tmp / "cache"


def assert_same_target(reference: Path, built: Path):
    from safetensors.torch import load_file

    a, b = load_file(reference / "model.safetensors"), load_file(built / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # bitwise
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (reference / name).read_text() == (built / name).read_text(), name
    info_a, info_b = (json.loads((folder / "build_info.json").read_text()) for folder in (reference, built))
    assert info_a["heldout_cross_entropy"] == info_b["heldout_cross_entropy"]


def test_sigkilled_build_resumes_to_the_weights_of_an_uninterrupted_build(tmp_path, request, caplog):
    cache = tmp_path / "cache"
    overrides = [*EIGHT_STEPS, *EVERY, f"paths.output_dir={tmp_path / 'killed'}", f"paths.cache_dir={cache}"]
    final = cache / "targets" / f"tiny-{target_cache_key(compose_cfg(overrides))}"
    work = build_work_dir(final)
    env = subprocess_env()
    log = tmp_path / "killed.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", KILLING_CHILD, str(KILL_AT), *overrides, f"hydra.run.dir={tmp_path / 'hydra'}"],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        reference, reference_cache = request.getfixturevalue("reference8")  # built meanwhile, unless already there
        proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL, log.read_text()[-3000:]
    assert "[dflash2] building target 'tiny'" in log.read_text()  # train.py's console shows our lines ...
    assert "[dflash2] resuming" not in log.read_text()  # ... and this one is not among them: a fresh build
    assert not final.exists()
    assert sorted(p.name for p in work.iterdir()) == ["last.ckpt", "tokenizer.json"]  # no temp file left
    assert torch.load(work / "last.ckpt", map_location="cpu", weights_only=True)["global_step"] == 4

    # The same build again (in-process): it resumes from step 4 and publishes the target.
    caplog.set_level(logging.INFO, logger="dflash2")
    build8(tmp_path, "resumed", cache, *EVERY)
    assert f"resuming target build from step 4 ({work / 'last.ckpt'})" in caplog.messages
    assert final.is_dir() and not work.exists()

    # Bitwise the weights and tokenizer of the uninterrupted build (the checkpoint interval is not in the key).
    assert (reference_cache / "targets" / final.name).is_dir()
    assert_same_target(reference, tmp_path / "resumed" / "target")


def test_build_resumed_early_in_its_epoch_sees_the_remaining_batches_in_order(
    tmp_path, reference8, monkeypatch, caplog
):
    """Resumed at step 2 of 8, more batches remain (6) than were done (2): Lightning then ends the resumed
    "epoch" after 4 batches and iterates the loader again, which must continue at step 6, not repeat
    steps 2-3. Here the first attempt dies by an exception (in-process) instead of SIGKILL."""
    from dflash2.training.target_pretrain import CausalLMPretrainModule

    reference, _ = reference8
    train_step = CausalLMPretrainModule.training_step

    def dies_at_step_3(self, batch, batch_idx):
        if self.global_step == 3:
            raise RuntimeError("died at step 3")
        return train_step(self, batch, batch_idx)

    monkeypatch.setattr(CausalLMPretrainModule, "training_step", dies_at_step_3)
    with pytest.raises(RuntimeError, match="died at step 3"):
        build8(tmp_path, "died", tmp_path / "cache", *EVERY)
    monkeypatch.setattr(CausalLMPretrainModule, "training_step", train_step)
    [final] = reference8[1].joinpath("targets").glob("tiny-*")  # the same key: the interval is not part of it
    work = build_work_dir(tmp_path / "cache" / "targets" / final.name)
    assert (
        not (tmp_path / "cache" / "targets" / final.name).exists()
        and torch.load(work / "last.ckpt", map_location="cpu", weights_only=True)["global_step"] == 2
    )

    caplog.set_level(logging.INFO, logger="dflash2")
    build8(tmp_path, "resumed", tmp_path / "cache", *EVERY)
    assert f"resuming target build from step 2 ({work / 'last.ckpt'})" in caplog.messages
    assert not work.exists()
    assert_same_target(reference, tmp_path / "resumed" / "target")


def test_a_second_build_of_the_same_target_waits_for_the_first_and_reuses_it(tmp_path, reference8, monkeypatch, caplog):
    """Builds of one target share its work folder, so `ensure_target` lets one process build at a time."""
    import fcntl
    import threading

    import dflash2.training.build_target as bt

    cfg = compose_cfg([*EIGHT_STEPS, f"paths.output_dir={tmp_path / 'run'}", f"paths.cache_dir={tmp_path / 'cache'}"])
    final = tmp_path / "cache" / "targets" / f"tiny-{target_cache_key(cfg)}"
    final.parent.mkdir(parents=True)

    def must_not_build(*args, **kwargs):
        raise AssertionError("built again instead of waiting for the build in progress")

    monkeypatch.setattr(bt, "build_embedded_target", must_not_build)
    result = {}
    caplog.set_level(logging.INFO, logger="dflash2")
    with open(final.parent / f".{final.name}.lock", "a") as lock:  # "another process" is building
        fcntl.flock(lock, fcntl.LOCK_EX)
        waiter = threading.Thread(target=lambda: result.update(path=bt.ensure_target(cfg)))
        waiter.start()
        waiter.join(timeout=2.0)
        assert waiter.is_alive() and not result  # waiting, not building
        shutil.copytree(reference8[1] / "targets" / final.name, final)  # the other build publishes its target
    waiter.join(timeout=30)
    assert result["path"] == final
    assert f"waiting for another process that is building {final}" in caplog.messages


def test_gpu_out_of_memory_in_pretraining_names_the_recipe_knobs(tmp_path, monkeypatch):
    from dflash2.errors import DFlash2Error
    from dflash2.training.target_pretrain import CausalLMPretrainModule

    def oom(self, batch, batch_idx):  # what a CUDA allocation failure raises; CPU CI cannot exhaust a GPU
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 12.00 GiB")

    monkeypatch.setattr(CausalLMPretrainModule, "training_step", oom)
    with pytest.raises(
        DFlash2Error,
        match=r"^out of GPU memory during target pretraining; lower one of target.recipe.batch_size=4, "
        r"target.recipe.seq_len=32, target.recipe.hidden_size=32, then rerun to resume",
    ) as err:
        build(tmp_path, "oom", tmp_path / "cache")
    assert "\n" not in str(err.value)
    assert not list((tmp_path / "cache" / "targets").glob("tiny-*")) and not (tmp_path / "oom" / "target").exists()
