"""Measured τ of a trained pair on held-out prompts: the result a training run reports.

Per-position accuracies only *estimate* τ (they score every block from the target's
own context and ignore how a decode's errors chain), so a run's headline is a
measurement instead: a seeded sample of held-out prompts from the prompts API
(``dflash2.eval.prompts.prompt_set``, drawn from the split the drafter records it
was trained on), decoded at temperature 0 by the reference speculative decoder and
checked token for token against plain greedy decoding of the target
(``evaluate_acceptance``, whose files land in ``output_dir``). τ is
``SpecResult.mean_tau``: tokens emitted by verify steps / verify steps, the
prefill's first token excluded.

Hydra-free: ``train.py`` calls it at the end of a run; an ablation can call it per variant.
"""

from __future__ import annotations

from pathlib import Path

from dflash2.data.split_record import recorded_training_data
from dflash2.eval.acceptance import evaluate_acceptance
from dflash2.eval.prompts import HELDOUT, prompt_set


def measure_heldout_tau(
    target,
    drafter,
    *,
    num_prompts: int | None,
    prompt_tokens: int,
    max_new_tokens: int,
    seed: int,
    output_dir: Path | None = None,
) -> dict:
    """Lossless T=0 speculative decoding of held-out prompts -> the measured τ and what it was measured on.

    The prompts: ``num_prompts`` (None = the prompts API's default sample size) of ``prompt_tokens``
    tokens, drawn with ``seed`` from the held-out split of ``drafter.config.training_data`` (the
    default data config, with a logged warning, when the drafter records none). Returns a JSON-ready
    dict, τ first; the full results (per prompt, plots, the prompt keys) are in output_dir.
    """
    training_data, recorded = recorded_training_data(drafter.config.training_data)
    prompts = prompt_set(
        HELDOUT,
        target.tokenizer,
        num_prompts=num_prompts,
        prompt_tokens=prompt_tokens,
        seed=seed,
        training_data=training_data,
    )
    prompts.info["data_split_recorded"] = recorded
    results = evaluate_acceptance(
        target,
        drafter,
        prompts.prompts,
        temperature=0.0,
        max_new_tokens=max_new_tokens,
        check_lossless=True,
        output_dir=output_dir,
        seed=seed,
        show_progress=False,
        settings={"prompts": HELDOUT},
        prompt_set=prompts.info,
    )
    counts = results["prompt_counts"]
    return {
        "tau": results["mean_tau"],
        "lossless": results["lossless"],  # every output == plain greedy decoding of the target
        "num_prompts": results["num_prompts"],  # decoded
        "num_prompts_asked": counts["asked"],
        "fewer_prompts": counts["notes"],  # why fewer were decoded than asked, if they were
        "prompts": HELDOUT,
        "prompt_seed": seed,
        "prompt_tokens": prompt_tokens,
        "max_new_tokens": max_new_tokens,
        "temperature": 0.0,
        "steps": results["steps"],
        "tokens": results["tokens"],
        "mean_accepted_drafts": results["mean_accepted_drafts"],
        "per_position_acceptance": results["per_position_acceptance"],
        "first_mismatch": results["first_mismatch"],
        "results_dir": str(output_dir) if output_dir is not None else None,
    }
