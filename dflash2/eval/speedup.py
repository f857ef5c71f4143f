"""``eval.speedup``: what speculative decoding buys, measured in one run on one device (docs/ARCHITECTURE.md §6).

For each batch size, on the same prompts and weights:

    (a) HF ``generate``, greedy                 what users have today
    (b) runtime AR decode (CUDA graphs on GPU)  the honest baseline
    (c) runtime speculative decode              the drafter's worth

Each is warmed up (a full generation: graphs captured, kernels compiled) and then run
``runs`` times; reported are the median and the spread (min, max) over runs of the
per-run median step time, tokens/s (generated tokens over wall time, prefill
included), τ, and the step-time breakdown (draft / verify / accept / commit = rollback,
and the host gap between steps, from CUDA events between phases). The weight-read bound
is the model's weight bytes (one read per step) over the device-to-device copy bandwidth
measured in the same run; the AR step's fraction of it and the achieved GB/s are printed
beside. Lossless: (c) must equal (b) token for token; the first divergence is reported
with the target's logit margin between the two tokens in the run's dtype. Random-weight
shapes give real step times but meaningless τ: speedups there are predictions from a
given τ and the measured step times, and labelled so.

Hydra-free (the CLI is ``dflash2.eval.speedup_cli``); :func:`run_speedup` returns the results dict.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path

import torch

from dflash2.runtime import Decoder, kernels
from dflash2.runtime.graphs import PhaseTimer

PHASES = ("draft", "verify", "accept", "commit", "gap")


# ----------------------------------------------------------------------------- ceilings
def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device, nbytes: int, reps: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + written), median of ``reps`` copies."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    times = []
    for i in range(reps + 3):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        if i >= 3:  # warm-up first
            times.append(time.perf_counter() - t0)
    return 2 * nbytes / statistics.median(times)


def weight_bytes(model) -> int:
    """Bytes one decode step reads: every parameter once, except the embedding table (one row is read)
    unless the LM head is tied to it (then it is read once, as the head)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    tied = model.lm_head.weight is model.embed.weight
    return total if tied else total - model.embed.weight.numel() * model.embed.weight.element_size()


def _stats(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


# ----------------------------------------------------------------------------- (a) HF generate
@torch.no_grad()
def time_hf(hf, prompts: list[list[int]], new_tokens: int, runs: int) -> dict:
    """HF ``generate`` (greedy, its default dynamic cache), exactly ``new_tokens`` per row; left-padded batch."""
    device = hf.get_input_embeddings().weight.device
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    kw = dict(attention_mask=mask, do_sample=False, pad_token_id=0, temperature=None, top_p=None, top_k=None)

    def gen(n):
        return hf.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)

    gen(2)  # warm-up
    walls, out = [], None
    for _ in range(runs):
        _sync(device)
        t0 = time.perf_counter()
        out = gen(new_tokens)
        _sync(device)
        walls.append(time.perf_counter() - t0)
    n = len(prompts) * new_tokens
    return {
        "ms_per_step": _stats([w * 1e3 / new_tokens for w in walls]),
        "tokens_per_s": _stats([n / w for w in walls]),
        "new_tokens": new_tokens,
        "sequences": out[:, width:].tolist(),
    }


# ----------------------------------------------------------------------------- (b), (c) runtime
def time_runtime(dec: Decoder, prompts, new_tokens: int, runs: int, spec: bool, progress=None) -> dict:
    """Warm-up generation, then ``runs`` timed ones with per-phase CUDA events."""

    def gen():
        if spec:
            res = dec.generate_spec(prompts, new_tokens)
            return res.sequences, res
        return dec.generate_ar(prompts, new_tokens), None

    gen()  # warm-up: first uses run eagerly, second uses capture
    per_run, walls, toks, res, seqs = [], [], [], None, None
    for _ in range(runs):
        dec.timer = PhaseTimer(dec.device)
        _sync(dec.device)
        t0 = time.perf_counter()
        seqs, res = gen()
        _sync(dec.device)
        walls.append(time.perf_counter() - t0)
        per_run.append({k: statistics.median(v) for k, v in dec.timer.summary().items()})
        toks.append(sum(len(s) for s in seqs))
        dec.timer = None
        if progress is not None:
            progress.update(1)
    out = {
        "ms_per_step": _stats([r["step"] for r in per_run]),
        "tokens_per_s": _stats([t / w for t, w in zip(toks, walls)]),
        "phases_ms": {p: _stats([r[p] for r in per_run]) for p in PHASES if all(p in r for r in per_run)},
        "new_tokens": new_tokens,
        "sequences": seqs,
    }
    if res is not None:
        out["tau"] = res.mean_tau
        out["steps"] = sum(res.steps)
    return out


def first_divergence(model, prompts, ref, got) -> dict | None:
    """First (row, position) where ``got`` differs from ``ref``, with the target's logits of both tokens there.

    The logits come from one eager prefill of prompt + the common prefix in the model's dtype: a margin
    near that dtype's rounding is numerics of two kernels (T=1 vs T=B), a large one a bug.
    """
    for r, (a, b) in enumerate(zip(ref, got)):
        i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if i is None:
            if len(a) != len(b):
                return {"row": r, "position": min(len(a), len(b)), "lengths": [len(a), len(b)]}
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
            "row": r,
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


# ----------------------------------------------------------------------------- profile
GEMM_WORDS = ("gemm", "gemv", "nvjet", "xmma", "cutlass", "splitk", "matmul")
ATTENTION_WORDS = ("fmha", "sdpa", "attention", "flash")  # cutlass / cuDNN attention kernels are not GEMVs


def is_gemm(kernel: str) -> bool:
    name = kernel.lower()
    return any(w in name for w in GEMM_WORDS) and not any(w in name for w in ATTENTION_WORDS)


def profile_ar_step(dec: Decoder, N: int, reps: int = 5) -> dict:
    """Kernels of one AR forward (the captured graph replayed ``reps`` times; eager if none is captured).

    Returns per-step totals, the GEMM share and the top kernels by time.
    """
    from torch.profiler import ProfilerActivity, profile

    s = dec.slot(N)
    graphs = {k: g for k, g in s.graphs.graphs.items() if k[0] == "ar_forward"}
    if graphs:
        graph = graphs[max(graphs)]
        fn, how = graph.replay, "graph replay"
    else:
        fn, how = (lambda: dec.model(s.token[:, None], s.state)), "eager"
    fn()
    _sync(dec.device)
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        _sync(dec.device)
    rows = []
    for e in prof.key_averages():
        if getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        us = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)
        rows.append((e.key, us / reps, e.count / reps))
    rows.sort(key=lambda r: -r[1])
    total = sum(r[1] for r in rows)
    gemm = sum(r[1] for r in rows if is_gemm(r[0]))
    return {
        "how": how,
        "kernel_us_per_step": total,
        "kernels_per_step": sum(r[2] for r in rows),
        "gemm_us_per_step": gemm,
        "top": [{"kernel": k[:120], "us_per_step": us, "calls_per_step": c} for k, us, c in rows[:15]],
    }


# ----------------------------------------------------------------------------- the run
def run_speedup(
    pair,
    *,
    batch_sizes,
    max_new_tokens: int,
    hf_new_tokens: int,
    runs: int,
    copy_bytes: int,
    predict_taus=(),
    profile: bool = True,
    ablate_kernels: bool = True,
    output_dir=None,
    log=print,
    extra: dict | None = None,
) -> dict:
    """Measure (a), (b), (c) for each batch size on ``pair`` (speedup_setup.Pair); write results if output_dir.

    extra: settings recorded in the results as they are (e.g. the attention backend)."""
    target, drafter = pair.target, pair.drafter
    device = target.embed.weight.device
    B = drafter.block_size
    longest = max(len(p) for p in pair.prompts)
    max_len = longest + max_new_tokens + B + 1
    bw = copy_bandwidth(device, copy_bytes)
    wbytes = weight_bytes(target)
    bound_ms = wbytes / bw * 1e3
    results = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(target.embed.weight.dtype).removeprefix("torch."),
        "label": pair.label,
        "random_weights": pair.random,
        "block_size": B,
        "copy_bandwidth_GBps": bw / 1e9,
        "weight_bytes": wbytes,
        "bound_ms_per_step": bound_ms,
        **(extra or {}),
        "batches": {},
    }
    where = f"{pair.label} on {results['device']}"
    log(f"{where}: weights {wbytes / 1e9:.3g} GB, copy {bw / 1e9:.0f} GB/s, bound {bound_ms:.3f} ms/step")
    dec = Decoder(target, drafter, max_len=max_len)
    progress = _progress(len(batch_sizes) * 2 * runs)
    for N in batch_sizes:
        prompts = [pair.prompts[i % len(pair.prompts)] for i in range(N)]
        row = {}
        if pair.hf is not None and hf_new_tokens > 0:
            row["hf"] = time_hf(pair.hf, prompts, hf_new_tokens, runs)
        row["ar"] = time_runtime(dec, prompts, max_new_tokens, runs, spec=False, progress=progress)
        row["spec"] = time_runtime(dec, prompts, max_new_tokens, runs, spec=True, progress=progress)
        ar, spec = row["ar"], row["spec"]
        step = ar["ms_per_step"]["median"]
        row["ar_fraction_of_bound"] = bound_ms / step
        row["ar_weight_GBps"] = wbytes / step / 1e6
        row["verify_over_ar_step"] = spec["phases_ms"]["verify"]["median"] / step
        row["lossless"] = spec["sequences"] == ar["sequences"]
        row["divergence"] = (
            None if row["lossless"] else first_divergence(target, prompts, ar["sequences"], spec["sequences"])
        )
        if "hf" in row:
            n = row["hf"]["new_tokens"]
            row["hf_prefix_equals_ar"] = [h[:n] == a[:n] for h, a in zip(row["hf"]["sequences"], ar["sequences"])]
        row["speedup_measured"] = spec["tokens_per_s"]["median"] / ar["tokens_per_s"]["median"]
        spec_step = spec["ms_per_step"]["median"]
        row["predicted"] = [{"tau": t, "speedup": t * step / spec_step, "label": "prediction"} for t in predict_taus]
        results["batches"][str(N)] = row
        log(_row_line(N, row, bound_ms))
    if profile and device.type == "cuda":
        results["profile_ar_batch1"] = profile_ar_step(dec, 1)
    if ablate_kernels and device.type == "cuda":
        with kernels.kernels(False):  # the same graphs with the eager twins inside: what the fusion buys
            plain = Decoder(target, None, max_len=max_len)
            prompts = pair.prompts[:1]
            results["ablation_ar_batch1_no_fused_kernels"] = _strip(
                time_runtime(plain, prompts, max_new_tokens, runs, spec=False)
            )
    if progress is not None:
        progress.close()
    for row in results["batches"].values():
        for k in ("hf", "ar", "spec"):
            if k in row:
                row[k] = _strip(row[k])
    if output_dir is not None:
        write_results(results, Path(output_dir))
    return results


def _strip(d: dict) -> dict:
    """Drop the token lists (kept only for the comparisons) from a timing dict."""
    return {k: v for k, v in d.items() if k != "sequences"}


def _progress(total: int):
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="timed generations", leave=False)


def _row_line(N: int, row: dict, bound_ms: float) -> str:
    ar, spec = row["ar"], row["spec"]
    hf = f"HF {row['hf']['tokens_per_s']['median']:.1f} tok/s, " if "hf" in row else ""
    return (
        f"batch {N}: {hf}AR {ar['ms_per_step']['median']:.3f} ms/step ({row['ar_fraction_of_bound']:.0%} of bound "
        f"{bound_ms:.3f}), spec {spec['ms_per_step']['median']:.3f} ms/step tau {spec['tau']:.2f}, "
        f"verify/AR {row['verify_over_ar_step']:.2f}, lossless {row['lossless']}"
    )


# ----------------------------------------------------------------------------- report
def _fmt(s: dict, digits: int = 2) -> str:
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}–{s['max']:.{digits}f}]"


def markdown(results: dict) -> str:
    bound = results["bound_ms_per_step"]
    lines = [
        f"# eval.speedup — {results['label']}",
        "",
        f"{results['date']}, {results['device']}, {results['dtype']}, block {results['block_size']}, "
        f"attention {results.get('attention', 'default')}; "
        f"weights read per step {results['weight_bytes'] / 1e9:.4g} GB, copy bandwidth "
        f"{results['copy_bandwidth_GBps']:.0f} GB/s (measured in this run) -> bound {bound:.3f} ms/step. "
        "Median [min–max] over runs.",
        "",
        "| batch | method | ms/step | tokens/s | τ | weight GB/s | % of bound | lossless |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for N, row in results["batches"].items():
        for name, key in (("HF generate", "hf"), ("runtime AR", "ar"), ("runtime spec", "spec")):
            if key not in row:
                continue
            r = row[key]
            ms = r["ms_per_step"]["median"]
            tau = f"{r['tau']:.2f}" if "tau" in r else "1"
            gbps = results["weight_bytes"] / ms / 1e6
            frac = f"{bound / ms:.0%}" if key != "spec" else "—"
            lossless = "" if key != "spec" else ("true" if row["lossless"] else "FALSE")
            lines.append(
                f"| {N} | {name} | {_fmt(r['ms_per_step'], 3)} | {_fmt(r['tokens_per_s'], 1)} | {tau} | "
                f"{gbps:.4g} | {frac} | {lossless} |"
            )
    lines += ["", "Step breakdown (ms, median over runs of the per-run median):", ""]
    lines += ["| batch | method | " + " | ".join(PHASES) + " |", "|---|---|" + "---|" * len(PHASES)]
    for N, row in results["batches"].items():
        for key in ("ar", "spec"):
            ph = row[key]["phases_ms"]
            cells = [f"{ph[p]['median']:.3f}" if p in ph else "—" for p in PHASES]
            lines.append(f"| {N} | {key} | " + " | ".join(cells) + " |")
    lines.append("")
    for N, row in results["batches"].items():
        lines.append(
            f"- batch {N}: verify-{results['block_size']} / AR step = {row['verify_over_ar_step']:.2f}; "
            f"measured spec/AR tokens/s = {row['speedup_measured']:.2f}"
            + (
                ""
                if results["random_weights"]
                else f" (τ {row['spec']['tau']:.2f}, 0.6·τ = {0.6 * row['spec']['tau']:.2f})"
            )
        )
        for p in row["predicted"]:
            lines.append(f"  - **prediction** at τ = {p['tau']:.2f}: speedup {p['speedup']:.2f}× over runtime AR")
        if row["divergence"]:
            lines.append(f"  - first divergence: {json.dumps(row['divergence'])}")
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
    abl = results.get("ablation_ar_batch1_no_fused_kernels")
    if abl:
        lines += [
            "",
            f"Ablation: runtime AR batch 1 without the fused kernels (eager twins in the graphs): "
            f"{_fmt(abl['ms_per_step'], 3)} ms/step ({bound / abl['ms_per_step']['median']:.0%} of bound).",
        ]
    return "\n".join(lines) + "\n"


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
        for key in ("ar", "spec"):
            labels.append(f"{key} b{N}")
            for p in PHASES:
                stacks[p].append(row[key]["phases_ms"].get(p, {"median": 0.0})["median"])
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


def write_results(results: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2, default=_json_default))
    (out / "results.md").write_text(markdown(results))
    plot_breakdown(results, out / "step_breakdown.png")


def _json_default(x):
    if isinstance(x, float) and math.isnan(x):
        return None
    return str(x)
