"""What the parts of ``python -m eval.speedup`` share (speedup.py, speedup_hf.py): the device sync and the
statistics of timed runs, the rows and batches each method decodes, the sampling settings, and where two
methods' tokens first differ (with the target's logits there, to tell numerics from a bug)."""

from __future__ import annotations

import statistics

import torch


# ----------------------------------------------------------------------------- timing
def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _stats(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


# ----------------------------------------------------------------------------- prompts and batches
def prompt_rows(num_prompts: int, N: int) -> list[int]:
    """The prompt index of each row decoded at batch size N: every prompt once, in order; fewer prompts
    than N are cycled to fill one batch (the repeats are decoded and measured like any row: what is
    measured is throughput at batch N, and the results say how many rows came from how many prompts)."""
    return [i % num_prompts for i in range(max(num_prompts, N))]


def split_batches(rows: list, N: int) -> list[list]:
    """Consecutive batches of N rows; the last holds the rest and runs at its own size (the Decoder keeps a
    slot and its graphs per batch bucket, so that is how the runtime would serve it; no padding rows to
    exclude from τ, tokens and the comparisons)."""
    return [rows[i : i + N] for i in range(0, len(rows), N)]


def decoded(rows: list[list[int]], batches: list[list]) -> dict:
    """What a method decoded, as results record it: distinct prompts, rows (prompts and their repeats) and
    the rows of each batch."""
    return {"prompts": len({tuple(r) for r in rows}), "rows": len(rows), "batches": [len(b) for b in batches]}


# ----------------------------------------------------------------------------- sampling settings
# (a) HF generate and the HF greedy check: speedup_hf.py
GREEDY = {"temperature": 0.0, "top_k": 0, "top_p": 1.0}  # the sampling settings of a greedy run


def is_sampled(sampling: dict | None) -> bool:
    """Whether ``sampling`` (None or :data:`GREEDY`'s keys) draws tokens (temperature > 0) rather than argmaxes."""
    return bool(sampling) and float(sampling["temperature"]) > 0


def first_divergence(model, prompts, ref, got, prompt_index=None) -> dict | None:
    """First (row, position) where ``got`` differs from ``ref``, with the target's logits of both tokens there.

    Rows are counted over all batches (``prompts[r]`` is row r's prompt); ``prompt`` is row r's index in
    the prompt set, ``prompt_index[r]`` (None: row r is prompt r; they differ where prompts are cycled).
    The logits come from one eager prefill of prompt + the common prefix in the model's dtype: a margin
    near that dtype's rounding is numerics of two kernels (T=1 vs T=B), a large one a bug.
    """
    for r, (a, b) in enumerate(zip(ref, got)):
        where = {"row": r, "prompt": r if prompt_index is None else prompt_index[r]}
        i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if i is None:
            if len(a) != len(b):
                return {**where, "position": min(len(a), len(b)), "lengths": [len(a), len(b)]}
            continue
        ctx = list(prompts[r]) + list(a[:i])
        device = model.embed.weight.device
        state = model.new_state(1, len(ctx) + 1)
        with torch.no_grad():
            logits = model(
                torch.tensor([ctx], device=device), state, logits_index=torch.tensor([len(ctx) - 1], device=device)
            ).logits[0]
        top2 = logits.float().topk(2).values
        return {
            **where,
            "position": i,
            "ar_token": a[i],
            "spec_token": b[i],
            "logit_ar_token": float(logits[a[i]]),
            "logit_spec_token": float(logits[b[i]]),
            "margin": float(logits[a[i]].float() - logits[b[i]].float()),
            "top2_margin": float(top2[0] - top2[1]),
            "dtype": str(logits.dtype).removeprefix("torch."),
        }
    return None


# first_divergence's keys for its two sequences, and what row_divergences names them: it has no AR or spec side
NEUTRAL_KEYS = {
    "ar_token": "ref_token",
    "spec_token": "got_token",
    "logit_ar_token": "logit_ref_token",
    "logit_spec_token": "logit_got_token",
}


def row_divergences(model, prompts, ref, got, prompt_index=None) -> list[dict]:
    """Every row where ``got`` differs from ``ref`` (:func:`first_divergence` stops at the first row), each
    with its first divergence: row, prompt, position, ``ref_token`` / ``got_token`` and their logits,
    ``margin`` = logit(ref token) − logit(got token), ``top2_margin`` and dtype, the logits from the target's
    eager prefill of the row's prompt + the common prefix; or row, prompt, position and ``lengths`` where one
    row is a prefix of the other. Rows and ``prompt_index`` as in :func:`first_divergence`; [] when all equal."""
    out = []
    for r, (a, b) in enumerate(zip(ref, got)):
        found = first_divergence(model, [prompts[r]], [a], [b])
        if found is not None:
            where = {"row": r, "prompt": r if prompt_index is None else prompt_index[r]}
            out.append({NEUTRAL_KEYS.get(k, k): v for k, v in {**found, **where}.items()})
    return out
