"""The spread of decode-step times in ``eval.speedup``: where a mean step exceeds the median one.

Tokens/s divides by whole generations, so it follows the *mean* step, while the headline ms/step is
the median. On the H200 the trained pair's batch-1 steps ran 3.5% (AR) and 5% (spec) above their
medians on average, and not at batch 8 (docs/BENCHMARKS.md, stop 16). These summaries say which steps
are the slow ones:

- percentiles of all steps (a few very slow steps, or a broad shoulder);
- the mean step per quarter of each generation (steps that grow with the context, e.g. attention);
- speculative steps grouped by how many tokens the previous step emitted (the most of any row):
  ReplaySSM folds those tokens into the GDN states inside the next verify, so that verify's time
  grows with them, and at batch 1 the count varies from step to step where at batch 8 the most of 8
  rows is nearly always high.

Inputs are per-step times in ms of each generation (one list per batch, in step order: PhaseTimer's
"step" series) and, for spec, each batch's emitted counts (SpecResult.emitted: rows × verify steps).
"""

from __future__ import annotations

import statistics

PERCENTILES = (10, 50, 90, 99)


def percentiles(ms: list[float]) -> dict[str, float]:
    """p10 / p50 / p90 / p99 and max of ``ms`` (the sorted value at index round(q/100 · (n − 1))); {} when empty."""
    if not ms:
        return {}
    ordered = sorted(ms)
    last = len(ordered) - 1
    out = {f"p{q}": ordered[min(last, round(q / 100 * last))] for q in PERCENTILES}
    out["max"] = ordered[-1]
    return out


def by_quarter(generations: list[list[float]]) -> list[float]:
    """Mean step ms in each quarter of a generation's steps, pooled over generations: 4 values (a
    generation of fewer than 4 steps contributes to the quarters its steps fall in)."""
    pooled: list[list[float]] = [[], [], [], []]
    for steps in generations:
        n = len(steps)
        for i, ms in enumerate(steps):
            pooled[min(3, 4 * i // n)].append(ms)
    return [statistics.fmean(q) if q else float("nan") for q in pooled]


def by_previous_emitted(generations: list[list[float]], emitted: list[list[list[int]]]) -> dict[int, dict]:
    """Speculative steps grouped by the previous step's emitted tokens (the most over the batch's rows
    that had that step): {n: {"mean_ms", "steps"}}, ascending n. Left out: step 0 (after the prefill: no
    previous step) and the poll lag's steps after every row finished (no row is still decoding there).

    generations[b]: batch b's step times; emitted[b][r][s]: tokens row r's verify step s emitted."""
    groups: dict[int, list[float]] = {}
    for steps, rows in zip(generations, emitted):
        for s in range(1, len(steps)):
            counts = [row[s - 1] for row in rows if s - 1 < len(row)]
            if counts and s < max(len(row) for row in rows):  # a verify step of a row still decoding
                groups.setdefault(max(counts), []).append(steps[s])
    return {n: {"mean_ms": statistics.fmean(v), "steps": len(v)} for n, v in sorted(groups.items())}


def spread(generations: list[list[float]], emitted: list[list[list[int]]] | None = None) -> dict:
    """All of the above for one timed pass: percentiles, quarters, and (spec) by previous emitted count."""
    out = {
        "percentiles_ms": percentiles([ms for steps in generations for ms in steps]),
        "mean_ms_by_quarter": by_quarter(generations),
    }
    if emitted is not None:
        out["mean_ms_by_previous_emitted"] = by_previous_emitted(generations, emitted)
    return out


def markdown_lines(results: dict) -> list[str]:
    """results.md's step-spread table: per batch size and method (headline GDN mode), the percentiles,
    the quarter means and, for spec, the mean step by the previous step's emitted count."""
    rows = []
    for N, row in results["batches"].items():
        for key in ("ar", "spec"):
            sp = row.get(key, {}).get("step_spread")
            if not sp or not sp["percentiles_ms"]:
                continue
            pct = " / ".join(f"{sp['percentiles_ms'][k]:.3f}" for k in ("p10", "p50", "p90", "p99", "max"))
            quarters = " / ".join(f"{ms:.3f}" for ms in sp["mean_ms_by_quarter"])
            emitted = sp.get("mean_ms_by_previous_emitted") or {}
            by_n = ", ".join(f"{n}: {g['mean_ms']:.3f} ({g['steps']})" for n, g in emitted.items()) or "—"
            runs = " / ".join(f"{r['mean']:.3f}" for r in sp.get("per_run_ms", [])) or "—"
            rows.append(f"| {N} | {key} | {pct} | {runs} | {quarters} | {by_n} |")
    if not rows:
        return []
    return [
        "",
        "Step-time spread (ms, every timed generation's steps): percentiles p10 / p50 / p90 / p99 / max; mean "
        "per quarter of a generation; spec: mean step by the tokens the previous step emitted (the most over "
        "the rows; ReplaySSM folds them inside the next verify), with the number of steps; and each run's mean step:",
        "",
        "| batch | method | p10 / p50 / p90 / p99 / max | mean per run | quarters 1–4 | by previous emitted |",
        "|---|---|---|---|---|---|",
        *rows,
    ]
