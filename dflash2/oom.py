"""Turn a GPU out-of-memory error into a one-line message with the knobs to turn (issue 6).

A raw ``torch.OutOfMemoryError`` says how many bytes were missing but not which
setting of *this* run to lower; each stage of a run knows its own knobs, so it
wraps its work in ``explain_oom(stage, knobs)``.
"""

from __future__ import annotations

import contextlib

import torch

from dflash2.errors import DFlash2Error

# What to lower, by stage, as "config.key (now VALUE)" hints; the values are filled in from the run's config.
TRAINING_KNOBS = (
    "data.batch_size",
    "drafter.num_anchors",
    "data.response_tokens",
    "data.prompt_max_tokens",
    "drafter.num_hidden_layers",
)
REGENERATION_KNOBS = ("data.generation_batch_size", "data.response_tokens", "data.prompt_max_tokens")
EVAL_KNOBS = ("max_new_tokens", "prompt_tokens", "max_context")


def knob_hints(cfg, names) -> list[str]:
    """['data.batch_size=8', ...] for the names that exist in ``cfg`` (an OmegaConf node)."""
    from omegaconf import OmegaConf

    hints = []
    for name in names:
        value = OmegaConf.select(cfg, name, default=None)
        if value is not None:
            hints.append(f"{name}={value}")
    return hints


def oom_message(stage: str, hints: list[str], extra: str = "") -> str:
    """One line: the stage, the current values of its knobs, then any stage-specific advice in ``extra``."""
    knobs = ", ".join(hints) or "the batch and sequence sizes"
    return f"out of GPU memory during {stage}; lower one of {knobs}{extra}, or free the GPU of other processes"


@contextlib.contextmanager
def explain_oom(stage: str, hints: list[str], extra: str = ""):
    """Re-raise ``torch.OutOfMemoryError`` raised inside the block as a one-line DFlash2Error.

    The cached blocks are released first so that a caller (a notebook) that
    catches the error can go on with smaller settings.
    """
    try:
        yield
    except torch.OutOfMemoryError as e:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        raise DFlash2Error(oom_message(stage, hints, extra)) from e
