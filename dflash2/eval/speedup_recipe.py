"""Speedup shapes that are a training experiment's pair at random weights (``shape=small_hybrid``).

``python -m eval.speedup shape=small_hybrid`` times the pair that ``python train.py
experiment=drafter_small`` trains (~12 GPU-minutes), with random weights: a step's time hardly
depends on the weights. Both halves are read from configs/ when the shape is built, so the
benchmark cannot drift from the recipe:

* the target's transformers config is the one its ``target`` group's recipe builds
  (:func:`dflash2.target_recipe.hybrid_target_config`, as ``dflash2.training.build_target`` calls it,
  with the special-token ids every tokenizer of ``dflash2.tokenizer`` has);
* the drafter's :class:`DrafterConfig` is the one training derives from the ``drafter`` group on that
  target (:func:`dflash2.drafter.from_target.drafter_config_for_target`, the target group's taps), with
  ``block_size`` / ``drafter_layers`` of the command line, when given, as ``drafter.block_size`` /
  ``drafter.num_hidden_layers`` overrides (else the experiment's own: 8 and 3 for drafter_small).
"""

from __future__ import annotations

from dflash2.errors import DFlash2Error


def experiment_config(experiment: str, *, block_size: int | None = None, drafter_layers: int | None = None):
    """``train.yaml`` composed with ``experiment=<experiment>`` and the drafter overrides that are not None."""
    from dflash2.train_config import compose_train

    overrides = [f"experiment={experiment}"]
    if block_size is not None:
        overrides.append(f"drafter.block_size={int(block_size)}")
    if drafter_layers is not None:
        overrides.append(f"drafter.num_hidden_layers={int(drafter_layers)}")
    cfg = compose_train(overrides)
    if cfg.target.get("recipe") is None:
        raise DFlash2Error(f"experiment={experiment} trains a target without a recipe ({cfg.target.name}): no shape")
    return cfg


def recipe_target_config(cfg):
    """The transformers config ``target=<cfg.target.name>`` trains: its recipe, the trained tokenizer's ids."""
    from omegaconf import OmegaConf

    from dflash2.target_recipe import hybrid_target_config
    from dflash2.tokenizer import EOS_TOKEN, PAD_TOKEN, SPECIAL_TOKENS

    recipe = OmegaConf.to_container(cfg.target.recipe, resolve=True)
    eos, pad = SPECIAL_TOKENS.index(EOS_TOKEN), SPECIAL_TOKENS.index(PAD_TOKEN)
    return hybrid_target_config(recipe, eos_token_id=eos, pad_token_id=pad)


def recipe_drafter_config(cfg, hf):
    """The DrafterConfig training builds from ``cfg.drafter`` for the target ``hf`` (a causal LM of
    :func:`recipe_target_config`), tapping the layers of ``cfg.target`` (null: the §2 rule)."""
    from omegaconf import OmegaConf

    from dflash2.drafter.from_target import drafter_config_for_target
    from dflash2.target import TargetModel, tap_settings
    from dflash2.tokenizer import MASK_TOKEN, SPECIAL_TOKENS

    settings = OmegaConf.to_container(cfg.drafter, resolve=True)
    if settings.get("mask_token_id") is None:  # a random target has no tokenizer: the trained one's mask id
        settings["mask_token_id"] = SPECIAL_TOKENS.index(MASK_TOKEN)
    target = TargetModel(hf, **tap_settings(cfg.target), name_or_path=f"random:{cfg.target.name}")
    return drafter_config_for_target(settings, target)
