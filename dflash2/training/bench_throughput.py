"""`python -m dflash2.training.bench_throughput`: drafter training throughput and MFU on one device (issue 15).

    python -m dflash2.training.bench_throughput --out bench.json                # Qwen3-8B shape on the GPU
    python -m dflash2.training.bench_throughput --profile                       # + top-10 CUDA kernels of a step
    python -m dflash2.training.bench_throughput --shape tiny --device cpu       # CPU smoke test, seconds

Target: random weights at a named shape, built by ``dflash2.eval.speedup_setup.random_model`` (the
shapes of ``python -m eval.speedup shape=...``): ``qwen3_8b`` (hidden 4096, 36 layers, 32 / 8 heads of
128, MLP 12288, vocab 151,936) in bf16 on CUDA, frozen, taps at the default layers [1, 9, 17, 25, 33];
``tiny`` for the CPU (fp32 there, as ``target.dtype=auto``). Step times of dense models do not depend
on the weights' values. Drafter: the ``drafter`` config group of ``train.py`` (default ``dflash2``:
local conv + selector), at the target's attention shape, ``--layers`` 5, block ``--block`` 16 and
``--anchors`` 512 per sequence (the published recipe); sequences of ``--seq`` 3072 random tokens, the
first ``--prompt-tokens`` (default half) unsupervised, the rest the response the anchors are drawn
from; ``--rows`` sequences per step (default 2 at the 8B shape).

What is timed is the training step of ``train.py``'s ``DrafterTrainingModule`` (built by
``train_drafter.training_module`` from the composed drafter settings), in the order Lightning's
automatic optimisation runs it: the batch copied to the device by the module's
``transfer_batch_to_device``, as Lightning does with each loader batch (the stored taps too, for offline
features; on a GPU the batches are in page-locked memory, as ``data.pin_memory=auto`` leaves them, and
go on a side stream; ``--pin-memory false``: pageable, the copy before that option), ``training_step``
(on CUDA under Lightning's own bf16-mixed autocast; fp32 on the CPU, as ``trainer=cpu``), ``zero_grad``,
backward, gradient-norm clipping at ``drafter.grad_clip``, AdamW (``drafter.optimizer_impl``: fused on
CUDA by default; the row's ``optimizer`` says which) and the scheduler step. Not timed: Lightning's loop
itself (its logging into the result collection, callbacks, progress bar) and the data loader (nor its
pinning: a loader thread). ``--set KEY=VALUE`` overrides a key of the drafter config group as
``drafter.KEY=VALUE`` does for ``train.py`` (e.g. ``--set optimizer_impl=foreach`` for the previous
optimiser). The drafter config turns on the training kernels and the kept logits (``loss_kernels``: the
chunked CE's Triton passes, ``conv_kernels``, ``norm_kernels``, ``loss_keep_logits``; each row says which
ran): ``--set KEY=false`` turns one off, e.g. for the baseline of a same-run comparison.

Variants, one row each (``--attention``, ``--ce``, ``--features`` pick a subset):

* attention ``flex`` (block-sparse FlexAttention, compiled) vs ``dense`` (SDPA over the bool mask):
  ``drafter.attention``. Flex has no backward on the CPU and training refuses it there: those rows are
  skipped with that note.
* ``chunked`` CE through the LM head (``drafter.loss_chunk_positions`` = ``--chunk``, the config's 1024)
  vs ``plain`` (``loss_chunk_positions=0``: the full (M, V) logits).
* ``offline`` features (the taps computed once before any row by ``dflash2.data.features.sequence_features``,
  the code of the offline feature writer, held in host memory and read by the step from the batch, as
  ``data.features=offline`` does) vs ``online`` (a target forward in every step).

Method: per row ``--warmup`` steps (compilation, autotuning), then ``--repeats`` repeats of ``--steps``
steps, each repeat timed as a whole with CUDA events (``perf_counter`` after a synchronize on the CPU);
a repeat's time / its steps is one sample, and the table gives the median sample (min-max). Every row
starts from the same drafter weights and a fresh optimiser, at step 0, so every row draws the same
anchors (keyed by (seed, step, row) as in training). A row that runs out of GPU memory is reported as
OOM and the next one runs; so is any other error, with its first line.

Tokens: *drafted* tokens = rows × valid anchors × (B − 1) per step (the supervised block positions the
loss is taken over), and *sequence* tokens = rows × seq per step. Peak memory: ``torch.cuda.max_memory_allocated``
over the row's steps. MFU (formula in full in ``dflash2.training.throughput_flops`` and printed with the
table): model FLOPs per step / median step time / ``--peak-tflops`` (default on CUDA: the H200's
989.4 dense bf16 TFLOP/s; none on the CPU). Model FLOPs per step = drafter linear layers (6 × weights ×
rows multiplied; 4 × for ``fc`` and the selector's projection, whose inputs need no gradient) +
drafter attention (12 · H·h · layers · *attended* (query, key) pairs: only those the block mask allows,
for flex and dense alike) + the frozen LM head (4 · d·V · drafted positions: forward and the gradient
to the hidden states, no weight gradient) + for online rows the target forward (2 × decoder linear
weights × sequence tokens + causal attention). "MFU excl. target" drops the last term from the
numerator only. ``--profile``: one more step of the headline variant (flex, chunked, offline; on the CPU
the first row that ran, by CPU operator): its top CUDA kernels and the operators that launched them
(``--profile-top`` rows, default 10), and with ``--profile-trace`` its Chrome trace.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import shlex
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from tqdm.auto import tqdm

from dflash2.drafter.objective import row_anchor_generator, sample_anchors
from dflash2.errors import DFlash2Error
from dflash2.training.preflight import (
    check_conv_kernels,
    check_loss_keep_logits,
    check_loss_kernels,
    check_loss_topk_kernel,
    check_norm_kernels,
)
from dflash2.training.throughput_flops import StepFlops, step_flops
from dflash2.training.throughput_report import (
    H200_BF16_DENSE_FLOPS,
    MFU_FORMULA,
    column_lines,
    environment,
    flops_lines,
    markdown_table,
    profile_table,
)
from dflash2.training.throughput_setup import Bench, Variant, build_bench
from dflash2.training.throughput_step import StepRunner, compiled_graphs, profile_one_step, timed_seconds

log = logging.getLogger(__name__)

PROG = "python -m dflash2.training.bench_throughput"
SHAPES = ("qwen3_8b", "tiny")
# Per shape: sequences per step, sequence length, block, anchors per sequence, drafter layers, and the
# warm-up / timed steps / repeats. qwen3_8b: the published recipe (5 layers, block 16, 512 anchors, seq
# 3072). 2 rows, by estimate (not yet measured): ~35 GB held throughout (bf16 target 16 GB; the 1.17 B
# drafter parameters' fp32 weights, gradients and AdamW moments 19 GB) + activations + the plain CE's
# (M, V) logits, their fp32 copies and gradient (~40 GB at M = 15,360) inside the H200's 141 GB; ~19
# steps of 0.4-1 s per row. tiny: seconds on a CPU.
PRESETS = {
    "qwen3_8b": dict(rows=2, seq=3072, block=16, anchors=512, layers=5, warmup=3, steps=5, repeats=3),
    "tiny": dict(rows=2, seq=64, block=4, anchors=8, layers=5, warmup=1, steps=2, repeats=2),
}
ATTENTION, CE, FEATURES = ("flex", "dense"), ("chunked", "plain"), ("offline", "online")
HEADLINE = ("flex", "chunked", "offline")
FLEX_ON_CPU = "flex needs CUDA: FlexAttention has no backward on the CPU, so training refuses it there"
_LOG_WARNING = r"You are trying to `self.log\(\)`"  # training_step logs; no Trainer here to take the values


def variants(attention=ATTENTION, ce=CE, features=FEATURES) -> list[Variant]:
    """Every combination, the headline one (flex, chunked, offline) first."""
    return [Variant(a, c, f) for a in attention for c in ce for f in features]


def step_anchors(bench: Bench, steps: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The anchors (N, A) and validity (N, A) each step drew: the training step's own draw, repeated."""
    mask = bench.batches["online"]["loss_mask"]
    out = []
    for s in steps:
        generators = [row_anchor_generator(bench.seed, s, r) for r in range(mask.shape[0])]
        out.append(sample_anchors(mask, int(bench.settings["num_anchors"]), generators))
    return out


def mean_flops(bench: Bench, variant: Variant, steps: list[int]) -> tuple[StepFlops, float]:
    """Model FLOPs per step (the mean over ``steps``, each on its own anchors) and drafted tokens per step."""
    config = bench.drafter.config
    text = bench.target.text_config if variant.features == "online" else None
    parts, drafted = [], []
    for anchors, valid in step_anchors(bench, steps):
        f = step_flops(
            config, rows=bench.rows, context_len=bench.seq, anchors=anchors, anchor_valid=valid, target_text_config=text
        )
        parts.append(f)
        drafted.append(int(valid.sum()) * (config.block_size - 1))
    n = len(parts)
    mean = StepFlops(*(round(sum(getattr(p, k) for p in parts) / n) for k in StepFlops.__dataclass_fields__))
    return mean, sum(drafted) / n


def measure(bench: Bench, variant: Variant, a: argparse.Namespace, peak: float | None, profile: bool) -> dict:
    """Warm up, time ``a.repeats`` × ``a.steps`` steps, count the FLOPs: the row of ``variant``."""
    device = bench.device
    total = a.warmup + a.repeats * a.steps + (1 if profile else 0)
    runner = StepRunner(bench, variant, total)
    runner_impl = runner.optimizer_impl  # fused | foreach | for_loop: what drafter.optimizer_impl resolved to
    runner_kernels = runner.loss_kernels  # the chunked CE's Triton passes ran (drafter.loss_kernels)
    runner_conv = runner.conv_kernels  # the conv's Triton kernels ran (drafter.conv_kernels)
    runner_norm = runner.norm_kernels  # the RMSNorms' Triton kernels ran (drafter.norm_kernels)
    runner_topk = runner.loss_topk_kernel  # the candidates' Triton top-k ran (drafter.loss_topk_kernel)
    runner_kept = runner.loss_keep_logits  # the chunked loss kept its logits (drafter.loss_keep_logits)
    try:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        step = 0
        warm_times, graphs_before = [], compiled_graphs()
        for _ in range(a.warmup):
            warm_times.append(timed_seconds(lambda s=step: runner.step(s), device))
            step += 1
        graphs_warm = compiled_graphs()
        samples, timed = [], []
        for _ in range(a.repeats):
            first = step

            def run(first=first):
                for s in range(first, first + a.steps):
                    runner.step(s)

            samples.append(timed_seconds(run, device) / a.steps)
            timed += range(first, first + a.steps)
            step += a.steps
        recompiled = compiled_graphs() - graphs_warm
        peak_mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
        prof = profile_one_step(runner, step, device, a.profile_top, a.profile_trace) if profile else None
    finally:
        runner.close()
    flops, drafted = mean_flops(bench, variant, timed)
    med = statistics.median(samples)
    seq_tokens = bench.rows * bench.seq
    row = {
        "variant": variant.name,
        "attention": variant.attention,
        "ce": variant.ce,
        "loss_chunk_positions": bench.chunk if variant.ce == "chunked" else 0,
        "features": variant.features,
        "status": "ok",
        "optimizer": runner_impl,
        "loss_kernels": runner_kernels,
        "conv_kernels": runner_conv,
        "norm_kernels": runner_norm,
        "loss_topk_kernel": runner_topk,
        "loss_keep_logits": runner_kept,
        "step_ms": {"median": med * 1e3, "min": min(samples) * 1e3, "max": max(samples) * 1e3},
        "step_ms_samples": [s * 1e3 for s in samples],
        "warmup_step_ms": [t * 1e3 for t in warm_times],
        "compiled_graphs": {"warmup": graphs_warm - graphs_before, "timed": recompiled},
        "drafted_tokens_per_step": drafted,
        "sequence_tokens_per_step": seq_tokens,
        "drafted_tokens_per_s": drafted / med,
        "sequence_tokens_per_s": seq_tokens / med,
        "peak_memory_gib": peak_mem,
        "flops_per_step": flops.as_dict(),
        "model_tflops_per_s": flops.total / med / 1e12,
        "mfu": None if peak is None else flops.total / med / peak,
        "mfu_excl_target": None if peak is None else flops.excluding_target / med / peak,
    }
    if recompiled:
        row["note"] = f"{recompiled} graphs compiled during the timed steps: raise --warmup"
    if prof is not None:
        row["profile"] = prof
    return row


# ------------------------------------------------------------------------------------ rows, guarded
def free_memory(bench: Bench) -> None:
    """What a failed row may have left: gradients on the shared drafter, cached allocator blocks."""
    bench.drafter.zero_grad(set_to_none=True)
    gc.collect()
    if bench.device.type == "cuda":
        torch.cuda.empty_cache()


def guarded_row(bench: Bench, variant: Variant, measure_fn) -> dict:
    """``measure_fn()``'s row, or a row saying why there is none: ``skipped`` (flex refused on the CPU),
    ``OOM`` (torch.OutOfMemoryError: memory is freed and the next row runs) or ``error`` (its first line)."""
    failure = None
    try:
        return measure_fn()
    except torch.OutOfMemoryError as e:
        failure = ("OOM", _first_line(e))
    except DFlash2Error as e:
        if variant.attention == "flex" and bench.device.type != "cuda":  # check_attention's refusal
            failure = ("skipped", FLEX_ON_CPU)
        else:
            failure = ("error", _first_line(e))
    except Exception as e:  # a compile failure of one variant must not lose the rows already measured
        log.exception(f"{variant.name} failed")
        failure = ("error", f"{type(e).__name__}: {_first_line(e)}")
    # outside the except blocks: the exception and the frames (tensors) it held are released by now
    free_memory(bench)
    status, note = failure
    return {
        "variant": variant.name,
        "attention": variant.attention,
        "ce": variant.ce,
        "features": variant.features,
        "status": status,
        "note": note,
    }


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


# ------------------------------------------------------------------------------------------------ CLI
def _choices(value: str, allowed: tuple[str, ...], flag: str) -> tuple[str, ...]:
    picked = tuple(v.strip() for v in value.split(",") if v.strip())
    bad = [v for v in picked if v not in allowed]
    if bad or not picked:
        raise DFlash2Error(f"{flag}={value!r}: pick from {','.join(allowed)}")
    return tuple(v for v in allowed if v in picked)  # the table's order


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Drafter training throughput (tokens/s) and MFU on one device: flex vs dense attention, "
        "chunked vs plain CE, offline vs online target features (docs/TRAINING.md, 'Training throughput benchmark').",
    )
    p.add_argument("--shape", choices=SHAPES, default="qwen3_8b", help="the random target's shape")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--drafter", default="dflash2", help="the drafter config group option (configs/drafter/)")
    for name, help_ in (
        ("rows", "sequences per step"),
        ("seq", "tokens per sequence"),
        ("block", "block size B"),
        ("anchors", "anchors (blocks) per sequence"),
        ("layers", "drafter layers"),
        ("warmup", "untimed steps per variant (flex compiles here)"),
        ("steps", "timed steps per repeat"),
        ("repeats", "timed repeats per variant"),
    ):
        p.add_argument(f"--{name}", type=int, default=None, help=f"{help_} (default: the shape's preset)")
    p.add_argument("--prompt-tokens", type=int, default=None, help="unsupervised prefix per sequence (default seq/2)")
    p.add_argument("--chunk", type=int, default=None, help="positions per chunk of the chunked CE (default: config)")
    p.add_argument("--attention", default=",".join(ATTENTION), help="subset of flex,dense")
    p.add_argument("--ce", default=",".join(CE), help="subset of chunked,plain")
    p.add_argument("--features", default=",".join(FEATURES), help="subset of offline,online")
    p.add_argument(
        "--peak-tflops", type=float, default=None, help="peak dense bf16 TFLOP/s for MFU (default: H200 989.4 on CUDA)"
    )
    p.add_argument(
        "--profile", action="store_true", help="the top CUDA kernels and operators of one step of the headline variant"
    )
    p.add_argument("--profile-top", type=int, default=10, help="rows of the profile's kernel and operator tables")
    p.add_argument("--profile-trace", default=None, help="with --profile: write the step's Chrome trace here")
    p.add_argument("--out", type=Path, default=None, help="write every row, the environment and the command as JSON")
    p.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="a drafter config key as train.py's drafter.KEY=VALUE (repeatable), e.g. --set optimizer_impl=foreach",
    )
    p.add_argument(
        "--pin-memory",
        choices=("auto", "false"),
        default="auto",
        help="data.pin_memory: auto = the batches in page-locked memory on a GPU (as a run); false = pageable",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's own)")
    a = p.parse_args(argv)
    for key, value in PRESETS[a.shape].items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    if a.prompt_tokens is None:
        a.prompt_tokens = a.seq // 2
    for key in ("rows", "seq", "block", "anchors", "layers", "steps", "repeats"):
        if getattr(a, key) < 1:
            raise DFlash2Error(f"--{key}={getattr(a, key)} must be >= 1")
    if a.warmup < 0:
        raise DFlash2Error(f"--warmup={a.warmup} must be >= 0")
    if a.profile_top < 1:
        raise DFlash2Error(f"--profile-top={a.profile_top} must be >= 1")
    if a.profile_trace and not a.profile:
        raise DFlash2Error("--profile-trace writes the profiled step's trace: add --profile")
    a.selected = variants(
        _choices(a.attention, ATTENTION, "--attention"),
        _choices(a.ce, CE, "--ce"),
        _choices(a.features, FEATURES, "--features"),
    )
    return a


def run(argv: list[str] | None = None) -> dict:
    """Measure every selected variant; print the table (and the profile); write --out. Returns the results."""
    a = parse_args(argv)
    if a.threads:  # a CPU shared with other jobs runs small matmuls far faster on one thread
        torch.set_num_threads(a.threads)
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    peak = a.peak_tflops * 1e12 if a.peak_tflops else (H200_BF16_DENSE_FLOPS if device.type == "cuda" else None)
    started = time.perf_counter()
    bench = build_bench(a, device)
    setup_s = time.perf_counter() - started
    profile_key = HEADLINE
    results = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "command": " ".join([PROG, shlex.join(sys.argv[1:] if argv is None else argv)]).strip(),
        "environment": environment(device),
        "settings": {
            "shape": a.shape,
            "rows": bench.rows,
            "seq": bench.seq,
            "prompt_tokens": a.prompt_tokens,
            "block_size": a.block,
            "anchors": a.anchors,
            "drafter": a.drafter,
            "drafter_layers": a.layers,
            "drafter_params": sum(p.numel() for p in bench.drafter.parameters()),
            "target_params": sum(p.numel() for p in bench.target.model.parameters()),
            "target_dtype": str(bench.target.dtype).removeprefix("torch."),
            "taps": list(bench.target.target_layer_ids),
            "loss_chunk_positions": bench.chunk,
            "loss_kernels": check_loss_kernels(bench.settings.get("loss_kernels")),
            "conv_kernels": check_conv_kernels(bench.settings.get("conv_kernels")),
            "norm_kernels": check_norm_kernels(bench.settings.get("norm_kernels")),
            "loss_topk_kernel": check_loss_topk_kernel(bench.settings.get("loss_topk_kernel")),
            "loss_keep_logits": check_loss_keep_logits(bench.settings.get("loss_keep_logits")),
            "drafter_overrides": a.set or [],
            "pinned_batches": bench.pinned,
            "warmup": a.warmup,
            "steps": a.steps,
            "repeats": a.repeats,
            "seed": a.seed,
            "setup_s": round(setup_s, 1),
        },
        "peak_flops": peak,
        "mfu_formula": MFU_FORMULA,
        "rows": [],
    }
    wanted_profile = a.profile
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_LOG_WARNING)
        for variant in tqdm(a.selected, desc="variants", unit="row"):
            # the headline row carries the profile; on the CPU (no flex) the first row that runs does
            profile = wanted_profile and (variant.key == profile_key or device.type != "cuda")
            t0 = time.perf_counter()
            row = guarded_row(bench, variant, lambda v=variant, p=profile: measure(bench, v, a, peak, p))
            row["row_s"] = round(time.perf_counter() - t0, 1)
            if "profile" in row:
                row["profile"]["variant"] = variant.name
                results["profile"] = row.pop("profile")
                wanted_profile = False
            results["rows"].append(row)
            if a.out is not None:  # after every row: a run stopped half-way keeps what it measured
                write_json(a.out, results)
    print(report_text(results))
    return results


def report_text(results: dict) -> str:
    s = results["settings"]
    parts = [
        f"Drafter training throughput, {results['environment']['device_name']}, shape {s['shape']} (random weights, "
        f"target {s['target_dtype']}), drafter {s['drafter']} {s['drafter_layers']} layers "
        f"({s['drafter_params'] / 1e6:.1f} M params), {s['rows']} rows x {s['seq']} tokens, block {s['block_size']}, "
        f"{s['anchors']} anchors/row; {s['warmup']} warm-up + {s['repeats']} x {s['steps']} timed steps per row.",
        "",
        markdown_table(results["rows"]),
        "",
        *column_lines(),
        "",
        *flops_lines(results["rows"], results["peak_flops"]),
    ]
    if "profile" in results:
        parts += ["", profile_table(results["profile"])]
    return "\n".join(parts)


def write_json(path: Path, results: dict) -> None:
    from dflash2.atomic_files import atomic_write_with

    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(results, indent=2) + "\n"
    atomic_write_with(path, lambda tmp: Path(tmp).write_text(text))


def main() -> None:
    from dflash2.logging_setup import configure_console_logging

    configure_console_logging()
    try:
        run()
    except DFlash2Error as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
