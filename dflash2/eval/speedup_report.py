"""The files of ``eval.speedup``: results.json, results.md (tables) and step_breakdown.png (docs/ARCHITECTURE.md §6).

Everything here reads the results dict of ``speedup.run_speedup`` and nothing else; a hybrid target's
rows carry one AR + spec pair per GDN mode (the headline in the row itself, the others in
``other_gdn_modes``), labelled with their mode, and the GDN section comes from ``speedup_gdn``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from dflash2.eval import speedup_gdn, step_spread

PHASES = ("draft", "verify", "accept", "commit", "gap")  # the step's phases as PhaseTimer names them


def _label(method: str, mode: str | None) -> str:
    """A method's name with its GDN mode (hybrid targets), e.g. 'runtime spec (native)'."""
    return f"{method} ({mode})" if mode else method


def _attention(name: str) -> str:
    """What decode blocks ran, with what the Triton kernel leaves to SDPA."""
    return f"{name} (prefill: SDPA)" if name == "triton" else name


def _gemm(name: str) -> str:
    """What the target's decode-sized projections ran, with what the skinny GEMM leaves to cuBLAS."""
    return "skinny (prefill > 128 rows: cuBLAS)" if name == "skinny" else name


def _prefill(results: dict) -> str:
    """How the runtime prefilled, as the header says it: the setting and the bucket widths that actually ran."""
    tokens = results.get("prefill_graph_tokens", 0)
    if not tokens:
        return "eager"
    ran = sorted({w for row in results.get("batches", {}).values() for w in row.get("prefill_widths", [])})
    widths = f"bucket widths used: {', '.join(map(str, ran))}" if ran else "no prompt was bucketed: all eager"
    return f"padded to a bucket for prompts ≤ {tokens} tokens, a CUDA graph on a GPU (longer: eager); {widths}"


def _outside(r: dict) -> str:
    """A method's time outside its decode steps per generation, of its wall time per generation ('—' if not
    recorded: older results)."""
    if "outside_steps_ms" not in r:
        return "—"
    return f"{r['outside_steps_ms']['median']:.2f} of {r['generation_ms']['median']:.2f}"


def _fmt(s: dict, digits: int = 2) -> str:
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}–{s['max']:.{digits}f}]"


def markdown(results: dict) -> str:
    bound = results["bound_ms_per_step"]
    lines = [
        f"# eval.speedup — {results['label']}",
        "",
        f"{results['date']}, {results['device']}, {results['dtype']}, block {results['block_size']}, "
        f"GEMM {_gemm(results.get('gemm', 'cublas'))}, attention {_attention(results.get('attention', '?'))}; "
        f"weights read per step {results['weight_bytes'] / 1e9:.4g} GB, copy bandwidth "
        f"{results['copy_bandwidth_GBps']:.0f} GB/s (measured in this run) -> bound {bound:.3f} ms/step. "
        "Median [min–max] over runs. Decoded: the prompts each method decoded (rows beyond them are repeats) "
        "and its batches; the runtime decodes every prompt at every batch size, HF generate the first batch. "
        f"Prefill: {_prefill(results)}."
        + (" Decode loops with Python's garbage collector paused." if results.get("gc_pause") else "")
        + (
            f" Heap frozen after loading ({results['gc_frozen_objects']:,} objects out of the collector's reach)."
            if results.get("gc_frozen_objects")
            else ""
        )
        + _collections(results.get("gc_collections"))
        + (
            " The drafter's context K/V written in line after the last tapped target layer, not beside the rest."
            if results.get("overlap_context") is False
            else ""
        ),
        "",
        "| batch | method | decoded | ms/step | tokens/s | τ | weight GB/s | % of bound | lossless |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for N, row in results["batches"].items():
        methods = [("HF generate", "hf", row, None)] if "hf" in row else []
        for mode, sub in speedup_gdn.mode_rows(row):  # hybrids: one AR + spec pair per GDN mode, labelled
            methods += [(_label("runtime AR", mode), "ar", sub, sub), (_label("runtime spec", mode), "spec", sub, sub)]
        for name, key, sub, lossless_of in methods:
            r = sub[key]
            ms = r["ms_per_step"]["median"]
            tau = f"{r['tau']:.2f}" if "tau" in r else "1"
            gbps = results["weight_bytes"] / ms / 1e6
            frac = f"{bound / ms:.0%}" if key != "spec" else "—"
            lossless = "" if key != "spec" else lossless_text(lossless_of["lossless"])
            lines.append(
                f"| {N} | {name} | {decoded_text(r.get('decoded'))} | {_fmt(r['ms_per_step'], 3)} | "
                f"{_fmt(r['tokens_per_s'], 1)} | {tau} | "
                f"{gbps:.4g} | {frac} | {lossless} |"
            )
    lines += [
        "",
        "Step breakdown (ms, median over runs of the per-run median over the steps of all batches; mean step: "
        "of the per-run mean instead; outside steps: per generation, its wall time outside the decode steps — "
        "prefill, setup, read-back — of its whole wall time):",
        "",
    ]
    lines += [
        "| batch | method | " + " | ".join(PHASES) + " | mean step | outside steps / generation |",
        "|---|---|" + "---|" * (len(PHASES) + 2),
    ]
    for N, row in results["batches"].items():
        for mode, sub in speedup_gdn.mode_rows(row):
            for key in ("ar", "spec"):
                r = sub[key]
                ph = r["phases_ms"]
                cells = [f"{ph[p]['median']:.3f}" if p in ph else "—" for p in PHASES]
                cells.append(f"{r['mean_step_ms']['median']:.3f}" if "mean_step_ms" in r else "—")
                cells.append(_outside(r))
                lines.append(f"| {N} | {_label(key, mode)} | " + " | ".join(cells) + " |")
    lines.append("")
    for N, row in results["batches"].items():
        for mode, sub in speedup_gdn.mode_rows(row):
            lines.append(
                f"- batch {N}{f' ({mode})' if mode else ''}: verify-{results['block_size']} / AR step = "
                f"{sub['verify_over_ar_step']:.2f}; measured spec/AR tokens/s = {sub['speedup_measured']:.2f}"
                + (
                    ""
                    if results["random_weights"]
                    else f" (τ {sub['spec']['tau']:.2f}, 0.6·τ = {0.6 * sub['spec']['tau']:.2f})"
                )
            )
            for p in sub["predicted"]:
                lines.append(f"  - **prediction** at τ = {p['tau']:.2f}: speedup {p['speedup']:.2f}× over runtime AR")
            if sub["divergence"]:
                lines.append(f"  - first divergence: {json.dumps(sub['divergence'])}")
    lines += hf_check_lines(results.get("hf_check"))
    lines += step_spread.markdown_lines(results)
    lines += speedup_gdn.markdown_lines(results)
    prof = results.get("profile_ar_batch1")
    if prof:
        lines += [
            "",
            f"Profile of one AR step at batch 1 ({prof['how']}): {prof['kernels_per_step']:.0f} kernels, "
            f"{prof['kernel_us_per_step']:.0f} µs of kernel time, GEMM/GEMV {prof['gemm_us_per_step']:.0f} µs.",
            "",
            "| kernel | µs/step | calls/step |",
            "|---|---|---|",
        ]
        lines += [f"| `{t['kernel'][:70]}` | {t['us_per_step']:.1f} | {t['calls_per_step']:.0f} |" for t in prof["top"]]
    for phase, prof in (results.get("profile_spec_batch1") or {}).items():
        top = ", ".join(
            f"`{t['kernel'][:50]}` {t['us_per_step']:.1f} µs × {t['calls_per_step']:.0f}" for t in prof["top"][:5]
        )
        lines += [
            "",
            f"Profile of one speculative {phase} phase at batch 1 ({prof['how']}): {prof['kernels_per_step']:.0f} "
            f"kernels, {prof['kernel_us_per_step']:.0f} µs of kernel time, "
            f"GEMM/GEMV {prof['gemm_us_per_step']:.0f} µs; top: {top}.",
        ]
    abl = results.get("ablation_ar_batch1_no_fused_kernels")
    if abl:
        lines += [
            "",
            f"Ablation: runtime AR batch 1 without our Triton kernels (eager twins in the graphs, attention "
            f"{abl.get('attention', '?')}), decoded {decoded_text(abl.get('decoded'))}: "
            f"{_fmt(abl['ms_per_step'], 3)} ms/step ({bound / abl['ms_per_step']['median']:.0%} of bound).",
        ]
    return "\n".join(lines) + "\n"


def hf_check_lines(check: dict | None) -> list[str]:
    """The HF greedy check's section ([] when it was not asked for): rows equal per batch size and method,
    and every divergence with its prompt, position, both tokens and the target's logit margin."""
    if not check:
        return []
    if "skipped" in check:
        return ["", f"HF greedy check ({check['new_tokens']} tokens): skipped, {check['skipped']}."]
    n = check["new_tokens"]
    lines = [
        "",
        f"HF greedy check (untimed): HF `generate` of each of the {check['prompts']} prompts once, in batches of "
        f"{check['batch_size']}, against the headline mode's rows over the first {n} tokens (HF the reference; "
        "margin: logit(HF token) − logit(runtime token) from the target's eager prefill):",
        "",
    ]
    for N, got in check["batches"].items():
        R = got["rows"]
        lines.append(
            f"- batch {N}: HF greedy vs runtime AR: {got['ar_rows_equal']}/{R} rows equal over {n} tokens; "
            f"vs spec: {got['spec_rows_equal']}/{R}"
        )
        for key, name in (("ar", "AR"), ("spec", "spec")):
            lines += [f"  - {name} {_hf_divergence_text(d)}" for d in got[f"{key}_divergences"]]
    return lines


def _hf_divergence_text(d: dict) -> str:
    """One row's divergence from HF greedy, e.g. 'row 3 (prompt 3): position 512, HF 1234 vs 987, margin
    0.0625 (top-2 0.0625, bfloat16)'; a row that is a prefix of the other: its lengths."""
    where = f"row {d['row']} (prompt {d['prompt']}): position {d['position']}"
    if "lengths" in d:
        return f"{where}, lengths HF {d['lengths'][0]} vs {d['lengths'][1]}"
    return (
        f"{where}, HF {d['ref_token']} vs {d['got_token']}, margin {d['margin']:.4g} "
        f"(top-2 {d['top2_margin']:.4g}, {d['dtype']})"
    )


def plot_breakdown(results: dict, path: Path) -> bool:
    """Stacked bars of the step-time breakdown per (batch, method); False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    labels, stacks = [], {p: [] for p in PHASES}
    for N, row in results["batches"].items():
        for mode, sub in speedup_gdn.mode_rows(row):
            for key in ("ar", "spec"):
                labels.append(f"{_label(key, mode)} b{N}")
                for p in PHASES:
                    stacks[p].append(sub[key]["phases_ms"].get(p, {"median": 0.0})["median"])
    fig, ax = plt.subplots(figsize=(1.2 * len(labels) + 2, 4))
    bottom = [0.0] * len(labels)
    for p in PHASES:
        ax.bar(labels, stacks[p], bottom=bottom, label=p)
        bottom = [b + v for b, v in zip(bottom, stacks[p])]
    ax.axhline(results["bound_ms_per_step"], color="k", ls="--", lw=1, label="weight-read bound")
    ax.set_ylabel("ms per step")
    ax.set_title(results["label"][:80], fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _collections(stats: dict | None) -> str:
    """The sentence on Python's garbage collections during the measurement (dflash2/runtime/gc_watch.py)."""
    if not stats:
        return ""
    parts = [
        f"gen {g[-1]}: {s['collections']} (longest {s['max_ms']:.1f} ms, total {s['total_ms']:.0f} ms)"
        for g, s in stats.items()
    ]
    return " Python garbage collections from loading to the end (steps, prefills, checks): " + "; ".join(parts) + "."


def write_results(results: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2, default=_json_default))
    (out / "results.md").write_text(markdown(results))
    plot_breakdown(results, out / "step_breakdown.png")


def _json_default(x):
    if isinstance(x, float) and math.isnan(x):
        return None
    return str(x)


def decoded_text(decoded: dict | None) -> str:
    """What a method decoded, as the tables print it: '16 prompts (2×8)', '3 prompts (2+1)' (the last batch
    the rest), '8 rows from 3 prompts (1×8)' (prompts cycled to fill a batch); '?' for results without it."""
    if not decoded:
        return "?"
    sizes = decoded["batches"]
    batches = f"{len(sizes)}×{sizes[0]}" if len(set(sizes)) == 1 else "+".join(map(str, sizes))
    n, rows = decoded["prompts"], decoded["rows"]
    what = f"{n} prompt{'s' * (n != 1)}" if rows == n else f"{rows} rows from {n} prompt{'s' * (n != 1)}"
    return f"{what} ({batches})"


def lossless_text(flag: bool | None) -> str:
    """A lossless flag as the tables print it: None (a sampled run: no token comparison) as n/a."""
    return "n/a (sampled)" if flag is None else ("true" if flag else "FALSE")
