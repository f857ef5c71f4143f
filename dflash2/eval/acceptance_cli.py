"""Hydra front door of ``python -m eval.acceptance`` and the ``dflash2-eval-acceptance`` entry point.

Config: ``configs/eval_acceptance.yaml`` (found by dflash2/config_dir.py). Hydra's whole command
line works (``--cfg job``, ``-m drafter=A,B``: job N of a sweep writes into ``paths.output_dir/N``).

The only Hydra user in ``dflash2.eval``; the work is done by the Hydra-free
``evaluate_acceptance``. The yaml is registered in Hydra's ConfigStore instead of
being found through ``config_path``: the ``configs/`` folder also holds the
training groups ``target/`` and ``drafter/``, and Hydra would read ``target=DIR``
as a group choice there. Every user error prints one line and exits with status 2.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from dflash2.config_dir import config_dir
from dflash2.errors import DFlash2Error

log = logging.getLogger(__name__)
CONFIG_NAME = "eval_acceptance"
JOB_LOGGING = "dflash2"


def config_file(name: str = CONFIG_NAME) -> Path:
    """configs/<name>.yaml of the checkout or of the installed package (dflash2/config_dir.py)."""
    return config_dir() / f"{name}.yaml"


def run(cfg) -> dict:
    """Load drafter, target and prompts from the composed config and evaluate; returns the results dict."""
    import torch
    from omegaconf import OmegaConf

    from dflash2.data.split_record import recorded_training_data
    from dflash2.drafter.io import load_drafter
    from dflash2.eval.acceptance import evaluate_acceptance
    from dflash2.eval.prompts import prompt_set
    from dflash2.oom import EVAL_KNOBS, explain_oom, knob_hints
    from dflash2.target import TargetModel

    if OmegaConf.is_missing(cfg, "drafter") or not cfg.drafter:
        raise DFlash2Error("no drafter given; pass drafter=DIR (a folder written by training or save_drafter)")
    device = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
    drafter = load_drafter(str(cfg.drafter), device=device)
    target_path = cfg.target or drafter.config.target_name_or_path
    if not target_path:
        raise DFlash2Error("no target given and the drafter does not record one; pass target=DIR_OR_HUB_ID")
    # The drafter's taps decide which target layers to read; a target with fewer layers fails here.
    target = TargetModel.from_pretrained(
        str(target_path), target_layer_ids=list(drafter.config.target_layer_ids), dtype=cfg.dtype, device=device
    )
    training_data, recorded = recorded_training_data(drafter.config.training_data, str(cfg.drafter))
    prompts = prompt_set(
        str(cfg.prompts),
        target.tokenizer,
        num_prompts=cfg.num_prompts,
        prompt_tokens=int(cfg.prompt_tokens),
        prompts_per_document=int(cfg.prompts_per_document),
        position=str(cfg.prompt_position),
        seed=int(cfg.prompt_seed),
        training_data=training_data,
    )
    prompts.info["data_split_recorded"] = recorded  # False: the defaults were assumed (logged)
    # Prompts run one at a time, so memory grows with their length, not their number.
    with explain_oom(
        "speculative decoding", knob_hints(cfg, EVAL_KNOBS), extra=" (or load the target with dtype=bfloat16)"
    ):
        results = evaluate_acceptance(
            target,
            drafter,
            prompts.prompts,
            temperature=float(cfg.temperature),
            top_k=int(cfg.top_k),
            top_p=float(cfg.top_p),
            max_new_tokens=int(cfg.max_new_tokens),
            check_lossless=cfg.check_lossless,
            output_dir=cfg.paths.output_dir,
            seed=int(cfg.seed),
            max_context=cfg.max_context,
            settings={"drafter": str(cfg.drafter), "prompts": str(cfg.prompts), "target_path": str(target_path)},
            prompt_set=prompts.info,
        )
    lossless = {None: "not checked", True: "true", False: "FALSE"}[results["lossless"]]
    log.info(
        f"mean tau {results['mean_tau']:.3f} over {results['steps']} steps, {results['num_prompts']} prompts "
        f"({results['skipped_prompts']} skipped); lossless {lossless}; results in {cfg.paths.output_dir}"
    )
    return results


def register_configs() -> None:
    """Put the eval config, and the console/log-file setup train.py uses (its defaults list selects
    it), into Hydra's ConfigStore."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    primary = config_file()
    store = ConfigStore.instance()
    store.store(name=CONFIG_NAME, node=OmegaConf.load(primary))
    job_logging = primary.parent / "hydra" / "job_logging" / f"{JOB_LOGGING}.yaml"
    store.store(group="hydra/job_logging", name=JOB_LOGGING, node=OmegaConf.load(job_logging))


def main() -> None:
    """Entry point: compose the config (with CLI overrides) and run; DFlash2Error -> one line, exit 2."""
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    try:
        register_configs()
    except DFlash2Error as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)

    @hydra.main(version_base="1.3", config_path=None, config_name=CONFIG_NAME)
    def _app(cfg) -> None:
        if HydraConfig.get().mode == RunMode.MULTIRUN:  # job N of a sweep writes into paths.output_dir/N
            cfg.paths.output_dir = HydraConfig.get().runtime.output_dir
        try:
            run(cfg)
        except DFlash2Error as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)

    _app()
