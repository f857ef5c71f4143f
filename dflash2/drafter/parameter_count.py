"""Parameter counts of drafter configs, and DFlash v1 widened to DFlash2's count (issue 11).

The capacity control of the ablation: DFlash2's selector codebooks are two V×r matrices, so at a
small width a DFlash2 drafter has several times v1's parameters, and a v1/v2 gap could be capacity
rather than the additions. The control is v1 with a wider MLP (``intermediate_size``) chosen so that
its count is the closest to DFlash2's at the same settings. A wider MLP, not more layers: one more
layer adds a fixed chunk (too coarse at small sizes) and a deeper drafter is also slower per draft.
"""

from __future__ import annotations

import dataclasses

import torch

from dflash2.drafter.config import DrafterConfig
from dflash2.errors import DFlash2Error


def parameter_count(config: DrafterConfig) -> int:
    """Trainable parameters of a drafter built from ``config`` (built on "meta": no memory, no init)."""
    from dflash2.drafter.model import DFlashDrafter  # model.py is heavier; counting needs only shapes

    with torch.device("meta"):
        drafter = DFlashDrafter(config)
    return sum(p.numel() for p in drafter.parameters())


def dflash2_counterpart(config: DrafterConfig) -> DrafterConfig:
    """The same settings with both DFlash2 additions on."""
    return dataclasses.replace(config, use_local_conv=True, use_selector=True)


def widened_to_match(config: DrafterConfig, reference: DrafterConfig) -> DrafterConfig:
    """``config`` (a v1 config) with the ``intermediate_size`` whose parameter count is closest to
    ``reference``'s. The MLP has 3·hidden·intermediate parameters per layer, so the count is linear in it."""
    if config.is_v2:
        raise DFlash2Error(
            "matching DFlash2's parameter count widens a DFlash v1 drafter; set drafter.use_local_conv=false "
            "and drafter.use_selector=false (or drafter=dflash_matched)"
        )
    goal = parameter_count(reference)
    per_unit = 3 * config.hidden_size * config.num_hidden_layers
    base = parameter_count(config)
    guess = max(1, config.intermediate_size + round((goal - base) / per_unit))
    candidates = [dataclasses.replace(config, intermediate_size=max(1, guess + d)) for d in (-1, 0, 1)]
    return min(candidates, key=lambda c: abs(parameter_count(c) - goal))
