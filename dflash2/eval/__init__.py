"""Acceptance evaluation of a drafter against its target (issue 4).

``evaluate_acceptance`` (Hydra-free) runs the reference speculative decoder on a
prompt set and writes τ, per-position acceptance, plots and the lossless check;
``load_prompts`` builds the prompt sets; ``acceptance_cli`` is the Hydra front
door behind ``python -m eval.acceptance``.
"""

from dflash2.eval.acceptance import acceptance_stats, evaluate_acceptance
from dflash2.eval.prompts import Prompt, load_prompts

__all__ = ["Prompt", "acceptance_stats", "evaluate_acceptance", "load_prompts"]
