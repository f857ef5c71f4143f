"""Micro-benchmark of the drafter's training kernels against their torch code, one operation at a time (issue 15).

    python -m dflash2.training.bench_kernels                       # the Qwen3-8B recipe's shapes, default tiles
    python -m dflash2.training.bench_kernels --conv-tiles sweep    # + the conv tile sweep of docs/BENCHMARKS.md

Times, with CUDA events (wall clock on the CPU), forward alone and forward + backward of:

* one side of DFlash2's block-local conv (``conv_kernels.conv_side`` vs ``local_conv.block_conv_side_torch``)
  on (2, positions / 2, hidden) inputs, an fp32 input (the pre-conv side: the residual stream's norm under
  bf16-mixed) and a bf16 one (the post-conv side), δ in bf16, group 16, block 16, for each conv tile asked;
* the RMSNorm (``norm_kernels.rms_norm_kernels`` vs ``rms_norm.rms_norm``) over (positions, hidden) fp32 and
  bf16 rows and (positions, heads, head_dim) bf16 rows (the per-head q norm).

Each figure: the mean over ``--iters`` calls after 3 warm-up calls, in µs. What a training step gains is
measured by ``bench_throughput`` (``--set conv_kernels=false`` / ``norm_kernels=false``); this script says
where inside it. On the CPU the kernels run only under TRITON_INTERPRET=1 (tests), and the figures mean
nothing there.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

from dflash2.errors import DFlash2Error

SWEEP = [f"{r}x{c}x{w}" for r, c, w in itertools.product((8, 16, 32, 64), (64, 128, 256), (4, 8))]


WARMUP = 3  # untimed calls before each timing (compiles, caches); tests set 0


def timed_us(fn, device: torch.device, iters: int) -> float:
    """Mean µs per call of ``fn`` over ``iters`` calls, after WARMUP untimed ones."""
    for _ in range(WARMUP):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / iters * 1e3
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters * 1e6


def _both(fn, inputs: list[torch.Tensor], grad: torch.Tensor, device, iters: int) -> dict:
    """fn(*inputs) forward under no_grad, and forward + backward(grad), in µs."""

    def forward():
        with torch.no_grad():
            fn(*inputs)

    def forward_backward():
        for t in inputs:
            t.grad = None
        fn(*inputs).backward(grad)

    return {
        "forward_us": timed_us(forward, device, iters),
        "forward_backward_us": timed_us(forward_backward, device, iters),
    }


def parse_tile(text: str) -> tuple[int, int, int]:
    try:
        rows, channels, warps = (int(v) for v in text.split("x"))
    except ValueError:
        raise DFlash2Error(f"conv tile {text!r}: expected ROWSxCHANNELSxWARPS, e.g. 8x64x4") from None
    if min(rows, channels, warps) < 1 or any(v & (v - 1) for v in (rows, channels, warps)):
        raise DFlash2Error(f"conv tile {text!r}: rows, channels and warps must be powers of two")
    return rows, channels, warps


def conv_rows(positions: int, hidden: int, tiles: list[str], device, iters: int, seed: int) -> list[dict]:
    from dflash2.drafter import conv_kernels as ck
    from dflash2.drafter.local_conv import block_conv_side_torch

    groups, block = hidden // 16, 16
    g = torch.Generator(device=device).manual_seed(seed)
    kept = (ck.BLOCK_ROWS, ck.BLOCK_CHANNELS, ck.WARPS)
    rows = []
    try:
        for dtype in (torch.float32, torch.bfloat16):
            shape = (2, positions // 2, hidden)
            x = torch.randn(*shape, device=device, dtype=dtype, generator=g).requires_grad_(True)
            delta = (0.1 * torch.randn(*shape[:2], 2, 2, groups, device=device, generator=g)).to(torch.bfloat16)
            delta.requires_grad_(True)
            base = torch.randn(2, 2, hidden, device=device, generator=g).requires_grad_(True)
            grad = torch.randn(*shape, device=device, generator=g).to(torch.promote_types(dtype, torch.bfloat16))
            inputs = [x, delta, base]
            name = str(dtype).removeprefix("torch.")
            torch_fn = lambda *a: block_conv_side_torch(*a, 0, block, 16)  # noqa: E731
            rows.append({"op": "conv side", "x": name, "path": "torch", **_both(torch_fn, inputs, grad, device, iters)})
            for tile in tiles:
                ck.BLOCK_ROWS, ck.BLOCK_CHANNELS, ck.WARPS = parse_tile(tile)
                kernel_fn = lambda *a: ck.conv_side(*a, 0, block, 16)  # noqa: E731
                row = {"op": "conv side", "x": name, "path": f"kernels {tile}"}
                rows.append({**row, **_both(kernel_fn, inputs, grad, device, iters)})
    finally:
        ck.BLOCK_ROWS, ck.BLOCK_CHANNELS, ck.WARPS = kept
    return rows


def norm_rows(positions: int, hidden: int, heads: int, head_dim: int, device, iters: int, seed: int) -> list[dict]:
    from dflash2.drafter.norm_kernels import rms_norm_kernels
    from dflash2.drafter.rms_norm import rms_norm

    g = torch.Generator(device=device).manual_seed(seed)
    rows = []
    for shape, dtype in (
        ((positions, hidden), torch.float32),
        ((positions, heads, head_dim), torch.bfloat16),
        ((positions, hidden), torch.bfloat16),
    ):
        x = torch.randn(*shape, device=device, dtype=dtype, generator=g).requires_grad_(True)
        w = torch.ones(shape[-1], device=device, requires_grad=True)
        grad = torch.randn(*shape, device=device, dtype=dtype, generator=g)
        for path, fn in (("torch", rms_norm), ("kernels", rms_norm_kernels)):
            row = {"op": "rms norm", "x": f"{tuple(shape)} {str(dtype).removeprefix('torch.')}", "path": path}
            rows.append({**row, **_both(lambda a, b, f=fn: f(a, b, 1e-6), [x, w], grad, device, iters)})
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dflash2.training.bench_kernels", description=__doc__.split("\n")[0])
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--positions", type=int, default=16384, help="block positions per step (2 rows x 512 x 16)")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument(
        "--conv-tiles", default=None, help="ROWSxCHANNELSxWARPS[,...] or 'sweep' (24 tiles); default: the module's"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="write the rows as JSON")
    a = p.parse_args(argv)
    if a.positions < 2 or a.positions % 32 or a.hidden % 16 or min(a.hidden, a.heads, a.head_dim, a.iters) < 1:
        raise DFlash2Error("--positions must be a multiple of 32 (2 rows of whole blocks), --hidden of 16 (groups)")
    return a


def run(argv: list[str] | None = None) -> dict:
    a = parse_args(argv)
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    from dflash2.drafter import conv_kernels as ck

    default = f"{ck.BLOCK_ROWS}x{ck.BLOCK_CHANNELS}x{ck.WARPS}"
    tiles = SWEEP if a.conv_tiles == "sweep" else (a.conv_tiles or default).split(",")
    for tile in tiles:
        parse_tile(tile)
    rows = conv_rows(a.positions, a.hidden, tiles, device, a.iters, a.seed)
    rows += norm_rows(a.positions, a.hidden, a.heads, a.head_dim, device, a.iters, a.seed)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    results = {"device": name, "default_conv_tile": default, "settings": vars(a) | {"out": str(a.out)}, "rows": rows}
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(results, indent=2) + "\n")
    return results


def table(results: dict) -> str:
    lines = [
        f"Training kernels vs torch code, {results['device']} (µs per call, mean)",
        "| op | input | path | forward | forward + backward |",
        "|---|---|---|---:|---:|",
    ]
    lines += [
        f"| {r['op']} | {r['x']} | {r['path']} | {r['forward_us']:.1f} | {r['forward_backward_us']:.1f} |"
        for r in results["rows"]
    ]
    return "\n".join(lines)


def main() -> None:
    try:
        print(table(run()))
    except DFlash2Error as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
