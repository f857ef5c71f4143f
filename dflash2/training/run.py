"""What `python train.py` does with a composed config (issues 2 and 3).

task=target : build or reuse the target, publish it to output_dir/target/, report its held-out loss.
task=data   : the above, then regenerate (or find cached) the data a drafter run reads, and stop.
task=drafter: the above, then regenerate data with the target, train a drafter with
              Lightning, save it to output_dir/drafter/ and report held-out block accuracy.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import lightning as L
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig

from dflash2.errors import DFlash2Error
from dflash2.logging_setup import send_lightning_logs_to_root
from dflash2.target import check_target_source
from dflash2.training.build_target import BUILD_INFO, ensure_target, format_target_report, publish_target
from dflash2.training.device_check import check_trainer_devices
from dflash2.training.preflight import check_drafter_files
from dflash2.training.resumable_loggers import resume_histories

log = logging.getLogger(__name__)


def run_from_config(cfg: DictConfig) -> dict:
    send_lightning_logs_to_root()  # Lightning's lines once, in the run's format and log file
    output_dir = Path(cfg.paths.output_dir).resolve()
    output_dir.mkdir(parents=True, exist_ok=True)
    if cfg.task not in ("target", "data", "drafter"):
        raise DFlash2Error(f"task={cfg.task!r}: use task=drafter (default), task=data or task=target")
    check_trainer_devices(cfg.trainer)  # a GPU or FSDP setting this machine can't run: before any build
    if cfg.task == "drafter":  # seconds, before a target is built or copied into the run
        check_drafter_files(cfg, output_dir)
    L.seed_everything(int(cfg.seed), workers=True, verbose=False)
    source = ensure_target(cfg)
    check_target_source(str(source))  # a damaged folder fails here, before it is copied into the run
    target_dir = publish_target(source, output_dir)
    log.info(f"target: {target_dir}")
    summary: dict = {"output_dir": str(output_dir), "target": str(target_dir)}
    info_file = Path(str(target_dir)) / BUILD_INFO
    if info_file.exists():
        info = json.loads(info_file.read_text())
        summary["target_build"] = {k: v for k, v in info.items() if k != "recipe"}
        log.info(format_target_report(info))
    if cfg.task == "data":
        from dflash2.training.train_drafter import prepare_data

        summary["data"] = prepare_data(cfg, target_dir)
    if cfg.task == "drafter":
        from dflash2.training.train_drafter import train_drafter

        summary["drafter"] = train_drafter(cfg, target_dir, output_dir)
        if summary["drafter"] is None:  # not global rank 0 of a multi-process run: rank 0 writes the files
            return summary
    (output_dir / "run_summary.json").write_text(json.dumps(summary, indent=2, default=str))
    log.info(f"done; everything is under {output_dir} (run_summary.json)")
    return summary


def instantiate_user_facing(node: DictConfig):
    """`hydra.utils.instantiate`, but a DFlash2Error raised by the factory reaches the user as itself
    (one line), not wrapped in Hydra's multi-line InstantiationException."""
    from hydra.errors import InstantiationException

    try:
        return instantiate(node)
    except InstantiationException as err:
        if isinstance(err.__cause__, DFlash2Error):
            raise err.__cause__ from None
        raise


def instantiate_loggers(cfg: DictConfig, resume_step: int | None = None) -> list:
    """The run's loggers; with ``resume_step`` (the checkpoint's global step) they continue the run's
    logs instead of starting them over (dflash2/training/resumable_loggers.py)."""
    loggers = []
    for node in (cfg.get("logger") or {}).values():
        if node is not None and "_target_" in node:
            logger = instantiate_user_facing(node)
            if logger is not None:
                loggers.append(logger)
    if resume_step is not None:
        resume_histories(loggers, resume_step)
    return loggers


def instantiate_callbacks(cfg: DictConfig) -> list:
    return [
        instantiate_user_facing(node)
        for node in (cfg.get("callbacks") or {}).values()
        if node is not None and "_target_" in node
    ]


def regeneration_device(cfg: DictConfig) -> str:
    return "cuda" if cfg.trainer.get("accelerator") in ("gpu", "cuda") and torch.cuda.is_available() else "cpu"
