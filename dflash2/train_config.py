"""The training config as ``python train.py OVERRIDES`` composes it, for tools outside a training run.

Benchmarks that must measure what training builds (``bench_throughput``'s drafter group,
``eval.speedup shape=small_hybrid``'s target recipe and drafter) read it from configs/ instead of
copying its numbers, so they cannot drift from it.
"""

from __future__ import annotations

from dflash2.config_dir import config_dir


def compose_train(overrides: list[str]):
    """configs/train.yaml composed with ``overrides`` (e.g. ``["experiment=drafter_small"]``): a DictConfig.

    Callable inside another Hydra app (``eval.speedup`` is one): Hydra holds one global instance,
    so the caller's is set aside while this composes and put back afterwards.
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    outer = GlobalHydra.instance().hydra  # None outside a Hydra app
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
            return compose("train", overrides=list(overrides))
    finally:
        GlobalHydra.instance().clear()
        if outer is not None:
            GlobalHydra.instance().initialize(outer)
