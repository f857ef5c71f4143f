"""Measured τ of a trained pair on held-out prompts: the result a training run reports.

Per-position accuracies only *estimate* τ (they assume every block starts from the
target's own context and ignore how errors chain along a decode), so a run's
headline is a measurement instead: a sample of held-out prompts from the prompts API
(``dflash2.eval.prompts.heldout_prompts``, from the run's own corpus sources),
decoded at temperature 0 by the reference speculative decoder and checked token for
token against plain greedy decoding of the target (``evaluate_acceptance``, whose
files land in ``output_dir``). τ is ``SpecResult.mean_tau``: tokens emitted by verify
steps / verify steps, the prefill's first token excluded.

Hydra-free: ``train.py`` calls it at the end of a run; an ablation can call it per variant.
"""

from __future__ import annotations

from pathlib import Path

from dflash2.errors import DFlash2Error
from dflash2.eval.acceptance import evaluate_acceptance
from dflash2.eval.prompts import heldout_prompts


def measure_heldout_tau(
    target,
    drafter,
    *,
    sources,
    num_prompts: int | None,
    prompt_tokens: int,
    max_new_tokens: int,
    seed: int,
    output_dir: Path | None = None,
) -> dict:
    """Lossless T=0 speculative decoding of held-out prompts -> the measured τ and what it was measured on.

    sources: the corpus sources the run trained on (their held-out split gives the prompts);
    num_prompts: how many (None = every held-out document with at least ``prompt_tokens`` tokens).
    Returns a JSON-ready dict, τ first; the full results (per prompt, plots) are in output_dir.
    """
    if target.tokenizer is None:
        raise DFlash2Error("the target has no tokenizer, so held-out text cannot be encoded; save one with the target")
    prompts = heldout_prompts(target.tokenizer, num_prompts=num_prompts, prompt_tokens=prompt_tokens, sources=sources)
    if not prompts:
        raise DFlash2Error(
            f"no held-out document has {prompt_tokens} tokens to make a prompt of; lower heldout_tau.prompt_tokens"
        )
    results = evaluate_acceptance(
        target,
        drafter,
        prompts,
        temperature=0.0,
        max_new_tokens=max_new_tokens,
        check_lossless=True,
        output_dir=output_dir,
        seed=seed,
        show_progress=False,
        settings={"prompts": "heldout", "prompt_tokens": prompt_tokens, "num_prompts_asked": num_prompts},
    )
    return {
        "tau": results["mean_tau"],
        "lossless": results["lossless"],  # every output == plain greedy decoding of the target
        "num_prompts": results["num_prompts"],
        "skipped_prompts": results["skipped_prompts"],
        "num_prompts_asked": num_prompts,
        "prompts": "heldout",
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
