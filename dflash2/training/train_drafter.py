"""Drafter training run (issue 3): data regeneration -> Lightning fit -> export -> held-out report.

The run's result is τ *measured* by lossless speculative decoding of held-out prompts
(``dflash2.eval.heldout_tau``); the held-out per-position accuracies and the τ estimate
derived from them are reported beside it, labelled as an estimate.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import warnings
from pathlib import Path

import lightning as L
import torch
from hydra.utils import instantiate
from lightning.pytorch.strategies import FSDPStrategy
from omegaconf import DictConfig

from dflash2.data.generation_backend import backend_name, release_engines
from dflash2.data.regenerate import chat_template_of, regenerate_split
from dflash2.data.split_record import training_data_record
from dflash2.drafter.from_target import check_drafter_matches_target, drafter_config_for_target
from dflash2.drafter.io import load_drafter, save_drafter
from dflash2.drafter.model import DFlashDrafter
from dflash2.drafter.objective import anchor_generator, block_metrics, expected_tau_from_accuracies
from dflash2.errors import DFlash2Error
from dflash2.eval.heldout_tau import measure_heldout_tau
from dflash2.oom import REGENERATION_KNOBS, TRAINING_KNOBS, explain_oom, knob_hints
from dflash2.target import TargetModel, tap_settings
from dflash2.target_dtype import resolve_target_dtype
from dflash2.training.build_target import to_plain as plain
from dflash2.training.drafter_data import DrafterDataModule, check_pin_memory, collate_sequences
from dflash2.training.drafter_module import DrafterTrainingModule
from dflash2.training.full_drafter import check_supported_strategy, drafter_on_rank_zero
from dflash2.training.launch import PREPARE_FIRST, external_world_size
from dflash2.training.offline_features import OfflineFeatures, features_mode
from dflash2.training.optimizer_impl import check_optimizer_impl
from dflash2.training.param_groups import check_param_order
from dflash2.training.peak_memory import peak_memory_per_rank, reset_peak_memory
from dflash2.training.preflight import (
    check_attention,
    check_blocks_fit_the_data,
    check_conv_kernels,
    check_loss_chunk_positions,
    check_loss_keep_logits,
    check_loss_kernels,
    check_loss_topk_kernel,
    check_norm_kernels,
    check_resume_checkpoint,
    check_sequences_fit_the_context,
    resolve_ckpt_path,
    resume_param_order,
)
from dflash2.training.run import instantiate_callbacks, instantiate_loggers, regeneration_device

log = logging.getLogger(__name__)

# Memory savers that are not a smaller size: half precision, and the same batch in smaller pieces.
# What makes the final held-out decoding smaller (prompts run one at a time: their number does not matter).
MEASURE_KNOBS = ("heldout_tau.max_new_tokens", "heldout_tau.prompt_tokens")
OOM_TRAINING_ADVICE = (
    " (or set trainer.precision=bf16-mixed, or halve data.batch_size and set trainer.accumulate_grad_batches=2),"
    " then resume with ckpt_path=last"
)


def training_oom_hints(cfg: DictConfig, loss_chunk: int) -> tuple[list[str], str]:
    """The knobs and advice of an out-of-memory error in training: with the chunked loss on, its chunk is one
    more size to lower; with it off, turning it on drops the logits of every position (docs/TRAINING.md)."""
    hints = knob_hints(cfg, TRAINING_KNOBS)
    if loss_chunk:
        return [*hints, f"drafter.loss_chunk_positions={loss_chunk}"], OOM_TRAINING_ADVICE
    return hints, " (or set drafter.loss_chunk_positions=1024," + OOM_TRAINING_ADVICE.removeprefix(" (or")


def load_target(cfg: DictConfig, target_dir) -> TargetModel:
    """The frozen target in ``target.dtype`` (auto: bf16 when the run uses a GPU, else fp32), loaded on the CPU;
    regeneration and training move it to their device."""
    return TargetModel.from_pretrained(
        str(target_dir),
        **tap_settings(cfg.target),
        dtype=resolve_target_dtype(cfg.target.get("dtype", "auto"), regeneration_device(cfg)),
    )


def train_drafter(cfg: DictConfig, target_dir, output_dir: Path) -> dict | None:
    """Train, then (global rank 0 only) export, report and measure; returns the run's summary on
    rank 0 and None on the other ranks of a multi-process run, which write nothing."""
    seed = int(cfg.seed)
    target = load_target(cfg, target_dir)
    data = plain(cfg.data)
    # Validate the drafter against the target before spending time on data.
    settings = plain(cfg.drafter)
    config = drafter_config_for_target(settings, target)
    if settings.get("init_from"):
        # fp32 master weights whatever the folder stores (published drafters are bf16)
        drafter = load_drafter(settings["init_from"], dtype=torch.float32).train()
        check_drafter_matches_target(drafter.config, target)
    else:
        drafter = fresh_drafter(config, settings, seed)
    common = regeneration_settings(cfg, target_dir)
    # Saved with the drafter (and its checkpoints): evaluation draws held-out prompts from this split.
    if data.get("chat") and target.tokenizer is None:
        raise DFlash2Error(f"data=chat needs the target's tokenizer (its chat template); {target_dir} has none")
    chat_template = chat_template_of(data, target.tokenizer) if data.get("chat") else None
    drafter.config.training_data = training_data_record(data, common["seed"], chat_template)
    check_blocks_fit_the_data(drafter.config, int(settings["num_anchors"]), data)
    loss_chunk = check_loss_chunk_positions(settings.get("loss_chunk_positions"))
    check_loss_kernels(settings.get("loss_kernels"))
    check_conv_kernels(settings.get("conv_kernels"))
    check_norm_kernels(settings.get("norm_kernels"))
    check_loss_keep_logits(settings.get("loss_keep_logits"))
    check_loss_topk_kernel(settings.get("loss_topk_kernel"))
    attention = check_attention(settings.get("attention"), regeneration_device(cfg))
    check_optimizer_impl(settings.get("optimizer_impl"))
    check_pin_memory(data.get("pin_memory"))
    check_sequences_fit_the_context(data, config.max_position_embeddings)
    resume_from = resolve_ckpt_path(cfg.get("ckpt_path"), output_dir)
    resume_step = check_resume_checkpoint(resume_from, drafter.config) if resume_from is not None else None

    cache_dir = Path(cfg.paths.cache_dir)
    device = regeneration_device(cfg)
    offline = None
    if features_mode(data) == "offline":  # taps read from the shards of `python -m dflash2.data.features`
        root = data.get("features_dir") or cache_dir / "features"
        offline = OfflineFeatures(target, target_id=str(target_dir), features_root=Path(root))
    train_ds, val_ds = regenerate_training_data(cfg, target, common, attach=offline and offline.attach)
    if backend_name(data) == "vllm":
        # The engine holds most of the GPU's memory: make the held-out split (read after training) with it
        # now, then shut it down before the drafter trains.
        regenerate_split(target, data, split="heldout", num_prompts=_count(data["num_val_prompts"]), **common)
        release_engines()
    target.model.cpu()
    log.info(
        f"data: {len(train_ds)} train / {len(val_ds)} validation regenerated sequences (cache {cache_dir / 'data'})"
    )
    n_params = sum(p.numel() for p in drafter.parameters())
    log.info(
        f"drafter: {settings['version']} "
        f"({n_params / 1e6:.2f} M params, block {drafter.config.block_size}, taps {drafter.config.target_layer_ids})"
    )

    total_steps = int(cfg.trainer.max_steps)
    if cfg.trainer.get("fast_dev_run"):
        total_steps = max(total_steps, 1)
    module = training_module(
        drafter,
        target,
        settings,
        total_steps=total_steps,
        seed=seed,
        target_id=str(target_dir),
        loss_chunk=loss_chunk,
        attention=attention,
    )
    pad_id = (
        target.tokenizer.pad_token_id
        if target.tokenizer is not None and target.tokenizer.pad_token_id is not None
        else 0
    )
    datamodule = DrafterDataModule(
        train_ds if offline is None else offline.wrap(train_ds, "train"),
        val_ds if offline is None else offline.wrap(val_ds, "validation"),
        batch_size=int(data["batch_size"]),
        total_steps=total_steps,
        seed=seed,
        pad_id=pad_id,
        num_workers=int(data["num_workers"]),
        pin_memory=data.get("pin_memory", "auto"),
    )
    loggers = instantiate_loggers(cfg, resume_step)
    trainer: L.Trainer = instantiate(cfg.trainer, logger=loggers or False, callbacks=instantiate_callbacks(cfg))
    check_supported_strategy(trainer)
    if resume_from is not None and isinstance(trainer.strategy, FSDPStrategy):  # the only strategy that cares
        check_param_order(resume_param_order(resume_from), fsdp=True)
    with warnings.catch_warnings(), explain_oom("drafter training", *training_oom_hints(cfg, loss_chunk)):
        # Multi-process: Lightning suggests sync_dist for every epoch-level val/ metric; every rank runs the
        # whole validation split and holds the same values (drafter_data.py), so there is nothing to sync.
        warnings.filterwarnings("ignore", message=r"It is recommended to use `self.log\('val/")
        reset_peak_memory(trainer.strategy.root_device)
        trainer.fit(module, datamodule=datamodule, ckpt_path=resume_from)

    # Both collectives run on every rank (FSDP gathers the shards); from here on rank 0 alone writes the run's files.
    peak_memory = peak_memory_per_rank(trainer.strategy, trainer.strategy.root_device)
    trained = drafter_on_rank_zero(trainer, module)
    if trained is None:
        return None
    if trained is not module.drafter:  # FSDP: a gathered copy; report with it, not with the shards
        module = module.with_drafter(trained)
    drafter_dir = output_dir / "drafter"
    save_drafter(trained.float().cpu(), drafter_dir)
    log.info(f"drafter saved to {drafter_dir}")

    with explain_oom(
        "the held-out report",
        knob_hints(cfg, ("data.generation_batch_size", "data.batch_size", "data.num_val_prompts")),
    ):
        # Only rank 0 is here after training: it may generate the split whatever the launcher.
        count, anyone = _count(data["num_val_prompts"]), {**common, "missing_hint": None}
        heldout_ds = regenerate_split(target, data, split="heldout", num_prompts=count, **anyone)
        report = heldout_report(
            module.to(device),
            heldout_ds,
            train_ds,
            pad_id=pad_id,
            batch_size=int(data["batch_size"]),
            seed=seed,
            precision=trainer.precision_plugin.forward_context,
        )
    measure = cfg.heldout_tau
    started = time.perf_counter()
    with explain_oom("the measured held-out tau", knob_hints(cfg, MEASURE_KNOBS)):
        measured = measure_heldout_tau(
            module.target,
            module.drafter,
            num_prompts=None if measure.num_prompts is None else int(measure.num_prompts),
            prompt_tokens=int(measure.prompt_tokens),
            max_new_tokens=int(measure.max_new_tokens),
            seed=seed,
            output_dir=output_dir / "heldout_eval",
        )
    seconds = time.perf_counter() - started
    # The measurement leads (train_summary.json and the console); the estimate follows, labelled.
    summary = {"heldout_tau_measured": measured, **report}
    summary["steps"] = int(trainer.global_step)
    summary["world_size"] = int(trainer.world_size)  # processes that trained (GPUs on a GPU run)
    summary["drafter_dir"] = str(drafter_dir)
    if peak_memory is not None:
        summary["training_peak_memory_per_rank"] = peak_memory
    (output_dir / "train_summary.json").write_text(json.dumps(summary, indent=2))
    log.info(measured_tau_line(measured, seconds))
    for line in heldout_report_lines(summary):
        log.info(line)
    if peak_memory is not None:
        log.info(
            "training peak GPU memory per rank, GiB allocated / reserved: "
            + ", ".join(f"{a:.2f} / {r:.2f}" for a, r in zip(peak_memory["allocated_gib"], peak_memory["reserved_gib"]))
        )
    return summary


def regeneration_settings(cfg: DictConfig, target_dir) -> dict:
    """Keyword arguments of ``regenerate_split`` shared by every split. ``data.seed`` (null = the run's seed)
    picks the prompts and sampling: runs with other training seeds can share one data set (the ablation).
    Under torchrun / SLURM the data must be in the cache already (dflash2/training/launch.py)."""
    data_seed = cfg.data.get("seed")
    return dict(
        seed=int(cfg.seed if data_seed is None else data_seed),
        cache_dir=Path(cfg.paths.cache_dir),
        target_id=str(target_dir),
        device=regeneration_device(cfg),
        missing_hint=PREPARE_FIRST if external_world_size() > 1 else None,
    )


def regenerate_training_data(cfg: DictConfig, target: TargetModel, common: dict, attach=None):
    """The train and validation splits (from the cache when it has them), filtered to rows with an anchor.
    ``attach(dataset, split)``, when given, sees each whole split before the filter (offline features)."""
    data = plain(cfg.data)
    attach = attach or (lambda dataset, split: dataset)
    with explain_oom("regeneration of training data by the target", knob_hints(cfg, REGENERATION_KNOBS)):
        train_ds = trainable_rows(
            attach(
                regenerate_split(target, data, split="train", num_prompts=_count(data["num_train_prompts"]), **common),
                "train",
            ),
            "train",
        )
        val_ds = trainable_rows(
            attach(
                regenerate_split(
                    target, data, split="validation", num_prompts=_count(data["num_val_prompts"]), **common
                ),
                "validation",
            ),
            "validation",
        )
    return train_ds, val_ds


def prepare_data(cfg: DictConfig, target_dir) -> dict:
    """task=data: regenerate (or find in the cache) every split a drafter run reads, and train nothing.
    Run once before parallel runs that share the data, so that they never regenerate it side by side."""
    target = load_target(cfg, target_dir)
    data = plain(cfg.data)
    common = regeneration_settings(cfg, target_dir)
    train_ds, val_ds = regenerate_training_data(cfg, target, common)
    with explain_oom("regeneration of the held-out data", knob_hints(cfg, REGENERATION_KNOBS)):
        heldout_ds = regenerate_split(
            target, data, split="heldout", num_prompts=_count(data["num_val_prompts"]), **common
        )
    release_engines()
    sizes = {"train": len(train_ds), "validation": len(val_ds), "heldout": len(heldout_ds), "seed": common["seed"]}
    log.info(f"data ready: {sizes} (cache {common['cache_dir'] / 'data'})")
    return sizes


def training_module(
    drafter, target, settings: dict, *, total_steps: int, seed: int, target_id: str, loss_chunk: int, attention: str
) -> DrafterTrainingModule:
    """The LightningModule that trains ``drafter`` with the ``drafter`` config group's ``settings`` (plain
    dict); ``loss_chunk`` and ``attention`` as checked by preflight. The training throughput benchmark
    (``dflash2.training.bench_throughput``) times the steps of the module built here."""
    return DrafterTrainingModule(
        drafter,
        target,
        num_anchors=int(settings["num_anchors"]),
        loss_gamma=float(settings["loss_gamma"]),
        selector_loss_weight=float(settings["selector_loss_weight"]),
        lr=float(settings["lr"]),
        weight_decay=float(settings["weight_decay"]),
        warmup_ratio=float(settings["warmup_ratio"]),
        total_steps=total_steps,
        seed=seed,
        target_id=target_id,
        selector_gold_injection=bool(settings.get("selector_gold_injection", False)),
        loss_chunk_positions=loss_chunk,
        loss_kernels=check_loss_kernels(settings.get("loss_kernels")),
        conv_kernels=check_conv_kernels(settings.get("conv_kernels")),
        norm_kernels=check_norm_kernels(settings.get("norm_kernels")),
        loss_keep_logits=check_loss_keep_logits(settings.get("loss_keep_logits")),
        loss_topk_kernel=check_loss_topk_kernel(settings.get("loss_topk_kernel")),
        attention=attention,
        optimizer_impl=check_optimizer_impl(settings.get("optimizer_impl")),
    )


def fresh_drafter(config, settings: dict, seed: int) -> DFlashDrafter:
    """A new drafter initialised from the run's seed, with ``drafter.selector_zero_successor_init``
    applied (ARCHITECTURE.md §3.2); a drafter loaded with init_from keeps the codebook it was trained to."""
    # the seed names the initial weights: the same backbone for every variant (dflash2/drafter/initialisation.py)
    drafter = DFlashDrafter(config, init_seed=seed)
    if settings.get("selector_zero_successor_init") and drafter.candidate_selector is not None:
        drafter.candidate_selector.zero_successor_()
    return drafter


def _count(value) -> int | None:
    """A data.num_*_prompts value: an int, or None (chat data: every turn of the split)."""
    return None if value is None else int(value)


def trainable_rows(dataset, split: str):
    """Keep sequences with an anchor (two consecutive response tokens, ARCHITECTURE.md §2.6); error if none is left."""

    def has_anchor(row) -> bool:
        m = row["loss_mask"]
        return any(m[i] and m[i + 1] for i in range(1, len(m) - 1))

    kept = dataset.filter(has_anchor, desc=f"filtering {split}")
    if len(kept) == 0:
        raise DFlash2Error(
            f"the {split} data is empty after filtering: "
            f"none of {len(dataset)} regenerated sequences has two consecutive response tokens to anchor a block; "
            "raise data.response_tokens or check that the target does not stop at once"
        )
    return kept


@torch.no_grad()
def heldout_report(
    module: DrafterTrainingModule,
    heldout_ds,
    train_ds,
    *,
    pad_id: int,
    batch_size: int,
    seed: int,
    precision=contextlib.nullcontext,
) -> dict:
    """Per-position top-1 accuracy on held-out regenerated data vs the most-frequent-token baseline.

    ``precision``: a context-manager factory each forward runs in, the trainer's
    (``trainer.precision_plugin.forward_context``): the report sees the numerics training saw (bf16 autocast
    with ``bf16-mixed``), and runs the same kernels (flex attention compiled for bf16 on CUDA)."""
    module.eval()
    module.target.model.to(module.device)
    preds, labels, masks, sel_preds = [], [], [], []
    for start in range(0, len(heldout_ds), batch_size):
        batch = collate_sequences(
            [heldout_ds[i] for i in range(start, min(start + batch_size, len(heldout_ds)))], pad_id
        )
        batch = {k: v.to(module.device) for k, v in batch.items()}
        with precision():
            out = module.block_outputs(batch, anchor_generator(seed + 2, start))
        preds.append(out["predictions"].flatten(0, 1))
        labels.append(out["labels"].flatten(0, 1))
        masks.append(out["label_mask"].flatten(0, 1))
        if "selector_predictions" in out:
            sel_preds.append(out["selector_predictions"].flatten(0, 1))
    cat = lambda xs: torch.cat(xs).cpu()[None]  # noqa: E731  (1, blocks, P)
    metrics = block_metrics(cat(preds), cat(labels), cat(masks))
    # Trivial baseline: always predict the most frequent supervised token of the training data.
    counts = torch.zeros(module.drafter.config.vocab_size, dtype=torch.long)
    for row in train_ds:
        ids = torch.tensor(row["input_ids"])[torch.tensor(row["loss_mask"]).bool()]
        counts += torch.bincount(ids, minlength=counts.numel())
    most_frequent = int(counts.argmax())
    baseline = block_metrics(torch.full_like(cat(labels), most_frequent), cat(labels), cat(masks))
    report = {
        "heldout_blocks": int(metrics["blocks"]),
        "heldout_acc_per_position": [round(float(a), 4) for a in metrics["acc_per_position"]],
        "heldout_tau_estimate": round(float(metrics["tau_estimate"]), 4),
        "heldout_tau_if_independent": round(expected_tau_from_accuracies(metrics["acc_per_position"]), 4),
        "baseline_most_frequent_token": most_frequent,
        "baseline_acc_per_position": [round(float(a), 4) for a in baseline["acc_per_position"]],
        "baseline_tau_estimate": round(float(baseline["tau_estimate"]), 4),
    }
    if sel_preds:
        sel = block_metrics(cat(sel_preds), cat(labels), cat(masks))
        report["heldout_selector_acc_per_position"] = [round(float(a), 4) for a in sel["acc_per_position"]]
        report["heldout_selector_tau_estimate"] = round(float(sel["tau_estimate"]), 4)
    return report


def measured_tau_line(m: dict, seconds: float) -> str:
    """The run's result line: measured τ, on how many prompts (and why fewer than asked), lossless or not."""
    lossless = "yes" if m["lossless"] else f"NO, first mismatch {m['first_mismatch']}"
    fewer = f" ({'; '.join(m['fewer_prompts'])})" if m["fewer_prompts"] else ""
    return (
        f"RESULT: measured tau = {m['tau']:.3f} tokens per verify step, lossless speculative decoding (T=0) of "
        f"{m['num_prompts']} held-out prompts{fewer} x {m['max_new_tokens']} new tokens; "
        f"output == greedy: {lossless} ({seconds:.1f} s; {m['results_dir']})"
    )


def heldout_report_lines(r: dict) -> list[str]:
    """The τ *estimate* from held-out per-position accuracy, labelled as one, and that accuracy
    (logged after the measured τ)."""
    acc = " ".join(f"{a:.2f}" for a in r["heldout_acc_per_position"])
    base = " ".join(f"{a:.2f}" for a in r["baseline_acc_per_position"])
    selector = r.get("heldout_selector_tau_estimate")
    return [
        f"  estimate, not a decode: tau ~ {r['heldout_tau_estimate']:.3f} from held-out per-position accuracy"
        f"{'' if selector is None else f' (selector path {selector:.3f})'}, baseline {r['baseline_tau_estimate']:.3f}",
        f"  held-out per-position top-1 accuracy ({r['heldout_blocks']} blocks): {acc}",
        f"    baseline (always token {r['baseline_most_frequent_token']}):            {base}",
    ]
