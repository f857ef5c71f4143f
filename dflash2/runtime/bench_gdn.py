"""Per-GDN-layer cost of verify + rollback: ReplaySSM vs native rollback (docs/ARCHITECTURE.md §5.5).

    python -m dflash2.runtime.bench_gdn --device cuda              # Qwen3.5-9B GDN shape, batch 1 and 64, T=16
    python -m dflash2.runtime.bench_gdn --device cuda --modes replay replay_eager native --profile
    python -m dflash2.runtime.bench_gdn --device cuda --sweep      # also search the kernels' tile / warp options
    # ReplaySSM's chunked verify recurrence against the sequential one (and native); its own knobs
    # chunk_warps / chunk_block_v / chunk_block_k go in the same JSON (gdn_verify_triton):
    python -m dflash2.runtime.bench_gdn --device cuda --batch 1 --modes replay native \
        --options '{}' --options '{"chunked": true}' --options '{"chunked": true, "chunk_warps": 8}'
    python -m dflash2.runtime.bench_gdn --device cuda --out g.json # results as JSON too
    # another GDN shape (GDNShape's fields), e.g. the embedded small target's 9 GDN layers at its block 8:
    python -m dflash2.runtime.bench_gdn --device cuda --block 8 --shape '{"num_layers": 9, "num_k_heads": 4,
        "num_v_heads": 8, "head_k_dim": 96, "head_v_dim": 96, "conv_kernel": 4}'

What one speculative step does to the GDN layers, on a :class:`~dflash2.runtime.gdn_state.GDNState`
with every GDN layer of the shape (24 layers of ``Qwen3_5TextConfig()`` defaults: 16 key heads,
32 value heads, d_k = d_v = 128, conv kernel 4, bf16 projections, fp32 state): verify a block
of T tokens in every layer (conv + SiLU, L2 norms, gates, recurrence, outputs, logs), then
commit n tokens per row. All layers have their own state and inputs, so a batch-1 step does
not run from L2 the way one layer repeated would. The state reserves its T-token logs, as the
engine's does, so ReplaySSM's commit is the deferred one: it records n, and the fold of those n
tokens runs inside the *next* verify of each layer. The phases alternate (verify, commit, verify,
...), so every timed verify folds the previous commit's n: ReplaySSM's verify µs carry the fold
and its commit µs are one small copy; their sum is one step, comparable with native's (whose
commit is the copy of the kept state, as before). Mode ``replay_eager`` is ReplaySSM with the
deferral off (the commit kernel folds at once: the layout before it), for the ablation. On CUDA
each phase is captured as a CUDA graph (kernel time without Python launch overhead; ``--eager``
times plain calls), timed with events over ``--iters`` replays, and divided by the layer count.
``--repeats R`` times every row R times, all rows once per repeat in turn, and reports each row's
median run with the spread of its totals (what a speed claim needs: medians and spread, several runs).
n = T (every draft accepted) unless ``--accepted`` says otherwise: the most a fold does; native's
copy costs the same for any n.

Reported per (batch, mode): µs per GDN layer for verify, commit and both; speculative-state
bytes per request (what the step keeps between verify and commit: ReplaySSM's k/u/g logs plus,
deferred, the pending counts and each layer's (k, g) stash; native's T full states; and all
modes' T pre-conv inputs for the conv window), and the committed state per request for scale.
The issue's targets (24 µs per layer at batch 1, native ÷ replay ≥ 1.5× at batch 1 and ≥ 2× at
batch 64, ≥ 20× less speculative state) are printed with the numbers, on each (batch, mode)'s fastest
row when several ``--options`` are measured. ``device=cpu`` runs the same
code through Triton's interpreter (a smoke test with tiny shapes, ``--tiny``; its times mean nothing).
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from dataclasses import asdict, dataclass, replace

import torch

from dflash2.runtime.gdn_state import GDNState
from dflash2.runtime.kernels.gdn_log import default_block_v, recur_programs
from dflash2.runtime.models.base import GDN

MiB = 2**20


@dataclass
class GDNShape:
    num_layers: int
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim

    @classmethod
    def qwen3_5_9b(cls) -> GDNShape:
        """The GDN layers of ``transformers.Qwen3_5TextConfig()`` (its defaults are the 9B model)."""
        from transformers import Qwen3_5TextConfig

        c = Qwen3_5TextConfig()
        return cls(
            num_layers=list(c.layer_types).count("linear_attention"),
            num_k_heads=c.linear_num_key_heads,
            num_v_heads=c.linear_num_value_heads,
            head_k_dim=c.linear_key_head_dim,
            head_v_dim=c.linear_value_head_dim,
            conv_kernel=c.linear_conv_kernel_dim,
        )

    @classmethod
    def of_model(cls, model) -> GDNShape | None:
        """The GDN layers of a runtime model (its ``gdn_dims`` and ``layer_types``); None without any.

        Why from the runtime model and not the HF config: it is what the runtime's states are built
        from (models/base.py ``new_state``), whichever config class or composite folder it came from.
        """
        count = model.layer_types.count(GDN)
        if not count or model.gdn_dims is None:
            return None
        d = model.gdn_dims
        shape = cls(
            num_layers=count,
            num_k_heads=d["num_k_heads"],
            num_v_heads=d["num_v_heads"],
            head_k_dim=d["head_k_dim"],
            head_v_dim=d["head_v_dim"],
            conv_kernel=d["conv_kernel"],
        )
        if shape.conv_dim != d["conv_dim"]:  # the conv runs over q, k, v channels and nothing else
            raise ValueError(f"GDN conv_dim {d['conv_dim']} != 2·Hk·d_k + H·d_v = {shape.conv_dim}")
        return shape

    @classmethod
    def tiny(cls) -> GDNShape:
        """For the CPU smoke test: odd, small, GQA-style."""
        return cls(num_layers=2, num_k_heads=1, num_v_heads=2, head_k_dim=5, head_v_dim=3, conv_kernel=4)


def spec_bytes(
    shape: GDNShape, T: int, mode: str, x_itemsize: int = 2, *, deferred: bool = False, block_v: int | None = None
) -> int:
    """Speculative-state bytes per request over all GDN layers, from the shapes (what GDNLog holds):
    ReplaySSM k (T, Hk, d_k) + u (T, H, d_v) + g (T, H) fp32, native T states (H, d_k, d_v) fp32;
    both keep x (T, C) in the model dtype for the conv window. mode: the log's layout, 'native' or
    anything else (ReplaySSM's). deferred (ReplaySSM's deferred commit, GDNState in replay mode with
    reserved logs): plus its pending counts, int32 per recurrence program (H · d_v / block_v per layer),
    and each layer's stash of the pending k (T, Hk, d_k) and g (T, H) fp32."""
    hk, h, dk, dv = shape.num_k_heads, shape.num_v_heads, shape.head_k_dim, shape.head_v_dim
    fp32 = T * h * dk * dv if mode == "native" else T * (hk * dk + h * dv + h)
    held = shape.num_layers * (4 * fp32 + x_itemsize * T * shape.conv_dim)
    if deferred:
        held += 4 * shape.num_layers * (recur_programs(h, dv, block_v) + T * (hk * dk + h))
    return held


def _size(b: float) -> str:
    return f"{b / MiB:.2f} MiB" if b >= MiB else f"{b / 1024:.1f} KiB"


@dataclass
class Row:
    batch: int
    mode: str
    verify_us: float  # per GDN layer
    commit_us: float
    total_us: float
    spec_bytes_per_request: int  # all GDN layers
    state_bytes_per_request: int  # the committed conv + recurrent state, all GDN layers
    kernel_options: dict  # as given ({} = the defaults)
    resolved_options: dict | None = None  # what the state ran: the given ones plus defaults GDNState picks (block_v)
    runs: int = 1  # timed runs of this row (--repeats): the fields above are the run with the median total
    total_min_us: float | None = None  # the runs' spread (runs > 1)
    total_max_us: float | None = None


def median_run(runs: list[Row]) -> Row:
    """The run whose total is the median (the lower of the two middle ones for an even count), with the spread
    of all runs' totals in total_min_us / total_max_us."""
    ordered = sorted(runs, key=lambda r: r.total_us)
    mid = ordered[(len(ordered) - 1) // 2]
    return replace(mid, runs=len(runs), total_min_us=ordered[0].total_us, total_max_us=ordered[-1].total_us)


def _layer_inputs(shape: GDNShape, N: int, T: int, dtype, device, seed: int = 0) -> list[tuple]:
    """Per GDN layer: (x (N, T, C), conv_weight (C, 1, K), a, b (N, T, H), A_log, dt_bias (H,))."""
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*s, scale=1.0):
        return (scale * torch.randn(*s, generator=g)).to(device=device, dtype=dtype)

    H, C, K = shape.num_v_heads, shape.conv_dim, shape.conv_kernel
    return [
        (rnd(N, T, C), rnd(C, 1, K, scale=0.5), rnd(N, T, H), rnd(N, T, H), rnd(H, scale=0.5), rnd(H))
        for _ in range(shape.num_layers)
    ]


MODES = ("replay", "replay_eager", "native", "reference")  # replay_eager: ReplaySSM with the deferral off


def _new_state(shape: GDNShape, N: int, T: int, mode: str, dtype, device, kernel_options) -> GDNState:
    """A state of every GDN layer with T-token logs reserved (as the engine's slots: ReplaySSM defers)."""
    s = GDNState(
        shape.num_layers,
        N,
        conv_dim=shape.conv_dim,
        conv_kernel=shape.conv_kernel,
        num_k_heads=shape.num_k_heads,
        num_v_heads=shape.num_v_heads,
        head_k_dim=shape.head_k_dim,
        head_v_dim=shape.head_v_dim,
        dtype=dtype,
        device=device,
        mode="replay" if mode == "replay_eager" else mode,
        kernel_options=kernel_options,
        defer=mode != "replay_eager",
    )
    s.reserve(T)
    s.rec.normal_(0.0, 0.1)  # a state with history (values do not change the cost)
    s.conv.normal_()
    return s


def _verify_all(state: GDNState, inputs) -> None:
    for slot, args in enumerate(inputs):
        state.verify(slot, *args)


def measure(
    shape: GDNShape,
    N: int,
    T: int,
    mode: str,
    *,
    accepted: int | None = None,
    dtype=torch.bfloat16,
    device="cuda",
    iters: int = 50,
    warmup: int = 3,
    graphs: bool = True,
    kernel_options: dict | None = None,
) -> Row:
    """Time verify of every GDN layer + one commit of ``accepted`` (default T) tokens per row, the two
    phases alternating (ReplaySSM: each verify folds the previous commit). mode: one of MODES."""
    device = torch.device(device)
    state = _new_state(shape, N, T, mode, dtype, device, kernel_options)
    inputs = _layer_inputs(shape, N, T, dtype, device)
    n = torch.full((N,), T if accepted is None else accepted, dtype=torch.long, device=device)
    cuda = device.type == "cuda"
    if cuda:  # compile / warm up outside any capture, on a side stream as graph capture wants
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(warmup):
                _verify_all(state, inputs)
                state.commit(n)
        torch.cuda.current_stream(device).wait_stream(side)
        torch.cuda.synchronize(device)
    else:
        for _ in range(warmup):
            _verify_all(state, inputs)
            state.commit(n)
    _verify_all(state, inputs)
    spec_bytes = state.log_bytes() // N
    state.commit(n)
    state_bytes = (state.rec[:, 0].numel() * state.rec.element_size()) + (
        state.conv[:, 0].numel() * state.conv.element_size()
    )
    if cuda and graphs:
        torch.cuda.empty_cache()  # the eager runs' cached logs cannot serve the graphs' private pool
        g_verify, g_commit = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(g_verify):
            _verify_all(state, inputs)
        logs = list(state.logs)  # the capture's log tensors: every replay of g_verify refills them
        with torch.cuda.graph(g_commit, pool=g_verify.pool()):
            state.commit(n)

        def run_verify():
            g_verify.replay()

        def run_commit():
            g_commit.replay()

    else:

        def run_verify():
            _verify_all(state, inputs)

        def run_commit():
            state.commit(n)

        logs = None
    t_verify = t_commit = 0.0
    for _ in range(iters):
        if cuda:
            e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            e0.record()
            run_verify()
            e1.record()
            run_commit()
            e2.record()
            e2.synchronize()
            t_verify += e0.elapsed_time(e1) * 1e3  # ms -> µs
            t_commit += e1.elapsed_time(e2) * 1e3
        else:
            t0 = time.perf_counter()
            run_verify()
            t1 = time.perf_counter()
            run_commit()
            t_verify += (t1 - t0) * 1e6
            t_commit += (time.perf_counter() - t1) * 1e6
    del logs
    per = iters * shape.num_layers
    return Row(
        batch=N,
        mode=mode,
        verify_us=t_verify / per,
        commit_us=t_commit / per,
        total_us=(t_verify + t_commit) / per,
        spec_bytes_per_request=spec_bytes,
        state_bytes_per_request=state_bytes,
        kernel_options=dict(kernel_options or {}),
        resolved_options=state.options_ran(),
    )


def profile_kernels(
    shape: GDNShape, N: int, T: int, mode: str, *, iters: int = 5, **kw
) -> list[tuple[str, float, float]]:
    """GPU kernels of one verify + commit step, from torch.profiler over ``iters`` eager steps:
    (kernel name, µs per GDN layer, launches per GDN layer), longest first. What limits the step:
    kernel time vs the graph-timed total says how much is launch and gap. kw as :func:`measure`'s
    (``kernel_options``, ``accepted``: n per row, default T)."""
    from torch.profiler import ProfilerActivity, profile

    device = torch.device(kw.get("device", "cuda"))
    state = _new_state(shape, N, T, mode, kw.get("dtype", torch.bfloat16), device, kw.get("kernel_options"))
    inputs = _layer_inputs(shape, N, T, kw.get("dtype", torch.bfloat16), device)
    accepted = kw.get("accepted")
    n = torch.full((N,), T if accepted is None else accepted, dtype=torch.long, device=device)
    for _ in range(3):
        _verify_all(state, inputs)
        state.commit(n)
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            _verify_all(state, inputs)
            state.commit(n)
        torch.cuda.synchronize(device)
    per = iters * shape.num_layers
    rows = [
        (e.key, e.self_device_time_total / per, e.count / per)
        for e in prof.key_averages()
        if e.self_device_time_total > 0
    ]
    return sorted(rows, key=lambda r: -r[1])


# The recurrence and the fold are what the tile width and warps change; the prep's warps and its tokens per
# program (block_t: the prep grid has one program per chunk) are its own knobs, searched after the tile
SWEEP = dict(block_v=(4, 8, 16, 32, 64), num_warps=(1, 2, 4, 8))
# ReplaySSM's chunked recurrence has its own tile and warps (num_warps / block_v stay the sequential
# walk's, which one-token verifies run, and the pending counts' layout: block_v is left to GDNState, which on
# CUDA may narrow it at a small batch; chunk_block_v is always given here, a multiple of any block_v it picks)
CHUNK_SWEEP = dict(chunk_block_v=(16, 32, 64, 128), chunk_warps=(1, 2, 4, 8), chunk_block_k=(16, 32))
PREP_SWEEP = (1, 2, 4, 8)  # the prep kernel's warps, searched after the tile (it does not depend on it)
PREP_TOKENS_SWEEP = (4, 8, 16)  # its block_t, searched with its warps
STAGES_SWEEP = (2, 3, 4)  # the recurrence's pipelined loops (0, the hand prefetch, is the grid's own)


def _options_label(r: Row) -> str:
    """The options column: as given, plus what the state picked for the rest (e.g. 'default (block_v 4)')."""
    picked = {k: v for k, v in (r.resolved_options or {}).items() if k not in r.kernel_options}
    label = str(r.kernel_options) if r.kernel_options else "default"
    return label + "".join(f" ({k} {v})" for k, v in picked.items())


def best_options(shape, N, T, mode, **kw) -> Row:
    """The fastest verify + commit over the SWEEP grid (ReplaySSM: and the chunked recurrence over its own
    CHUNK_SWEEP grid), then over STAGES_SWEEP, PREP_SWEEP × PREP_TOKENS_SWEEP and one_launch with the best
    tile (options a kernel cannot compile are skipped)."""
    best = None

    def attempt(options):
        nonlocal best
        try:
            row = measure(shape, N, T, mode, kernel_options=options, **kw)
        except Exception as e:  # out of resources for this tile: not a candidate
            print(f"  batch {N} {mode} {options}: skipped ({type(e).__name__})", flush=True)
            return
        print(f"  batch {N} {mode} {options}: {row.verify_us:.1f} + {row.commit_us:.1f} µs", flush=True)
        if best is None or row.total_us < best.total_us:
            best = row

    for bv, warps in itertools.product(*SWEEP.values()):
        if bv <= shape.head_v_dim * 2:
            attempt(dict(block_v=bv, num_warps=warps))
    if mode in ("replay", "replay_eager"):
        for cbv, warps, bk in itertools.product(*CHUNK_SWEEP.values()):
            # whole block_v slices per program (the pending counts' layout)
            if cbv <= shape.head_v_dim * 2 and cbv % default_block_v(shape.head_v_dim) == 0:
                attempt(dict(chunked=True, chunk_block_v=cbv, chunk_warps=warps, chunk_block_k=bk))
    if best is not None and mode != "reference":
        tile = dict(best.kernel_options)
        for stages in STAGES_SWEEP:
            attempt({**tile, "stages": stages})
        tile = dict(best.kernel_options)
        for prep, tokens in itertools.product(PREP_SWEEP, PREP_TOKENS_SWEEP):
            attempt({**tile, "prep_warps": prep, "block_t": tokens})
        if not best.kernel_options.get("chunked"):  # one kernel for the sequential walk only
            attempt({**tile, "one_launch": True})
    return best


def _spread(r: Row) -> str:
    """' [min–max] over k runs' after a median of several runs, else nothing."""
    return f" [{r.total_min_us:.1f}–{r.total_max_us:.1f}] over {r.runs} runs" if r.runs > 1 else ""


def report(rows: list[Row], T: int) -> str:
    """Markdown table + the issue's targets, checked where the rows allow."""
    lines = [
        f"GDN verify + commit per layer, block T = {T}",
        "",
        "replay: the commit records n, the next verify folds those n tokens (its µs include the fold);"
        " replay_eager: the commit folds at once; native: the commit copies the kept state.",
        "",
        "| batch | mode | verify µs | commit µs | total µs (median [min–max] with --repeats) | spec state / request "
        "| committed / request | options |",
        "|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    lines += [
        f"| {r.batch} | {r.mode} | {r.verify_us:.1f} | {r.commit_us:.1f} | {r.total_us:.1f}{_spread(r)} "
        f"| {_size(r.spec_bytes_per_request)} | {_size(r.state_bytes_per_request)} "
        f"| {_options_label(r)} |"
        for r in rows
    ]
    by = {}  # (batch, mode) -> its fastest row: with several --options, the targets are checked on the best
    for r in rows:
        if (r.batch, r.mode) not in by or r.total_us < by[r.batch, r.mode].total_us:
            by[r.batch, r.mode] = r
    lines.append("")
    for N in sorted({r.batch for r in rows}):
        rep, nat = by.get((N, "replay")), by.get((N, "native"))
        if rep and nat:
            target = {1: " (target ≥ 1.5×)", 64: " (target ≥ 2×)"}.get(N, "")
            lines.append(
                f"batch {N}: native ÷ replay time {nat.total_us / rep.total_us:.2f}×{target}, speculative state "
                f"native ÷ replay {nat.spec_bytes_per_request / rep.spec_bytes_per_request:.1f}× (target ≥ 20×)"
            )
        eager = by.get((N, "replay_eager"))
        if rep and eager:
            lines.append(f"batch {N}: deferred fold: replay_eager ÷ replay time {eager.total_us / rep.total_us:.2f}×")
        if rep and N == 1:
            lines.append(f"batch 1: replay {rep.total_us:.1f} µs per GDN layer (target ≤ 24 µs)")
    if any(len([r for r in rows if (r.batch, r.mode) == key]) > 1 for key in by):
        lines.append("(each (batch, mode): its fastest row's options)")
    return "\n".join(lines)


def _free(device: str) -> None:
    if device != "cpu":
        torch.cuda.empty_cache()  # native at batch 64 holds tens of GiB of per-position states


def main(argv=None) -> list[Row]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    p.add_argument("--block", type=int, default=16, help="T, tokens verified per row")
    p.add_argument("--accepted", type=int, default=None, help="n committed per row (default T)")
    p.add_argument("--modes", nargs="+", default=["replay", "native"], choices=MODES)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="time every (batch, mode, options) row this many times, the rows interleaved within each repeat "
        "(machine drift hits them alike); each row reports its median run and the spread (not with --sweep)",
    )
    p.add_argument("--eager", action="store_true", help="time plain calls instead of CUDA-graph replays")
    p.add_argument("--sweep", action="store_true", help="search block_v / num_warps / prep_warps per batch and mode")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test)")
    p.add_argument(
        "--shape",
        type=json.loads,
        default=None,
        help="another GDN shape as JSON (GDNShape's fields), e.g. the embedded small target's: "
        '{"num_layers": 9, "num_k_heads": 4, "num_v_heads": 8, "head_k_dim": 96, "head_v_dim": 96, '
        '"conv_kernel": 4} (default: Qwen3.5-9B)',
    )
    p.add_argument(
        "--options",
        type=json.loads,
        action="append",
        default=None,
        help='kernel options as JSON, e.g. \'{"block_v": 8, "num_warps": 1, "stages": 3}\'; repeat to measure '
        "several (each a row per batch and mode; ignored by --sweep)",
    )
    p.add_argument("--out", default=None, help="also write the rows as JSON here")
    p.add_argument("--profile", action="store_true", help="also list the GPU kernels of a step per batch and mode")
    args = p.parse_args(argv)
    if args.tiny and args.shape:
        p.error("--tiny and --shape: choose one")
    try:
        shape = GDNShape.tiny() if args.tiny else GDNShape(**args.shape) if args.shape else GDNShape.qwen3_5_9b()
    except TypeError as e:  # a field missing or unknown: one line, with the fields it takes
        p.error(f"--shape: {e}; fields: {', '.join(GDNShape.__dataclass_fields__)}")
    kw = dict(
        accepted=args.accepted,
        dtype=getattr(torch, args.dtype),
        device=args.device,
        iters=args.iters,
        warmup=args.warmup,
        graphs=not args.eager,
    )
    print(f"shape {asdict(shape)}, device {args.device}, dtype {args.dtype}")
    if args.repeats < 1:
        p.error(f"--repeats {args.repeats}: expected ≥ 1")
    if args.sweep and args.repeats > 1:
        p.error("--repeats applies to the listed rows, not to --sweep's search")
    rows = []
    if args.sweep:
        for N, mode in itertools.product(args.batch, args.modes):
            if mode == "reference":
                rows.extend(measure(shape, N, args.block, mode, kernel_options=o, **kw) for o in args.options or [None])
            else:
                rows.append(best_options(shape, N, args.block, mode, **kw))
            _free(args.device)
    else:
        options = args.options or [None]
        configs = [(N, mode, o) for N, mode in itertools.product(args.batch, args.modes) for o in options]
        runs = {i: [] for i in range(len(configs))}
        for _ in range(args.repeats):  # every row once per repeat, in order: drift spreads over all of them
            for i, (N, mode, o) in enumerate(configs):
                runs[i].append(measure(shape, N, args.block, mode, kernel_options=o, **kw))
                _free(args.device)
        rows = [runs[i][0] if args.repeats == 1 else median_run(runs[i]) for i in range(len(configs))]
    print(report(rows, args.block))
    if args.profile and args.device != "cpu":
        for N, mode, o in itertools.product(args.batch, args.modes, args.options or [None]):
            print(
                f"\nkernels of one verify + commit step, batch {N}, {mode}, options {o or 'default'}"
                " (µs and launches per GDN layer):"
            )
            for name, us, count in profile_kernels(shape, N, args.block, mode, kernel_options=o, **kw):
                print(f"  {us:8.2f} µs  {count:4.1f}x  {name[:100]}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(shape=asdict(shape), block=args.block, rows=[asdict(r) for r in rows]), f, indent=2)
    return rows


if __name__ == "__main__":
    main()
