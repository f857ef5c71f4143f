"""Decode attention per layer call: PyTorch SDPA (sdpa: its own choice; efficient) vs the Triton split-K kernel.

    python -m dflash2.runtime.bench_attention --device cuda                 # Qwen3-8B shape, the table below
    python -m dflash2.runtime.bench_attention --device cuda --sweep         # also the kernel's split / tile options
    python -m dflash2.runtime.bench_attention --device cuda --out a.json    # rows as JSON too
    python -m dflash2.runtime.bench_attention --device cpu --tiny           # smoke test (Triton's interpreter)

What one attention layer of a runtime step does after its K/V write: ``KVCache.attend`` of
a (N, H, T, D) query block over the static cache, with the target's causal
:class:`~dflash2.runtime.cache.StepMeta` (``DecodeState.step_meta``) at the attended length
the graphed engine uses (committed length + T rounded up to GRAPH_KV_BUCKET). Shape: Qwen3-8B
(32 query heads, 8 K/V heads, head_dim 128, 36 layers), bf16, every row holding ``cached``
committed tokens; batch 1 and 8, T = 1 (AR) and 16 (verify), cached 64, 320, 1024, 4096.

Each layer has its own cache, as in the model, so the 36 calls of a step read 36 different
K/V regions (one layer repeated would run from L2). On CUDA the 36 calls are captured as one
CUDA graph (kernel time without Python launch overhead), replayed ``--iters`` times after
warm-up with CUDA events around each replay; the median replay ÷ 36 is µs per layer call.
``GB/s`` is the K/V bytes a row must read (keys 0 .. cached + T − 1 of every K/V head, K and V)
÷ that time: what the kernel delivers against the ~4 TB/s of HBM, not what it actually loads
(SDPA reads the whole attended length, masked). ``max |Δ|`` compares layer 0's output with the
fp32 naive twin (``decode_attention_ref``) on the same inputs: a sanity check of the fast paths.
``device=cpu`` runs everything through Triton's interpreter without graphs (``--tiny``); its
times mean nothing.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass

import torch

from dflash2.runtime import kernels
from dflash2.runtime.cache import DecodeState, KVCache, attention_backend, set_attention_backend
from dflash2.runtime.engine import GRAPH_KV_BUCKET, _kv_len
from dflash2.runtime.kernels.attention import decode_attention, decode_attention_ref, plan

BACKENDS = ("sdpa", "efficient", "triton")  # triton: the runtime's default


@dataclass
class AttnShape:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def qwen3_8b(cls) -> AttnShape:
        """Qwen3-8B's attention (its config.json: 36 layers, 32 / 8 heads, head_dim 128)."""
        return cls(num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128)

    @classmethod
    def tiny(cls) -> AttnShape:
        """For the CPU smoke test: G = 3, a head_dim that is no power of two."""
        return cls(num_layers=2, num_heads=6, num_kv_heads=2, head_dim=24)


@dataclass
class Row:
    batch: int
    T: int
    cached: int
    kv_len: int
    backend: str
    us_per_call: float  # per layer call, median over replays
    kv_bytes: int  # K/V bytes the rows must read per call
    gbps: float
    max_abs_diff: float  # layer 0 vs the fp32 twin
    options: dict  # the kernel's launch plan (triton) or {}


def _setup(shape: AttnShape, N: int, T: int, cached: int, dtype, device, seed: int = 0):
    kv_len = _kv_len(cached, T, cached + T + GRAPH_KV_BUCKET, GRAPH_KV_BUCKET)
    hkv, D = shape.num_kv_heads, shape.head_dim
    kv = KVCache(shape.num_layers, N, hkv, kv_len, D, groups=shape.num_heads // hkv, dtype=dtype, device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    kv.k.normal_(generator=g)
    kv.v.normal_(generator=g)
    state = DecodeState(torch.full((N,), cached, dtype=torch.long, device=device), kv, None)
    meta = state.step_meta(T, kv_len)
    q = torch.randn(N, shape.num_heads, T, D, generator=g, device=device).to(dtype)
    return kv, meta, q


def _timed(fn, layers: int, device: torch.device, iters: int, warmup: int, graphs: bool) -> float:
    """Median µs per layer call of ``fn`` (which runs all layers)."""
    if device.type != "cuda":
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(times) / layers
    side = torch.cuda.Stream(device)  # compile / warm up outside any capture, on a side stream
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(max(warmup, 1)):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    run = fn
    if graphs:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        run = graph.replay
        for _ in range(warmup):
            run()
    times = []
    for _ in range(iters):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        run()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) * 1e3)  # ms -> µs
    return statistics.median(times) / layers


def measure(
    shape: AttnShape,
    N: int,
    T: int,
    cached: int,
    backend: str,
    *,
    dtype=torch.bfloat16,
    device="cuda",
    iters: int = 20,
    warmup: int = 3,
    graphs: bool = True,
    options: dict | None = None,
    inputs: tuple | None = None,
) -> Row:
    """One row: ``backend`` through KVCache.attend, or (options given) decode_attention with those options.

    inputs: (kv, meta, q) of an earlier :func:`_setup` with the same arguments, to reuse its caches."""
    device = torch.device(device)
    kv, meta, q = inputs or _setup(shape, N, T, cached, dtype, device)
    S = meta.kv_len
    cpu_kernels = kernels.on_cpu() if device.type == "cpu" and backend == "triton" else nullcontext()
    previous = attention_backend()
    set_attention_backend(backend)
    try:
        with cpu_kernels:
            if options is None:

                def layer(slot):
                    return kv.attend(slot, q, meta)

            else:

                def layer(slot):
                    return decode_attention(q, kv.k[slot, :, :, :S], kv.v[slot, :, :, :S], meta.positions, **options)

            def step():
                for slot in range(shape.num_layers):
                    layer(slot)

            y0 = layer(0)
            ref = decode_attention_ref(q.float(), kv.k[0, :, :, :S].float(), kv.v[0, :, :, :S].float(), meta.positions)
            diff = (y0.float() - ref).abs().max().item()
            us = _timed(step, shape.num_layers, device, iters, warmup, graphs)
    finally:
        set_attention_backend(previous)
    kv_bytes = 2 * N * shape.num_kv_heads * (cached + T) * shape.head_dim * kv.k.element_size()
    launch = {}
    if backend == "triton":
        M = shape.num_heads // shape.num_kv_heads * T
        launch = plan(N, shape.num_kv_heads, M, S, shape.head_dim, device, **(options or {}))
    return Row(
        batch=N,
        T=T,
        cached=cached,
        kv_len=S,
        backend=backend if options is None else "triton (direct)",
        us_per_call=us,
        kv_bytes=kv_bytes,
        gbps=kv_bytes / (us * 1e-6) / 1e9,
        max_abs_diff=diff,
        options=launch,
    )


SWEEP = dict(num_splits=(1, 2, 4, 8, 16, 32, 64), block_n=(32, 64, 128), num_warps=(4, 8), num_stages=(1, 3))


def sweep(shape: AttnShape, N: int, T: int, cached: int, **kw) -> Row | None:
    """The fastest decode_attention over the SWEEP grid (options that fail to compile are skipped)."""
    best = None
    seen = set()
    inputs = _setup(shape, N, T, cached, kw.get("dtype", torch.bfloat16), torch.device(kw.get("device", "cuda")))
    for values in itertools.product(*SWEEP.values()):
        opts = dict(zip(SWEEP, values))
        S = _kv_len(cached, T, cached + T + GRAPH_KV_BUCKET, GRAPH_KV_BUCKET)
        M = shape.num_heads // shape.num_kv_heads * T
        key = tuple(sorted(plan(N, shape.num_kv_heads, M, S, shape.head_dim, torch.device("cpu"), **opts).items()))
        if key in seen:  # e.g. more splits than key tiles: the same launch
            continue
        seen.add(key)
        try:
            row = measure(shape, N, T, cached, "triton", options=opts, inputs=inputs, **kw)
        except Exception as e:  # out of resources for this tile: not a candidate
            print(f"  skip {opts}: {type(e).__name__}")
            continue
        if best is None or row.us_per_call < best.us_per_call:
            best = row
    return best


def report(rows: list[Row], shape: AttnShape) -> str:
    """Markdown table, plus sdpa ÷ triton per configuration and the per-step sum over the layers."""
    lines = [
        f"Decode attention per layer call ({shape.num_heads} q / {shape.num_kv_heads} kv heads, head_dim "
        f"{shape.head_dim}; a step has {shape.num_layers} layers)",
        "",
        "| batch | T | cached | kv_len | backend | µs / call | ms / step | GB/s (K/V) | max abs diff | launch |",
        "|---:|---:|---:|---:|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        launch = ", ".join(
            f"{k}={v}"
            for k, v in r.options.items()
            if k in ("splits", "chunk", "block_n", "num_warps", "num_stages") and v is not None
        )
        lines.append(
            f"| {r.batch} | {r.T} | {r.cached} | {r.kv_len} | {r.backend} | {r.us_per_call:.2f} "
            f"| {r.us_per_call * shape.num_layers / 1e3:.3f} | {r.gbps:.0f} | {r.max_abs_diff:.2g} | {launch} |"
        )
    by = {(r.batch, r.T, r.cached, r.backend): r for r in rows}
    lines.append("")
    for N, T, cached in sorted({(r.batch, r.T, r.cached) for r in rows}):
        base, tri = by.get((N, T, cached, "sdpa")), by.get((N, T, cached, "triton"))
        if base and tri:
            lines.append(
                f"batch {N}, T {T}, cached {cached}: triton {tri.us_per_call:.2f} µs vs SDPA "
                f"{base.us_per_call:.2f} µs: sdpa ÷ triton = {base.us_per_call / tri.us_per_call:.2f}×"
            )
    return "\n".join(lines)


def main(argv=None) -> list[Row]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--block", type=int, nargs="+", default=[1, 16], help="T, query tokens per row")
    p.add_argument("--cached", type=int, nargs="+", default=[64, 320, 1024, 4096], help="committed tokens per row")
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--eager", action="store_true", help="time plain calls instead of CUDA-graph replays")
    p.add_argument("--sweep", action="store_true", help="also the fastest of the kernel's SWEEP options per row")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test)")
    p.add_argument("--out", default=None, help="also write the rows as JSON here")
    args = p.parse_args(argv)
    shape = AttnShape.tiny() if args.tiny else AttnShape.qwen3_8b()
    kw = dict(
        dtype=getattr(torch, args.dtype),
        device=args.device,
        iters=args.iters,
        warmup=args.warmup,
        graphs=not args.eager,
    )
    print(f"shape {asdict(shape)}, device {args.device}, dtype {args.dtype}")
    rows = []
    for N, T, cached in itertools.product(args.batch, args.block, args.cached):
        inputs = _setup(shape, N, T, cached, kw["dtype"], torch.device(args.device))  # shared by the backends
        rows.extend(measure(shape, N, T, cached, b, inputs=inputs, **kw) for b in args.backends)
        del inputs
        if args.sweep:
            best = sweep(shape, N, T, cached, **kw)
            if best is not None:
                best.backend = "triton (best of sweep)"
                rows.append(best)
        if args.device != "cpu":
            torch.cuda.empty_cache()  # each configuration allocates its own 36-layer cache
    print(report(rows, shape))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(shape=asdict(shape), dtype=args.dtype, rows=[asdict(r) for r in rows]), f, indent=2)
    return rows


if __name__ == "__main__":
    main()
