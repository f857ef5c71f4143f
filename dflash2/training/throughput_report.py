"""What ``bench_throughput`` prints and writes: the Markdown table, the MFU formula, the profile's top
kernels and the environment of the run. No measuring here."""

from __future__ import annotations

import platform
import sys

import torch

# NVIDIA's H200 datasheet (nvidia.com/en-us/data-center/h200) gives the H200 SXM 1,979 BF16 Tensor Core
# TFLOPS, a figure "with sparsity"; dense is half: 989.4 TFLOPS, the same as the H100 SXM (same GH100 die,
# SM count and clocks). The H200 NVL's figure is lower: pass --peak-tflops there.
H200_BF16_DENSE_FLOPS = 989.4e12

MFU_FORMULA = """\
MFU = model FLOPs per step / median step time / peak dense bf16 FLOP/s, with model FLOPs per step
(2 per multiply-add, matmuls only; dflash2/training/throughput_flops.py) =
  drafter linear layers: 6 x weights x rows multiplied (k/v_proj over context + block tokens; q/o_proj,
    MLP and conv projections over block tokens); 4 x for fc (context tokens) and the selector's
    hidden_projection (drafted positions), whose inputs need no gradient
+ drafter attention: 12 x heads x head_dim x layers x attended (query, key) pairs: only the pairs the
    block mask allows (block j: anchor_j context keys + its B own keys, per query), for flex and dense alike
+ frozen LM head: 4 x hidden x vocab x drafted positions (forward + gradient to the hidden states; no
    weight gradient; the chunked CE's recompute in backward not counted)
+ online rows only, the frozen target's forward: 2 x decoder linear weights x sequence tokens + causal
    attention 4 x heads x head_dim x layers x seq(seq+1)/2 per row (tap_features runs no LM head).
"MFU excl. target" leaves the target forward out of the numerator, not out of the step time."""

COLUMNS = (
    ("variant", "attention / loss through the LM head / target features"),
    ("step ms", "median over repeats of the mean step time of a repeat (min-max over repeats)"),
    ("drafted tok/s", "rows x valid anchors x (B-1) per step / median step time: the supervised block tokens"),
    ("seq tok/s", "rows x sequence length per step / median step time: the sequence tokens"),
    ("peak GiB", "torch.cuda.max_memory_allocated over the variant's steps (target and drafter included)"),
    ("TFLOP/s", "model FLOPs per step (all parts) / median step time"),
    ("MFU", "model FLOPs incl. the target forward (online rows) / step time / peak"),
    ("MFU excl. target", "model FLOPs without the target forward / step time / peak"),
)


def _fmt(value, spec: str, missing: str = "n/a") -> str:
    return missing if value is None else format(value, spec)


def markdown_table(rows: list[dict]) -> str:
    """One line per variant; rows that did not run (skipped, OOM, error) say why in the last column."""
    head = [name for name, _ in COLUMNS] + ["status"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 2) + ["---"]) + "|"]
    for r in rows:
        if r["status"] != "ok":
            cells = [r["variant"]] + [""] * (len(head) - 2) + [f"{r['status']}: {r.get('note', '')}".rstrip(": ")]
        else:
            ms = r["step_ms"]
            cells = [
                r["variant"],
                f"{ms['median']:.1f} ({ms['min']:.1f}-{ms['max']:.1f})",
                f"{r['drafted_tokens_per_s']:,.0f}",
                f"{r['sequence_tokens_per_s']:,.0f}",
                _fmt(r["peak_memory_gib"], ".1f"),
                f"{r['model_tflops_per_s']:.3g}",
                _fmt(None if r["mfu"] is None else 100 * r["mfu"], ".1f") + ("%" if r["mfu"] is not None else ""),
                _fmt(None if r["mfu_excl_target"] is None else 100 * r["mfu_excl_target"], ".1f")
                + ("%" if r["mfu_excl_target"] is not None else ""),
                "ok" + (f" ({r['note']})" if r.get("note") else ""),
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def flops_lines(rows: list[dict], peak: float | None) -> list[str]:
    """The formula, the peak it divides by, and each variant's model TFLOPs per step by part."""
    out = [
        *MFU_FORMULA.splitlines(),
        f"Peak: {_fmt(None if peak is None else peak / 1e12, '.4g')} TFLOP/s (--peak-tflops).",
    ]
    for r in rows:
        f = r.get("flops_per_step")
        if f:
            out.append(
                f"  {r['variant']}: TFLOPs per step = drafter linear {f['drafter_linear'] / 1e12:.4g} "
                f"+ attention {f['drafter_attention'] / 1e12:.4g} + LM head {f['lm_head'] / 1e12:.4g} "
                f"+ target forward {f['target_forward'] / 1e12:.4g} = {f['total'] / 1e12:.4g}"
            )
    return out


def column_lines() -> list[str]:
    return [f"  {name}: {meaning}" for name, meaning in COLUMNS]


NOT_OPERATORS = {"Command Buffer Full"}  # profiler events with device time that are not operators


def top_kernels(prof, device_type: str, limit: int = 10) -> dict:
    """The ``limit`` largest self times of one profiled step: CUDA kernels on a GPU, CPU operators on the
    CPU (it has no kernels). Returns {"what", "total_ms", "rows": [{"name", "calls", "ms", "share"}]}; on a
    GPU also "ops": the operators whose own launches took the most kernel time (a kernel's time counted
    once, against the innermost operator that launched it), which names what a kernel was doing."""
    from torch.autograd import DeviceType

    events = prof.key_averages()
    if device_type == "cuda":
        picked = [e for e in events if e.device_type == DeviceType.CUDA]
        time_of, what = (lambda e: e.self_device_time_total), "CUDA kernels"
    else:
        picked = list(events)
        time_of, what = (lambda e: e.self_cpu_time_total), "CPU operators (self time; no kernels on the CPU)"
    total = sum(time_of(e) for e in picked) or 1.0

    def rows(chosen, time):
        top = sorted(chosen, key=time, reverse=True)[:limit]
        return [{"name": e.key, "calls": int(e.count), "ms": time(e) / 1e3, "share": time(e) / total} for e in top]

    out = {"what": what, "total_ms": total / 1e3, "rows": rows(picked, time_of)}
    if device_type == "cuda":
        # "Command Buffer Full" is CUPTI's marker for a launch that waited on a full queue, not an operator: it
        # would claim the kernels of every launch it covered (88% of a training step)
        launched = [
            e
            for e in events
            if e.device_type == DeviceType.CPU and e.self_device_time_total > 0 and e.key not in NOT_OPERATORS
        ]
        out["ops"] = rows(launched, lambda e: e.self_device_time_total)
    return out


def _ranked(rows: list[dict], what: str) -> list[str]:
    """A profile's ranked rows as a markdown table: rank, `name` (cut at 90 characters), calls, ms, share."""
    lines = [f"| # | {what} | calls | ms | share |", "|---:|---|---:|---:|---:|"]
    for i, r in enumerate(rows, start=1):
        name = r["name"] if len(r["name"]) <= 90 else r["name"][:87] + "..."
        lines.append(f"| {i} | `{name}` | {r['calls']} | {r['ms']:.2f} | {100 * r['share']:.1f}% |")
    return lines


def profile_table(profile: dict) -> str:
    lines = [
        f"Top {len(profile['rows'])} {profile['what']} of one step of {profile['variant']} "
        f"(sum of all: {profile['total_ms']:.1f} ms; step wall time {profile['step_ms']:.1f} ms):",
        *_ranked(profile["rows"], "kernel"),
    ]
    if profile.get("ops"):
        lines += [
            "",
            f"Top {len(profile['ops'])} operators by the kernel time of their own launches (same step):",
            *_ranked(profile["ops"], "operator"),
        ]
    if profile.get("trace"):
        lines.append(f"Chrome trace of the step: {profile['trace']}")
    return "\n".join(lines)


def environment(device: torch.device) -> dict:
    """Versions and the device: what a number in docs/BENCHMARKS.md has to name."""
    import lightning
    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    env = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "triton": triton_version,
        "transformers": transformers.__version__,
        "lightning": lightning.__version__,
        "cuda": torch.version.cuda,
        "platform": platform.platform(),
        "device": str(device),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env["device_name"] = props.name
        env["device_memory_gib"] = round(props.total_memory / 2**30, 1)
    else:
        env["device_name"] = platform.processor() or "cpu"
        env["cpu_threads"] = torch.get_num_threads()
    return env
