"""Decode-step GEMMs per call: cuBLAS (F.linear; x @ Wᵀ pre-transposed) vs the Triton skinny GEMM.

    python -m dflash2.runtime.bench_gemm --device cuda                        # Qwen3-8B shapes, M 1 / 8 / 16, sweep
    python -m dflash2.runtime.bench_gemm --device cuda --out gemm.json        # rows as JSON too
    python -m dflash2.runtime.bench_gemm --device cuda --no-sweep --m 1       # cuBLAS vs the default plan only
    python -m dflash2.runtime.bench_gemm --device cuda --options '{"block_n": 32, "split_k": 2}'   # given configs
    python -m dflash2.runtime.bench_gemm --device cpu --quick                 # smoke test (Triton's interpreter)

What each projection of a Qwen3-8B decode step costs: y = x @ Wᵀ with x (M, K) bf16 and W (N, K)
for q|k|v 4096 -> 6144, o_proj 4096 -> 4096, gate|up 4096 -> 24576, down 12288 -> 4096 (each 36
times a step) and lm_head 4096 -> 151936 (once), at M = 1, 8, 16 rows (AR at batch 1 / 8, a
block-16 verify at batch 1). Methods: ``cublas`` = F.linear(x, W) (what the models run);
``cublas_t`` = x @ Wt with Wt (K, N) contiguous (cuBLAS picks other kernels for that layout);
``skinny`` = :func:`~dflash2.runtime.kernels.skinny_gemm.skinny_linear` with its default plan;
``skinny:<options>`` = the kernel with the options of the sweep (:data:`SWEEP`) or ``--options``.

Timing: the weights must come from HBM, as in a step where every layer has its own. Each method
cycles through enough copies of W that they total ≥ ``--cycle-mib`` (default 512 MiB, ten times
the H200's 50 MiB L2; lm_head, 1.2 GiB, is one copy): one pass over the copies (a call per copy)
is captured as a CUDA graph (no Python launch overhead, as in the runtime's graphed step),
replayed ``--warmup`` times, then ``--iters`` times between CUDA events; µs per call is the
median replay ÷ the copies. ``GB/s`` is W's bytes ÷ that time (x and y are small next to W),
``%copy`` that against the device-to-device copy bandwidth measured first (bytes read + written
÷ time, :func:`dflash2.eval.speedup.copy_bandwidth`: the bound the runtime's step-time report
uses). ``max|Δ|`` compares the output with the fp32 twin; ``inv`` says whether each row of the
M-row call equals, bit for bit, the same row in a call of max(16, M) rows (batch invariance: what lossless
AR vs verify decoding needs; cuBLAS picks kernels per M, so it need not hold there). The last
lines sum a step (36 × the four layer GEMMs + lm_head) per M for cuBLAS, the better of the two
cuBLAS layouts, the kernel's default plan and the best kernel option per shape.

``--device cpu --quick`` runs tiny shapes through Triton's interpreter without graphs or weight
copies: a smoke test; its times mean nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from dflash2.runtime import kernels
from dflash2.runtime.kernels.skinny_gemm import plan, skinny_linear, skinny_linear_ref

MiB = 2**20
LAYERS = 36  # Qwen3-8B's decoder layers: each runs the four layer GEMMs once per step
# (N, K) of W, as nn.Linear stores it; Qwen3-8B: hidden 4096, 32 q / 8 kv heads of 128, intermediate 12288
QWEN3_8B = {
    "qkv": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up": (24576, 4096),
    "down": (4096, 12288),
    "lm_head": (151936, 4096),
}
TINY = {"tiny_a": (45, 83), "tiny_b": (40, 64)}  # --quick: odd sizes, then an even K
LAYER_GEMMS = ("qkv", "o_proj", "gate_up", "down")

# the kernel's options swept per shape (a modest list, not a grid: every entry is one compile)
SWEEP = [
    dict(block_n=16, block_k=256),
    dict(block_n=32, block_k=256),
    dict(block_n=64, block_k=256),
    dict(block_n=32, block_k=128),
    dict(block_n=64, block_k=128),
    dict(block_n=16, block_k=512),
    dict(block_n=16, block_k=256, num_stages=6),
    dict(block_n=32, block_k=256, num_stages=6),
    dict(block_n=32, block_k=256, num_warps=8),
    dict(block_n=64, block_k=256, swap=True),
    dict(block_n=128, block_k=128, swap=True),
    dict(block_n=32, block_k=256, split_k=2),
    dict(block_n=64, block_k=256, split_k=4),
    dict(block_n=32, block_k=256, split_k=2, reduce="fused"),
    dict(block_n=64, block_k=256, split_k=4, reduce="fused"),
]
QUICK_SWEEP = [dict(block_n=16, block_k=32), dict(block_n=32, block_k=16, split_k=3, reduce="fused")]


@dataclass
class Row:
    shape: str
    N: int
    K: int
    M: int
    method: str
    options: dict  # the kernel options given ({} for cuBLAS and the default plan)
    plan: dict  # the kernel's resolved launch plan ({} for cuBLAS)
    us: float  # per call, median over replays
    weight_bytes: int
    gbps: float  # weight bytes / time
    pct_copy: float  # gbps / the measured copy bandwidth, in %
    max_abs_diff: float  # vs the fp32 twin (M rows)
    batch_invariant: bool  # rows equal to the same rows of the largest call (16 rows by default), bit for bit


def _label(options: dict) -> str:
    return "skinny:" + ",".join(f"{k}={v}" for k, v in options.items())


def _method_fn(method: str, options: dict):
    """fn(x, W, Wt) -> y of one method."""
    if method == "cublas":
        return lambda x, w, wt: F.linear(x, w)
    if method == "cublas_t":
        return lambda x, w, wt: x @ wt
    return lambda x, w, wt: skinny_linear(x, w, **options)


def _time(call, n_copies: int, device: torch.device, iters: int, warmup: int) -> float:
    """Median µs per call of ``call(i)`` (i: the weight copy), over a CUDA graph of one pass over the copies."""
    if device.type != "cuda":
        for _ in range(warmup):
            call(0)
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            call(0)
            times.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(times)
    side = torch.cuda.Stream(device)  # compile / warm up outside any capture, on a side stream
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for i in range(n_copies):
            call(i)
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(n_copies):
            call(i)
    for _ in range(warmup):
        graph.replay()
    times = []
    for _ in range(iters):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        graph.replay()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) * 1e3)  # ms -> µs
    del graph
    return statistics.median(times) / n_copies


def bench_shape(
    name: str,
    N: int,
    K: int,
    Ms: list[int],
    configs: list[dict],
    *,
    dtype=torch.bfloat16,
    device="cuda",
    iters: int = 10,
    warmup: int = 2,
    cycle_bytes: int = 512 * MiB,
    copy_bw: float = float("nan"),
) -> list[Row]:
    """Rows for one weight shape: every method at every M (see the module docstring)."""
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(0)
    wbytes = N * K * torch.empty(0, dtype=dtype).element_size()
    n_copies = max(1, -(-cycle_bytes // wbytes)) if device.type == "cuda" else 1
    ws = [(torch.randn(N, K, generator=g, device=device) / K**0.5).to(dtype) for _ in range(n_copies)]
    x_all = torch.randn(max([*Ms, 16]), K, generator=g, device=device).to(dtype)  # rows of every call
    refs = {M: skinny_linear_ref(x_all[:M], ws[0]).float() for M in Ms}
    methods = [("cublas", {}), ("cublas_t", {}), ("skinny", {})] + [(_label(c), c) for c in configs]
    rows = []
    for method, options in methods:
        wts = [w.T.contiguous() for w in ws] if method == "cublas_t" else [None] * n_copies
        try:
            rows += _measure(name, method, options, ws, wts, x_all, refs, Ms, device, iters, warmup, copy_bw)
        except Exception as e:  # e.g. out of shared memory for this tile: not a candidate
            print(f"  skip {name} {method}: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}")
    return rows


def _measure(name, method, options, ws, wts, x_all, refs, Ms, device, iters, warmup, copy_bw) -> list[Row]:
    """One method's rows at every M: outputs checked against the twin and the largest call, then timed."""
    fn = _method_fn(method, options)
    N, K = ws[0].shape
    wbytes = ws[0].numel() * ws[0].element_size()
    full = fn(x_all, ws[0], wts[0])
    rows = []
    for M in Ms:
        x = x_all[:M]
        y = fn(x, ws[0], wts[0])
        diff = (y.float() - refs[M]).abs().max().item()
        inv = bool(torch.equal(y, full[:M]))
        us = _time(lambda i, x=x: fn(x, ws[i], wts[i]), len(ws), device, iters, warmup)
        launch = {} if method.startswith("cublas") else plan(N, K, x.dtype, device, **options)
        gbps = wbytes / (us * 1e-6) / 1e9
        rows.append(
            Row(name, N, K, M, method, options, launch, us, wbytes, gbps, 100 * gbps * 1e9 / copy_bw, diff, inv)
        )
    return rows


def _best(rows: list[Row], prefix: str) -> Row | None:
    cands = [r for r in rows if r.method.startswith(prefix)]
    return min(cands, key=lambda r: r.us) if cands else None


def report(rows: list[Row], copy_bw: float) -> str:
    """A compact table: per (shape, M) cuBLAS, cuBLAS on Wt, the default plan, the best option; then per-step sums."""
    lines = [
        f"copy bandwidth {copy_bw / 1e9:.0f} GB/s (read + write); µs per call (% of copy bandwidth), inv: rows "
        "bit-identical to the same rows of the largest call",
        "",
        "| shape | N x K | M | cuBLAS | cuBLAS Wt | skinny default | best skinny | best options | inv cuBLAS/skinny |",
        "|---|---|---:|---:|---:|---:|---:|---|---|",
    ]

    def cell(r):
        return f"{r.us:.1f} ({r.pct_copy:.0f}%)" if r else "-"

    keys = list(dict.fromkeys((r.shape, r.M) for r in rows))
    for shape, M in keys:
        sub = [r for r in rows if r.shape == shape and r.M == M]
        by = {r.method: r for r in sub}
        best = _best(sub, "skinny")
        inv_k = "yes" if all(r.batch_invariant for r in sub if r.method.startswith("skinny")) else "NO"
        inv_c = "yes" if by.get("cublas") and by["cublas"].batch_invariant else "no"
        opts = best.method if best else "-"
        N, K = sub[0].N, sub[0].K
        lines.append(
            f"| {shape} | {N} x {K} | {M} | {cell(by.get('cublas'))} | {cell(by.get('cublas_t'))} "
            f"| {cell(by.get('skinny'))} | {cell(best)} | {opts} | {inv_c}/{inv_k} |"
        )
    shapes = {r.shape for r in rows}
    if set(LAYER_GEMMS) | {"lm_head"} <= shapes:
        lines.append("")
        lines.append(f"per step ({LAYERS} x (q|k|v + o_proj + gate|up + down) + lm_head), ms:")
        for M in sorted({r.M for r in rows}):
            sums = {}
            for label, pick in (
                ("cuBLAS", lambda s: [r for r in s if r.method == "cublas"]),
                ("best cuBLAS", lambda s: [r for r in s if r.method.startswith("cublas")]),
                ("skinny default", lambda s: [r for r in s if r.method == "skinny"]),
                ("best skinny", lambda s: [r for r in s if r.method.startswith("skinny")]),
                ("best of all", lambda s: s),
            ):
                total = 0.0
                for shape in (*LAYER_GEMMS, "lm_head"):
                    cands = pick([r for r in rows if r.shape == shape and r.M == M])
                    if not cands:
                        total = float("nan")
                        break
                    total += min(r.us for r in cands) * (1 if shape == "lm_head" else LAYERS)
                sums[label] = total / 1e3
            lines.append(f"  M={M}: " + ", ".join(f"{k} {v:.3f}" for k, v in sums.items()))
    return "\n".join(lines)


def main(argv=None) -> list[Row]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--m", type=int, nargs="+", default=None, help="rows per call (default 1 8 16; --quick: 1 3)")
    p.add_argument("--shapes", nargs="+", default=None, help=f"subset of {list(QWEN3_8B)}")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--cycle-mib", type=int, default=512, help="weight copies per method total at least this")
    p.add_argument("--no-sweep", action="store_true", help="only cuBLAS and the kernel's default plan")
    p.add_argument(
        "--options",
        type=json.loads,
        action="append",
        default=None,
        help='kernel options as JSON, e.g. \'{"block_n": 32, "split_k": 2}\'; repeat for several (replaces the sweep)',
    )
    p.add_argument("--quick", action="store_true", help="tiny shapes, a two-entry sweep (CPU smoke test)")
    p.add_argument("--out", default=None, help="also write the rows as JSON here")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    table = TINY if args.quick else QWEN3_8B
    shapes = {k: table[k] for k in (args.shapes or table)}
    Ms = args.m or ([1, 3] if args.quick else [1, 8, 16])
    configs = args.options or ([] if args.no_sweep else (QUICK_SWEEP if args.quick else SWEEP))
    dtype = getattr(torch, args.dtype)
    if device.type == "cuda":
        from dflash2.eval.speedup import copy_bandwidth

        copy_bw = copy_bandwidth(device, 1024 * MiB)
    else:
        copy_bw = float("nan")
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), {args.dtype}")
    t0 = time.perf_counter()
    rows = []
    with kernels.on_cpu() if device.type == "cpu" else nullcontext():
        for name, (N, K) in shapes.items():
            rows += bench_shape(
                name,
                N,
                K,
                Ms,
                configs,
                dtype=dtype,
                device=device,
                iters=args.iters,
                warmup=args.warmup,
                cycle_bytes=args.cycle_mib * MiB,
                copy_bw=copy_bw,
            )
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print(report(rows, copy_bw))
    print(f"({time.perf_counter() - t0:.0f} s)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                dict(device=str(device), dtype=args.dtype, copy_gbps=copy_bw / 1e9, rows=[asdict(r) for r in rows]),
                f,
                indent=2,
            )
    return rows


if __name__ == "__main__":
    main()
