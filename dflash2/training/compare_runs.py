"""Side-by-side report of drafter runs that should train alike: loss parity, tokens/s, scaling, memory.

The multi-GPU acceptance check (docs/TRAINING.md, "Multi-GPU"): a 1-GPU run, a second 1-GPU run with
another seed (the run-to-run noise), and DDP / FSDP runs at the same global batch. Each run is a run
folder of `python train.py ... logger=csv` (its `csv/metrics.csv` and `train_summary.json`).

    python -m dflash2.training.compare_runs 1gpu=runs/s0 1gpu_seed1=runs/s1 ddp2=runs/ddp fsdp2=runs/fsdp \\
        --baseline 1gpu --noise 1gpu_seed1 --plot curves.png --json compare.json

What it computes, for every run against the baseline:
- the training loss smoothed over `--window` logged points (a trailing mean; per-step losses of
  different anchor draws scatter more than the curves differ), compared at the steps both logged:
  the largest and the RMS difference; and the largest difference of the validation loss;
- the same figures between the baseline and the noise run, and whether each run's largest
  differences stay within them ("within noise": both the train and the validation figure);
- tokens/s: `train/tokens_per_s` counts the global batch's target tokens per wall-second of a step;
  the median over the steady part (after `--skip` of the steps: compile, tuning and warm-up) and its
  interquartile range; per GPU = global ÷ world size; scaling efficiency = per-GPU tokens/s ÷ the
  baseline's per-GPU tokens/s;
- peak memory per GPU (`training_peak_memory_per_rank` of the summary, GiB allocated / reserved)
  and the measured τ of the run's held-out report.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

from dflash2.errors import DFlash2Error

TRAIN_LOSS, VAL_LOSS, TOKENS_PER_S = "train/loss", "val/loss", "train/tokens_per_s"


@dataclass
class Run:
    """One run folder's logged curves (step -> value; a resumed run's re-logged step keeps its last value)."""

    name: str
    folder: str
    world_size: int | None
    train_loss: dict[int, float]
    val_loss: dict[int, float]
    tokens_per_s: dict[int, float]
    summary: dict = field(repr=False)


def read_metrics(path: Path) -> dict[str, dict[int, float]]:
    """column -> {step: value} from a Lightning CSVLogger file (empty cells are columns not logged that row)."""
    columns: dict[str, dict[int, float]] = {}
    with open(path, newline="") as fh:
        for row in csv.DictReader(fh):
            step = int(row["step"])
            for key, value in row.items():
                if key not in ("step", "epoch") and value not in ("", None):
                    columns.setdefault(key, {})[step] = float(value)
    return columns


def load_run(name: str, folder: Path | str) -> Run:
    folder = Path(folder)
    metrics_file, summary_file = folder / "csv" / "metrics.csv", folder / "train_summary.json"
    for path, what in ((metrics_file, "logger=csv's metrics"), (summary_file, "the finished run's summary")):
        if not path.is_file():
            raise DFlash2Error(f"run {name}: {path} is missing ({what}); compare finished `logger=csv` runs")
    columns = read_metrics(metrics_file)
    if not columns.get(TRAIN_LOSS):
        raise DFlash2Error(f"run {name}: {metrics_file} has no {TRAIN_LOSS} column")
    summary = json.loads(summary_file.read_text())
    world = summary.get("world_size")
    if world is None and summary.get("training_peak_memory_per_rank"):  # summaries written before world_size
        world = len(summary["training_peak_memory_per_rank"]["allocated_gib"])
    return Run(
        name=name,
        folder=str(folder),
        world_size=None if world is None else int(world),
        train_loss=columns[TRAIN_LOSS],
        val_loss=columns.get(VAL_LOSS, {}),
        tokens_per_s=columns.get(TOKENS_PER_S, {}),
        summary=summary,
    )


def trailing_mean(curve: dict[int, float], window: int) -> dict[int, float]:
    """step -> mean of the `window` logged values ending at that step (steps with fewer before them are dropped)."""
    steps = sorted(curve)
    values = [curve[s] for s in steps]
    return {steps[i]: sum(values[i - window + 1 : i + 1]) / window for i in range(window - 1, len(steps))}


def curve_difference(a: dict[int, float], b: dict[int, float]) -> dict:
    """Largest and RMS |a - b| over the steps both curves have (None when they share none)."""
    common = sorted(set(a) & set(b))
    if not common:
        return {"steps_compared": 0, "max_abs": None, "rms": None}
    gaps = [abs(a[s] - b[s]) for s in common]
    return {
        "steps_compared": len(common),
        "max_abs": max(gaps),
        "max_abs_at_step": common[gaps.index(max(gaps))],
        "rms": math.sqrt(sum(g * g for g in gaps) / len(gaps)),
    }


def loss_parity(run: Run, baseline: Run, window: int) -> dict:
    return {
        "train_smoothed": curve_difference(
            trailing_mean(run.train_loss, window), trailing_mean(baseline.train_loss, window)
        ),
        "val": curve_difference(run.val_loss, baseline.val_loss),
    }


def within(parity: dict, noise: dict) -> bool | None:
    """Both of the run's largest differences at most the noise run's (None when a figure is missing)."""
    pairs = [(parity[k]["max_abs"], noise[k]["max_abs"]) for k in ("train_smoothed", "val")]
    if any(got is None or band is None for got, band in pairs):
        return None
    return all(got <= band for got, band in pairs)


def steady_throughput(run: Run, skip: float) -> dict | None:
    """Median and interquartile range of the global tokens/s after the first `skip` fraction of the steps."""
    if not run.tokens_per_s:
        return None
    last = max(run.tokens_per_s)
    values = sorted(v for s, v in run.tokens_per_s.items() if s > skip * last)
    if not values:
        return None
    quartiles = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return {"median": statistics.median(values), "q1": quartiles[0], "q3": quartiles[2], "points": len(values)}


def compare(runs: list[Run], baseline: str, noise: str | None, window: int = 5, skip: float = 0.1) -> dict:
    """The report as a dict: one entry per run (see the module docstring)."""
    by_name = {r.name: r for r in runs}
    if len(by_name) != len(runs):
        raise DFlash2Error("two runs share a name; give each NAME=FOLDER a distinct NAME")
    for role, name in (("--baseline", baseline), ("--noise", noise)):
        if name is not None and name not in by_name:
            raise DFlash2Error(f"{role} {name!r} is not one of the runs ({', '.join(by_name)})")
    base = by_name[baseline]
    base_tput = steady_throughput(base, skip)
    noise_parity = loss_parity(by_name[noise], base, window) if noise else None
    rows = []
    for run in runs:
        tput = steady_throughput(run, skip)
        per_gpu = scaling = None
        if tput and run.world_size:
            per_gpu = tput["median"] / run.world_size
            if base_tput and base.world_size:
                scaling = per_gpu / (base_tput["median"] / base.world_size)
        parity = None if run is base else loss_parity(run, base, window)
        tau = (run.summary.get("heldout_tau_measured") or {}).get("tau")
        rows.append(
            {
                "name": run.name,
                "folder": run.folder,
                "world_size": run.world_size,
                "steps": run.summary.get("steps", max(run.train_loss)),
                "final_train_loss_smoothed": trailing_mean(run.train_loss, window).get(max(run.train_loss)),
                "final_val_loss": run.val_loss[max(run.val_loss)] if run.val_loss else None,
                "loss_parity": parity,
                "within_noise": None
                if parity is None or noise_parity is None or run.name == noise
                else within(parity, noise_parity),
                "tokens_per_s": tput,
                "tokens_per_s_per_gpu": per_gpu,
                "scaling_efficiency": scaling,
                "peak_memory_per_rank": run.summary.get("training_peak_memory_per_rank"),
                "tau_measured": tau,
            }
        )
    return {
        "baseline": baseline,
        "noise": noise,
        "window": window,
        "skip": skip,
        "noise_band": noise_parity,
        "runs": rows,
    }


def _num(value, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def markdown(report: dict) -> str:
    """The report as two markdown tables (speed and memory; loss parity)."""
    lines = [
        "| run | GPUs | steps | tokens/s (global, median [IQR]) | per GPU | scaling "
        "| peak GiB per GPU (alloc / reserved) | τ |",
        "|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in report["runs"]:
        t = r["tokens_per_s"]
        tput = "–" if t is None else f"{t['median']:,.0f} [{t['q1']:,.0f}–{t['q3']:,.0f}]"
        mem = r["peak_memory_per_rank"]
        mem_text = (
            "–"
            if not mem
            else ", ".join(f"{a:.2f} / {b:.2f}" for a, b in zip(mem["allocated_gib"], mem["reserved_gib"]))
        )
        lines.append(
            f"| {r['name']} | {_num(r['world_size'], 'd')} | {r['steps']} | {tput} "
            f"| {_num(r['tokens_per_s_per_gpu'], ',.0f')} "
            f"| {_num(r['scaling_efficiency'], '.2f')} | {mem_text} | {_num(r['tau_measured'], '.3f')} |"
        )
    lines += [
        "",
        f"Loss against {report['baseline']} (train loss: trailing mean of {report['window']} logged points):",
        "",
        "| run | final train loss | final val loss | max abs Δ train (step) | RMS Δ train | max abs Δ val "
        "| within noise |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in report["runs"]:
        p = r["loss_parity"]
        if p is None:
            cells = "(baseline) | |"
        else:
            tr = p["train_smoothed"]
            at = "" if tr["max_abs"] is None else f" ({tr['max_abs_at_step']})"
            cells = f"{_num(tr['max_abs'], '.4f')}{at} | {_num(tr['rms'], '.4f')} | {_num(p['val']['max_abs'], '.4f')}"
        verdict = {True: "yes", False: "**no**", None: "–"}[r["within_noise"]]
        if r["name"] == report["noise"]:
            verdict = "(the noise band)"
        lines.append(
            f"| {r['name']} | {_num(r['final_train_loss_smoothed'], '.4f')} | {_num(r['final_val_loss'], '.4f')} "
            f"| {cells} | {verdict} |"
        )
    return "\n".join(lines)


def plot(runs: list[Run], window: int, path: Path) -> None:
    """Smoothed training loss (lines) and validation loss (markers) of every run against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for run in runs:
        smooth = trailing_mean(run.train_loss, window)
        (line,) = ax.plot(list(smooth), list(smooth.values()), label=f"{run.name} train (mean of {window})")
        if run.val_loss:
            ax.plot(
                list(run.val_loss), list(run.val_loss.values()), "o", color=line.get_color(), label=f"{run.name} val"
            )
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _named_folder(text: str) -> tuple[str, str]:
    name, sep, folder = text.partition("=")
    if not sep or not name or not folder:
        raise argparse.ArgumentTypeError(f"{text!r}: give NAME=FOLDER")
    return name, folder


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        prog="python -m dflash2.training.compare_runs",
        description="Compare drafter runs (1 GPU, another seed, DDP, FSDP): loss parity within the seed "
        "noise, tokens/s per GPU, scaling efficiency, peak memory per GPU, measured tau.",
    )
    parser.add_argument(
        "runs", nargs="+", type=_named_folder, metavar="NAME=FOLDER", help="run folders of logger=csv runs"
    )
    parser.add_argument("--baseline", help="the run the others are compared with (default: the first)")
    parser.add_argument(
        "--noise", help="a run of the baseline's recipe with another seed: its differences are the noise band"
    )
    parser.add_argument(
        "--window", type=int, default=5, help="logged points in the train-loss trailing mean (default 5)"
    )
    parser.add_argument("--skip", type=float, default=0.1, help="fraction of steps left out of tokens/s (default 0.1)")
    parser.add_argument("--plot", type=Path, help="write the loss curves to this PNG")
    parser.add_argument("--json", type=Path, help="write the report to this JSON file")
    args = parser.parse_args(argv)
    if args.window < 1 or not 0 <= args.skip < 1:
        parser.error("--window must be >= 1 and --skip in [0, 1)")
    runs = [load_run(name, folder) for name, folder in args.runs]
    report = compare(runs, args.baseline or runs[0].name, args.noise, args.window, args.skip)
    print(markdown(report))
    if args.plot:
        plot(runs, args.window, args.plot)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    try:
        main()
    except DFlash2Error as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
