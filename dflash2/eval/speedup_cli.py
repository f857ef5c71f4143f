"""Hydra front door of ``python -m eval.speedup`` and the ``dflash2-eval-speedup`` entry point
(config: ``configs/eval_speedup.yaml``; ``-m``: job N of a sweep writes into ``paths.output_dir/N``).

Like ``eval.acceptance``: the yaml is registered in Hydra's ConfigStore (so ``target=`` and
``drafter=`` are plain values, not the training config groups), the work is done by the
Hydra-free ``dflash2.eval.speedup.run_speedup``, and a user error prints one line and exits 2.
"""

from __future__ import annotations

import logging
import sys

from dflash2.errors import DFlash2Error
from dflash2.eval.acceptance_cli import config_file

log = logging.getLogger(__name__)
CONFIG_NAME = "eval_speedup"


def build_pair(cfg):
    """The pair to measure: a trained one (target + drafter folders) or random weights at cfg.shape."""
    import torch
    from omegaconf import OmegaConf

    from dflash2.eval.speedup_setup import random_pair, trained_pair
    from dflash2.runtime.models.loading import parse_dtype

    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = parse_dtype(cfg.dtype or "bfloat16", None) if cfg.shape else parse_dtype(cfg.dtype, str(cfg.target))
    batch = max(int(b) for b in cfg.batch_sizes)
    has_drafter = not OmegaConf.is_missing(cfg, "drafter") and cfg.drafter
    if cfg.shape:
        if has_drafter or cfg.target:
            raise DFlash2Error("pass either shape=NAME (random weights) or target=DIR drafter=DIR, not both")
        return random_pair(
            str(cfg.shape),
            dtype=dtype,
            device=device,
            block_size=_optional_int(cfg.block_size),  # null: the shape's own (speedup_setup.shape_drafter_config)
            drafter_layers=_optional_int(cfg.drafter_layers),
            batch=batch,
            prompt_tokens=int(cfg.prompt_tokens),
            seed=int(cfg.seed),
        )
    if not (has_drafter and cfg.target):
        raise DFlash2Error("nothing to measure: pass target=DIR drafter=DIR (a trained pair) or shape=qwen3_8b")
    return trained_pair(
        str(cfg.target),
        str(cfg.drafter),
        dtype=dtype,
        device=device,
        prompts=cfg.prompts,
        num_prompts=max(batch, int(cfg.num_prompts)),
        prompt_tokens=int(cfg.prompt_tokens),
        prompts_per_document=int(cfg.prompts_per_document),
    )


def run(cfg) -> dict:
    """Build the pair from the composed config, measure, write results; returns the results dict."""
    from dflash2.eval.speedup_gdn import check_names
    from dflash2.runtime.cache import set_attention_backend
    from dflash2.runtime.gemm import gemm_backend, set_gemm_backend

    modes = cfg.gdn_modes
    modes = check_names([modes] if isinstance(modes, str) else modes)  # gdn_modes=replay: one mode; typos first
    try:
        set_attention_backend(cfg.attention)
    except ValueError as e:
        raise DFlash2Error(f"attention={cfg.attention}: {e}") from None
    gemm = cfg.get("gemm", "cublas")
    previous_gemm = gemm_backend()
    try:
        set_gemm_backend(gemm)
    except ValueError as e:
        raise DFlash2Error(f"gemm={gemm}: {e}") from None
    try:
        return _measure(cfg, modes, gemm)
    finally:
        set_gemm_backend(previous_gemm)  # a caller in the same process (tests) gets its setting back


def _measure(cfg, modes, gemm) -> dict:
    from dflash2.runtime.engine import heap_frozen

    sampling = sampling_settings(cfg)
    pair = build_pair(cfg)
    taus = [float(t) for t in cfg.predict_taus] if pair.random else []
    from dflash2.runtime.gc_watch import collections_logged

    # the models are loaded: freeze the heap so that collections in the timed loops stay small (heap_frozen);
    # every collection from here on is counted and timed, to set beside the longest steps (gc_watch.py)
    with heap_frozen(bool(cfg.get("gc_freeze", True))) as frozen, collections_logged() as collections:
        return _run(cfg, modes, gemm, pair, taus, sampling, frozen, collections)


def _run(cfg, modes, gemm, pair, taus, sampling, frozen: int, collections) -> dict:
    from dflash2.eval.speedup import run_speedup

    results = run_speedup(
        pair,
        batch_sizes=[int(b) for b in cfg.batch_sizes],
        max_new_tokens=int(cfg.max_new_tokens),
        hf_new_tokens=int(cfg.hf_new_tokens),
        hf_check_tokens=int(cfg.get("hf_check_tokens", 0) or 0),
        runs=int(cfg.runs),
        copy_bytes=int(cfg.copy_bytes),
        predict_taus=taus,
        profile=bool(cfg.profile),
        ablate_kernels=bool(cfg.ablate_kernels),
        gdn_modes=modes,
        gdn_kernel_options=dict(cfg.get("gdn_kernel_options") or {}),
        output_dir=cfg.paths.output_dir,
        # results["attention"] / ["gemm"]: what ran
        extra={
            "attention_setting": cfg.attention or "default",
            "gemm_setting": gemm or "cublas",
            "gc_frozen_objects": frozen,  # 0: gc_freeze=false
            "gc_collections": collections.stats,  # filled in as the run goes (gc_watch.CollectionLog)
        },
        sampling=sampling,
        seed=int(cfg.seed),
        prefill_graph_tokens=_optional_int(cfg.get("prefill_graph_tokens")),  # None: the Decoder's default
        gc_pause=bool(cfg.get("gc_pause", False)),
        overlap_context=bool(cfg.get("overlap_context", True)),
    )
    print(f"results in {cfg.paths.output_dir}")
    return results


def main() -> None:
    """Entry point: compose the config (with CLI overrides) and run; DFlash2Error -> one line, exit 2."""
    import hydra
    from hydra.core.config_store import ConfigStore
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    try:
        ConfigStore.instance().store(name=CONFIG_NAME, node=OmegaConf.load(config_file(CONFIG_NAME)))
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


def sampling_settings(cfg) -> dict:
    """temperature / top_k / top_p from the config, checked (temperature 0: greedy, the lossless check)."""
    t, k, p = float(cfg.get("temperature", 0.0)), int(cfg.get("top_k", 0)), float(cfg.get("top_p", 1.0))
    if t < 0 or k < 0 or not 0 < p <= 1:
        raise DFlash2Error(f"temperature={t} top_k={k} top_p={p}: need temperature ≥ 0, top_k ≥ 0, 0 < top_p ≤ 1")
    return {"temperature": t, "top_k": k, "top_p": p}


def _optional_int(value) -> int | None:
    return None if value is None else int(value)
