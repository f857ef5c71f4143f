"""Every config composes, and the objects it describes instantiate (issue 2)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate
from omegaconf import OmegaConf

from dflash2.training.cli import CONFIG_DIR
from dflash2.training.override_check import check_overrides

GROUPS = {p.name: sorted(q.stem for q in p.glob("*.yaml")) for p in Path(CONFIG_DIR).iterdir() if p.is_dir()}


def _compose(overrides, tmp_path):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(
            "train",
            overrides=[f"paths.output_dir={tmp_path}", f"paths.cache_dir={tmp_path}/cache", *overrides],
            return_hydra_config=True,
        )
    GlobalHydra.instance().clear()
    return cfg


def test_expected_groups_exist():
    for group in ["target", "drafter", "data", "trainer", "logger", "callbacks", "paths", "experiment", "debug"]:
        assert GROUPS.get(group), f"config group {group}/ is missing"
    assert {"cpu", "gpu", "ddp", "ddp_cpu", "fsdp"} <= set(GROUPS["trainer"])
    assert {"wandb", "tensorboard", "csv"} <= set(GROUPS["logger"])


@pytest.mark.parametrize("group,option", [(g, o) for g, opts in GROUPS.items() for o in opts if g not in ("paths",)])
def test_every_option_composes(group, option, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    if group == "trainer" and option == "default":
        pytest.skip("trainer/default is the base of the other trainer configs")
    cfg = _compose([f"{group}={option}"], tmp_path)
    OmegaConf.resolve(cfg)  # every interpolation resolves
    assert cfg.paths.output_dir == str(tmp_path)
    if group == "trainer":
        # the step sampler shards the global batch itself (dflash2/training/drafter_data.py)
        assert cfg.trainer.use_distributed_sampler is False
    if group == "trainer" and option in ("cpu", "ddp_cpu"):
        trainer = instantiate(cfg.trainer, logger=False, enable_progress_bar=False)
        assert trainer.max_steps == cfg.trainer.max_steps
        assert trainer.world_size == cfg.trainer.devices
    if group == "logger":
        if option == "wandb":
            pytest.importorskip("wandb", reason="a dependency, but absent from the bare GPU image")
        for node in cfg.logger.values():
            assert instantiate(node) is not None
    if group == "callbacks":
        callbacks = [instantiate(node) for node in cfg.callbacks.values()]
        assert any(type(c).__name__ == "ModelCheckpoint" for c in callbacks)


def test_drafter_v1_and_v2_differ_only_in_additions(tmp_path):
    v1 = _compose(["drafter=dflash"], tmp_path).drafter
    v2 = _compose(["drafter=dflash2"], tmp_path).drafter
    assert not v1.use_local_conv and not v1.use_selector
    assert v2.use_local_conv and v2.use_selector
    diff = {k for k in v1 if v1[k] != v2[k]}
    assert diff == {"version", "use_local_conv", "use_selector"}
    # Selector training options: the defaults the 3-seed rows of docs/BENCHMARKS.md chose
    assert v2.selector_gold_injection is True and v2.selector_zero_successor_init is False
    # the training kernels and the kept logits are on, timed on the H200 (docs/TRAINING.md); on the CPU the
    # kernels' switches leave the torch code running
    for key in ("loss_kernels", "loss_keep_logits", "conv_kernels", "norm_kernels"):
        assert v1[key] is True and v2[key] is True, key
    assert v1.loss_topk_kernel is False and v2.loss_topk_kernel is False  # off until timed on a GPU


def test_ablation_variants_differ_from_v1_only_in_their_switches(tmp_path):
    """The variants of `python -m eval.ablation` (docs/ABLATION.md) are v1 with one switch flipped each."""
    from dflash2.eval.ablation_plan import VARIANTS

    v1 = _compose(["drafter=dflash"], tmp_path).drafter
    switches = {
        "dflash": {},
        "dflash_matched": {"match_dflash2_parameters": True},
        "dflash2_conv_only": {"use_local_conv": True},
        "dflash2_selector_only": {"use_selector": True},
        "dflash2": {"use_local_conv": True, "use_selector": True},
    }
    assert set(VARIANTS) == set(switches)
    for variant, flipped in switches.items():
        cfg = _compose([f"drafter={variant}"], tmp_path).drafter
        assert cfg.version == variant
        assert {k: cfg[k] for k in cfg if k != "version" and cfg[k] != v1[k]} == flipped, variant


def test_experiments_set_the_task(tmp_path):
    assert _compose(["experiment=target_tiny"], tmp_path).task == "target"
    small = _compose(["experiment=target_small"], tmp_path)
    assert small.target.name == "small" and small.trainer.accelerator == "gpu"
    assert small.target.recipe.extra_sources[0].path == "site-packages"


def test_chat_experiment_trains_a_chat_drafter_against_a_chat_pretrained_target(tmp_path):
    """experiment=chat: data=chat, and a target whose pretraining mixes in templated conversations;
    every shipped target recipe is code only by default (its cache key unchanged)."""
    chat = _compose(["experiment=chat"], tmp_path)
    assert chat.task == _compose([], tmp_path).task and "chat" in chat.data
    assert chat.data.chat.template == "auto" and 0 < chat.target.recipe.chat_fraction < 1
    for target in ("tiny", "small"):
        assert _compose([f"target={target}"], tmp_path).target.recipe.chat_fraction == 0


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["debug=fast_dev_run"],
        ["drafter=dflash", "debug=fast_dev_run"],
        ["experiment=drafter_small"],
        ["experiment=drafter_small", "debug=fast_dev_run"],
    ],
)
def test_shipped_drafter_runs_pass_the_block_preflight(overrides, tmp_path):
    """`python train.py debug=fast_dev_run` once stopped here: 32 anchors in a 32-token response."""
    from dflash2.training.preflight import check_blocks_fit_the_data

    cfg = _compose(overrides, tmp_path)
    block = SimpleNamespace(block_size=cfg.drafter.block_size)  # the only DrafterConfig field the check reads
    check_blocks_fit_the_data(block, int(cfg.drafter.num_anchors), cfg.data)


def test_unknown_override_is_one_line_error():
    for bad in (["trainer.max_step=5"], ["drafter=dflsh"], ["nosuchkey=1"]):
        message = check_overrides(bad, CONFIG_DIR)
        assert message is not None and "\n" not in message and "override" in message
    assert check_overrides(["trainer.max_steps=5", "drafter=dflash"], CONFIG_DIR) is None


def test_wandb_goes_offline_without_a_key(monkeypatch, tmp_path):
    pytest.importorskip("wandb", reason="a dependency, but absent from the bare GPU image")
    from dflash2.training.loggers import make_wandb_logger, wandb_mode

    for var in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    assert wandb_mode("auto") == "offline"
    assert wandb_mode("disabled") == "disabled"
    logger = make_wandb_logger(save_dir=str(tmp_path), mode="auto")
    assert logger is not None and logger._offline
    assert make_wandb_logger(save_dir=str(tmp_path), mode="disabled") is None


def test_wandb_logger_without_the_package_is_a_one_line_error(monkeypatch, tmp_path):
    from dflash2.errors import DFlash2Error
    from dflash2.training.run import instantiate_loggers

    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now raises ImportError, as on a machine without it
    cfg = _compose(["logger=wandb"], tmp_path)
    with pytest.raises(
        DFlash2Error, match=r"^logger=wandb needs the wandb package: pip install wandb, or pick logger=csv"
    ) as err:
        instantiate_loggers(cfg)
    assert "\n" not in str(err.value)


def test_hydra_record_lands_in_the_run_folder(tmp_path):
    """`paths.output_dir=DIR` puts Hydra's .hydra/ beside the run's artifacts, not in a second dated folder."""
    import subprocess

    from conftest import REPO, subprocess_env

    run = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, str(REPO / "train.py"), f"paths.output_dir={run}", "task=no_such_task"],
        cwd=tmp_path,
        env=subprocess_env(),
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and "task='no_such_task'" in out.stderr
    assert (run / ".hydra" / "config.yaml").is_file() and not (tmp_path / "outputs").exists()


def test_eval_acceptance_config_composes_with_its_prompt_options(tmp_path):
    """configs/eval_acceptance.yaml (a ConfigStore primary config, outside the training groups)."""
    from hydra import initialize

    from dflash2.eval.acceptance_cli import CONFIG_NAME, register_configs
    from dflash2.eval.sampled_prompts import POSITIONS

    register_configs()  # what the CLI does: the eval config and the job_logging it selects
    GlobalHydra.instance().clear()
    with initialize(version_base="1.3", config_path=None):
        cfg = compose(CONFIG_NAME, overrides=["drafter=d", "seed=7", f"paths.output_dir={tmp_path}"])
    GlobalHydra.instance().clear()
    OmegaConf.resolve(cfg)
    assert cfg.prompts == "heldout" and cfg.num_prompts is None  # a prompts file is evaluated whole
    assert cfg.prompt_seed == 7 and cfg.prompt_position in POSITIONS and cfg.prompts_per_document == 1


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["shape=qwen3_8b", "batch_sizes=[1]"],
        ["shape=small_hybrid"],
        ["target=T", "drafter=D", "runs=5", "gdn_modes=[reference,replay]"],
    ],
)
def test_eval_speedup_config_composes(overrides, tmp_path):
    """configs/eval_speedup.yaml composes (through the ConfigStore, as `python -m eval.speedup` loads it)."""
    from hydra import initialize
    from hydra.core.config_store import ConfigStore

    from dflash2.eval.acceptance_cli import config_file
    from dflash2.eval.speedup_cli import CONFIG_NAME
    from dflash2.runtime.gdn_state import GDN_MODE_CHOICES

    ConfigStore.instance().store(name=CONFIG_NAME, node=OmegaConf.load(config_file(CONFIG_NAME)))
    GlobalHydra.instance().clear()
    with initialize(version_base="1.3", config_path=None):
        cfg = compose(CONFIG_NAME, overrides=[f"paths.output_dir={tmp_path}", *overrides])
    GlobalHydra.instance().clear()
    assert list(cfg.batch_sizes) in ([1, 8], [1]) and cfg.dtype == "bfloat16" and cfg.max_new_tokens > 0
    assert cfg.paths.output_dir == str(tmp_path)
    if overrides:
        assert cfg.shape in ("qwen3_8b", "small_hybrid") or (cfg.target, cfg.drafter, cfg.runs) == ("T", "D", 5)
    # null: the shape's own drafter block size and depth (dflash2.eval.speedup_setup.shape_drafter_config)
    assert cfg.block_size is None and cfg.drafter_layers is None
    assert cfg.prefill_graph_tokens is None  # the runtime's default: graphed up to 64 tokens on CUDA, eager on CPU
    # hybrid targets: ReplaySSM (headline) and native rollback by default, every name one GDNState knows
    expected = ["reference", "replay"] if "gdn_modes=[reference,replay]" in overrides else ["replay", "native"]
    assert list(cfg.gdn_modes) == expected and set(expected) <= set(GDN_MODE_CHOICES)
