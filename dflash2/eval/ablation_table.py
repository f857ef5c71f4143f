"""The ablation's table: mean ± std τ and per-position acceptance per variant over seeds (issue 11).

Hydra-free and Lightning-free: it reads the results.json files that ``python -m eval.acceptance``
wrote for each trained drafter. ``measurements`` is the one place that reads τ from a results.json,
so a change of the acceptance results' fields is made here only.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path


def measurements(results: dict) -> dict:
    """What the ablation takes from one acceptance results.json."""
    return {
        "tau": float(results["mean_tau"]),
        "per_position_acceptance": [float(r) for r in results["per_position_acceptance"]],
        "lossless": results["lossless"],
        "verify_steps": int(results["steps"]),
        "prompts": int(results["num_prompts"]),
        "skipped_prompts": int(results["skipped_prompts"]),
    }


def read_measurements(results_json: Path) -> dict:
    return measurements(json.loads(Path(results_json).read_text()))


def mean_std(values: list[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (None for a single value)."""
    mean = statistics.fmean(values)
    return mean, (statistics.stdev(values) if len(values) > 1 else None)


def summarise(runs: list[dict], baseline: str) -> list[dict]:
    """runs: one dict per evaluated run (variant, seed, params, and ``measurements``' keys), in variant order.

    Per variant: n, τ mean/std, per-position mean/std, params, all lossless, and the paired Δτ against
    ``baseline`` over the seeds both have (same seed = same backbone init, data order and anchors).
    """
    by_variant: dict[str, list[dict]] = {}
    for r in runs:
        by_variant.setdefault(r["variant"], []).append(r)
    base_tau = {r["seed"]: r["tau"] for r in by_variant.get(baseline, [])}
    rows = []
    for variant, rs in by_variant.items():
        tau_mean, tau_std = mean_std([r["tau"] for r in rs])
        positions = list(zip(*(r["per_position_acceptance"] for r in rs)))
        per_position = [mean_std(list(p)) for p in positions]
        paired = [r["tau"] - base_tau[r["seed"]] for r in rs if r["seed"] in base_tau]
        delta_mean, delta_std = mean_std(paired) if paired and variant != baseline else (None, None)
        rows.append(
            {
                "variant": variant,
                "params": sorted({r["params"] for r in rs}),
                "seeds": [r["seed"] for r in rs],
                "tau_mean": tau_mean,
                "tau_std": tau_std,
                "delta_tau_vs_baseline_mean": delta_mean,
                "delta_tau_vs_baseline_std": delta_std,
                "delta_tau_seeds": len(paired) if variant != baseline else 0,
                "per_position_mean": [m for m, _ in per_position],
                "per_position_std": [s for _, s in per_position],
                "lossless": all(r["lossless"] is True for r in rs),
            }
        )
    return rows


def _pm(mean: float | None, std: float | None, digits: int = 3) -> str:
    if mean is None:
        return "—"
    return f"{mean:.{digits}f}" if std is None else f"{mean:.{digits}f} ± {std:.{digits}f}"


def markdown(summary: list[dict], runs: list[dict], header: dict, descriptions: dict[str, str]) -> str:
    """The table as markdown: settings, per-variant summary, per-position mean ± std, every run."""
    baseline = header["baseline"]
    k = max((len(r["per_position_mean"]) for r in summary), default=0)
    lines = ["# DFlash v1 vs DFlash2 ablation", ""]
    lines += [f"- {name}: {value}" for name, value in header["lines"]]
    lines += [
        "",
        f"τ = tokens per verify step (accepted drafts + 1), real lossless decoding; mean ± sample std over seeds. "
        f"Δτ = the variant's τ minus `{baseline}`'s at the same seed (same backbone init, data order and "
        f"anchors), mean ± std over seeds. An addition helps when Δτ is clearly above the seed-to-seed spread.",
        "",
        f"| variant | what | params | seeds | τ | Δτ vs {baseline} | acceptance k=1..{k} (mean) | lossless |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in summary:
        params = " / ".join(f"{p / 1e6:.3f} M" for p in r["params"])
        rates = " ".join(f"{m:.2f}" for m in r["per_position_mean"])
        delta = _pm(r["delta_tau_vs_baseline_mean"], r["delta_tau_vs_baseline_std"])
        lines.append(
            f"| `{r['variant']}` | {descriptions.get(r['variant'], '')} | {params} | {len(r['seeds'])} | "
            f"{_pm(r['tau_mean'], r['tau_std'])} | {delta} | {rates} | {'yes' if r['lossless'] else '**NO**'} |"
        )
    lines += [
        "",
        "## Per-position acceptance (mean ± std over seeds)",
        "",
        "| variant | " + " | ".join(f"k={i}" for i in range(1, k + 1)) + " |",
        "|---|" + "---|" * k,
    ]
    for r in summary:
        cells = [_pm(m, s, 2) for m, s in zip(r["per_position_mean"], r["per_position_std"])]
        lines.append(f"| `{r['variant']}` | " + " | ".join(cells) + " |")
    lines += [
        "",
        "## Runs",
        "",
        "| variant | seed | τ | verify steps | prompts | lossless | train s | eval s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        lines.append(
            f"| `{r['variant']}` | {r['seed']} | {r['tau']:.3f} | {r['verify_steps']} | {r['prompts']} | "
            f"{r['lossless']} | {_seconds(r.get('train_seconds'))} | {_seconds(r.get('eval_seconds'))} |"
        )
    return "\n".join(lines) + "\n"


def _seconds(value) -> str:
    return "—" if value is None else f"{value:.0f}"


def write_table(out_dir: Path, summary: list[dict], runs: list[dict], header: dict, descriptions: dict) -> None:
    """ablation.md and ablation.json in ``out_dir`` (strict JSON: NaN/inf written as null)."""
    (out_dir / "ablation.md").write_text(markdown(summary, runs, header, descriptions))
    record = {"settings": dict(header["lines"]), **header.get("json", {}), "variants": summary, "runs": runs}
    (out_dir / "ablation.json").write_text(json.dumps(_finite(record), indent=2) + "\n")


def _finite(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x
