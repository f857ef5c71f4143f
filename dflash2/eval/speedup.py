"""``eval.speedup``: what speculative decoding buys, measured in one run on one device (docs/ARCHITECTURE.md §6).

For each batch size, on the same prompts and weights:

    (a) HF ``generate``, greedy                 what users have today
    (b) runtime AR decode (CUDA graphs on GPU)  the honest baseline
    (c) runtime speculative decode              the drafter's worth

Every batch size N decodes every prompt: (b) and (c) run the prompts as consecutive batches of N
rows, the last batch holding the rest at its own size (the runtime serves it in its own batch bucket,
as it would serve a request of that size); with fewer prompts than N, one batch of the prompts cycled
to N rows (the repeats are decoded and measured like any row: a throughput figure at batch N). (a) HF
``generate`` decodes the first batch only (it is slow), the ablation row the first prompt; every
method's ``decoded`` field says how many prompts and rows it decoded, in which batches.

Each is warmed up (a full pass over the batches: graphs captured, kernels compiled) and then run
``runs`` times; reported are the median and the spread (min, max) over runs of the per-run median
step time (over the steps of all its batches), tokens/s (generated tokens of all rows over the
batches' summed wall time, prefills included), τ (over all rows) and the step-time breakdown
(draft / verify / accept / commit = rollback, and the host gap between steps, from CUDA events
between phases), the mean step time beside the median, the spread of the step times
(``step_spread``: percentiles, the mean per quarter of a generation and, for spec, per count of
tokens the previous step emitted; step_spread.py), and the time each generation spends outside its
decode steps (``outside_steps_ms``: the pass's wall time less the sum of its step times, per
generation — the prefill, the setup before it and the read-back after the steps). With
``prefill_graph_tokens`` > 0 (the default on CUDA: 64) the Decoders prefill prompts up to that width as CUDA graphs
(runtime/prefill.py; recorded in the results); the warm-up then runs twice, so that every prefill
graph is captured before the timed runs. The weight-read bound is the model's weight bytes (one
read per step) over the device-to-device copy bandwidth measured in the same run; the AR step's
fraction of it and the achieved GB/s are printed beside. Lossless: (c) must equal (b) token for token on every row of
every batch; the first divergence is reported with its row and prompt index (over all rows, not
within its batch) and the target's logit margin between the two tokens in the run's dtype. With
``hf_check_tokens`` > 0 (a trained pair, greedy), HF ``generate`` also decodes every prompt once, untimed,
and each batch size's (b) and (c) rows are compared with it token for token (``results["hf_check"]``: rows
equal per method, and every differing row's first divergence with its logit margin): the three-way check.
Random-weight shapes give real step times but meaningless τ: speedups there are predictions from a
given τ and the measured step times, and labelled so.

Attention runs whatever ``set_attention_backend`` chose (the runtime's default: the Triton decode
kernel on CUDA); ``results["attention"]`` records what decode blocks actually ran on the device
(``cache.attention_in_use``). Likewise the target's projections run the GEMM ``set_gemm_backend``
chose (gemm.py; the default ``F.linear``, cuBLAS; 'skinny': the Triton skinny GEMM for ≤ 128 rows),
recorded in ``results["gemm"]`` as what ran (``gemm.gemm_in_use``). The ablation row
(``ablate_kernels``, GPU) is runtime AR at batch 1 without our Triton kernels (``kernels(False)``):
eager twins of the fused kernels, PyTorch's SDPA for attention and ``F.linear`` for the GEMMs (its
``attention`` and ``gemm`` fields say so); GDN layers keep the headline mode (its ``gdn_mode``).

A hybrid target (Gated DeltaNet layers) runs (b) and (c) once per GDN mode of ``gdn_modes``
(ReplaySSM, native rollback, ...; speedup_gdn.py): each mode's lossless flag compares its own (c)
with its own (b), and each mode's (b) and (c) are also compared with the first mode's (b) token for
token; beside them, the per-GDN-layer verify + commit µs and speculative-state bytes per request at
the target's own GDN shape.

Hydra-free (the CLI is ``dflash2.eval.speedup_cli``); :func:`run_speedup` returns the results dict,
speedup_report.py writes the files; (a) and the HF greedy check are speedup_hf.py's; the helpers both use
(timing statistics, rows and batches, divergences) are speedup_rows.py's.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from dflash2.decoding.decoder import SpecResult
from dflash2.eval import speedup_gdn, step_spread
from dflash2.eval.speedup_hf import (
    _hf_check_lossless,
    hf_check_line,
    hf_check_skipped,
    hf_greedy,
    run_hf_check,
    time_hf,
)
from dflash2.eval.speedup_report import PHASES, decoded_text, lossless_text, write_results
from dflash2.eval.speedup_rows import (  # noqa: F401 (first_divergence, row_divergences: this module's API too)
    GREEDY,
    _stats,
    _sync,
    decoded,
    first_divergence,
    is_sampled,
    prompt_rows,
    row_divergences,
    split_batches,
)
from dflash2.runtime import Decoder, kernels
from dflash2.runtime.cache import attention_in_use
from dflash2.runtime.engine import default_prefill_graph_tokens
from dflash2.runtime.gemm import gemm_in_use
from dflash2.runtime.graphs import PhaseTimer
from dflash2.runtime.prefill import prefill_bucket


# ----------------------------------------------------------------------------- ceilings
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


# ----------------------------------------------------------------------------- (b), (c) runtime
def time_runtime(
    dec: Decoder,
    prompts,
    new_tokens: int,
    runs: int,
    spec: bool,
    progress=None,
    sampling=None,
    seed: int = 0,
    batch_size: int | None = None,
    warmup_passes: int | None = None,
) -> dict:
    """A warm-up pass, then ``runs`` timed passes with per-phase CUDA events. A pass decodes every row of
    ``prompts`` as consecutive batches of ``batch_size`` rows (None: one batch of all; :func:`split_batches`).
    Greedy, or sampled with ``sampling`` (:data:`GREEDY`'s keys), every generation (one batch) drawing from
    a generator seeded with ``seed``.

    Per pass: tokens/s = new tokens of all rows / the batches' summed wall time (prefills included);
    ms/step and each phase = the median over the steps of all batches, mean_step_ms their mean;
    generation_ms = the wall time per generation (batch) and outside_steps_ms = the part of it outside the
    decode steps: (the batches' summed wall time − the sum of their step times) / batches, i.e. prefill,
    setup and read-back (wall time on the host, step times from CUDA events; the steps lie inside the wall
    time, so 0 ≤ outside ≤ generation, up to the two clocks' resolution). τ (spec) = tokens emitted by
    verify steps / verify steps, over all rows of the last pass; sequences: its rows in ``prompts``' order.
    ``progress`` advances by one per timed batch. The warm-up is one pass, two when the Decoder graphs its
    prefill (one prefill per generation: the second pass captures it); ``warmup_passes`` overrides that
    count (tests under Triton's interpreter, whose timings mean nothing, pass 0)."""
    sampled = is_sampled(sampling)
    params = dict(sampling or GREEDY)
    batches = split_batches(list(prompts), batch_size or len(prompts))

    def gen(batch):
        kw = dict(params)
        if sampled:
            kw["generator"] = torch.Generator(device=dec.device).manual_seed(seed)
        if spec:
            res = dec.generate_spec(batch, new_tokens, **kw)
            return res.sequences, res
        return dec.generate_ar(batch, new_tokens, **kw), None

    # warm-up: first uses run eagerly, second uses capture (each batch bucket); a prefill runs once per
    # generation, so a graphed one is captured by a second pass
    if warmup_passes is None:
        warmup_passes = 2 if dec.graphs and getattr(dec, "prefill_graph_tokens", 0) > 0 else 1
    for _ in range(warmup_passes):
        for batch in batches:
            gen(batch)
    per_run, walls, toks, outs = [], [], [], []
    mean_steps, generation, outside = [], [], []
    step_series, emitted = [], []  # every timed generation's step ms, and (spec) its rows' emitted counts
    per_run_spread = []  # each run's percentiles and mean step: a slow run apart from a few slow steps in every run
    for _ in range(runs):
        timers, outs, wall = [], [], 0.0
        for batch in batches:
            # a timer per batch: a step's begin-to-begin time never spans the next batch's prefill
            dec.timer = PhaseTimer(dec.device)
            _sync(dec.device)
            t0 = time.perf_counter()
            outs.append(gen(batch))
            _sync(dec.device)
            wall += time.perf_counter() - t0
            timers.append(dec.timer)
            if progress is not None:
                progress.update(1)
        dec.timer = None
        run_steps = [timer.summary().get("step", []) for timer in timers]
        step_series += run_steps
        flat = [ms for steps in run_steps for ms in steps]
        per_run_spread.append({**step_spread.percentiles(flat), "mean": statistics.fmean(flat) if flat else 0.0})
        emitted += [res.emitted for _, res in outs if res is not None]
        pooled = _pooled(timers)
        per_run.append({k: statistics.median(v) for k, v in pooled.items()})
        steps = pooled.get("step", [])
        mean_steps.append(statistics.fmean(steps) if steps else 0.0)
        generation.append(wall * 1e3 / len(batches))
        outside.append((wall * 1e3 - sum(steps)) / len(batches))
        walls.append(wall)
        toks.append(sum(len(seq) for seqs, _ in outs for seq in seqs))
    out = {
        "ms_per_step": _stats([r["step"] for r in per_run]),
        "mean_step_ms": _stats(mean_steps),
        "tokens_per_s": _stats([t / w for t, w in zip(toks, walls)]),
        "generation_ms": _stats(generation),
        "outside_steps_ms": _stats(outside),
        "phases_ms": {p: _stats([r[p] for r in per_run]) for p in PHASES if all(p in r for r in per_run)},
        # which steps make the mean exceed the median (step_spread.py), over every timed generation
        "step_spread": {
            **step_spread.spread(step_series, emitted if spec else None),
            "per_run_ms": per_run_spread,
        },
        "new_tokens": new_tokens,
        "decoded": decoded(list(prompts), batches),
        "sequences": [seq for seqs, _ in outs for seq in seqs],
    }
    if spec:
        res = _concat([r for _, r in outs])
        out["tau"] = res.mean_tau
        out["steps"] = sum(res.steps)
    return out


def _pooled(timers: list[PhaseTimer]) -> dict[str, list[float]]:
    """The per-step times of several timers (one per batch), phase by phase, as one timer's summary."""
    out: dict[str, list[float]] = {}
    for timer in timers:
        for phase, ms in timer.summary().items():
            out.setdefault(phase, []).extend(ms)
    return out


def _concat(results: list[SpecResult]) -> SpecResult:
    """The SpecResults of consecutive batches as one over all their rows (τ is then over all rows)."""
    return SpecResult(
        [seq for r in results for seq in r.sequences],
        [acc for r in results for acc in r.accepted_drafts],
        [em for r in results for em in r.emitted],
        results[0].block_size,
    )


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
    s = dec.slot(N)
    graphs = {k: g for k, g in s.graphs.graphs.items() if k[0] == "ar_forward"}
    if graphs:
        return _kernel_profile(graphs[max(graphs)].replay, "graph replay", dec.device, reps)
    return _kernel_profile(lambda: dec.model(s.token[:, None], s.state), "eager", dec.device, reps)


# Speculative phases whose graph may be replayed on its own for a profile: each writes the same values
# again from the same inputs (draft: the proposals and the drafter's block K/V; verify: the block's K/V,
# logits and GDN log). Not accept or commit: they advance the rows.
REPLAYABLE_SPEC_PHASES = ("draft", "verify")


def profile_spec_phases(dec: Decoder, N: int, reps: int = 5) -> dict:
    """Kernels of the last speculative generation's draft and verify graphs at batch ``N`` (the largest
    attended-length bucket captured), each replayed ``reps`` times: {phase: profile} like
    :func:`profile_ar_step`; empty where no graph was captured (CPU, or sampling that runs eagerly)."""
    graphs = dec.slot(N).graphs.graphs
    out = {}
    for phase in REPLAYABLE_SPEC_PHASES:
        keys = [k for k in graphs if k[0] == phase]
        if keys:
            key = max(keys, key=lambda k: k[1])  # the longest attended-length bucket: the run's late steps
            out[phase] = _kernel_profile(graphs[key].replay, "graph replay", dec.device, reps)
    return out


def _kernel_profile(fn, how: str, device, reps: int) -> dict:
    """CUDA kernels of ``reps`` calls of ``fn`` (after one untimed call), per call: totals, GEMM share, top 15."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    _sync(device)
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        _sync(device)
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
    hf_check_tokens: int = 0,
    copy_bytes: int,
    predict_taus=(),
    profile: bool = True,
    ablate_kernels: bool = True,
    gdn_modes=("replay", "native"),
    gdn_bench_iters: int = 50,
    gdn_kernel_options: dict | None = None,
    output_dir=None,
    log=print,
    extra: dict | None = None,
    sampling: dict | None = None,
    seed: int = 0,
    prefill_graph_tokens: int | None = None,
    gc_pause: bool = False,
    overlap_context: bool = True,
    warmup_passes: int | None = None,
) -> dict:
    """Measure (a), (b), (c) for each batch size on ``pair`` (speedup_setup.Pair); write results if output_dir.

    At each batch size N, (b) and (c) decode every prompt of the pair, in consecutive batches of N rows
    (:func:`prompt_rows`, :func:`split_batches`); (a) the first batch. Each method's ``decoded`` records it.
    gdn_modes: for a hybrid target, (b) and (c) are measured once per mode (speedup_gdn.py); the first is
    the headline row, the others go to each batch row's ``other_gdn_modes``. Ignored (recorded as not
    applicable) for a target without GDN layers. gdn_bench_iters: replays per phase of the per-layer bench.
    gdn_kernel_options: GDNState's kernel_options for every mode's states and the per-layer bench (e.g.
    {"chunked": True}: ReplaySSM's chunked verify recurrence; modes without the knob ignore it).
    extra: settings recorded in the results as they are (e.g. the attention backend asked for); the attention
    that ran is recorded as ``attention`` regardless. sampling: None / temperature 0 = greedy (the lossless
    check compares tokens); temperature > 0 (with top_k, top_p) samples every method, each generation from
    a generator seeded with ``seed``: tokens/s and τ are measured, and no token comparison is made (sampled
    outputs of two methods differ by design; the runtime's T>0 distribution is checked by
    tests/test_runtime_sampling.py's chi-square tests). prefill_graph_tokens: every Decoder's (0: eager prefill;
    > 0: prompts up to that width prefilled as CUDA graphs, runtime/prefill.py; None: the Decoder's default,
    64 on CUDA and 0 on the CPU), recorded in the results as resolved. gc_pause: every Decoder's (its decode loops with
    Python's cyclic garbage collector off; the deferred collection lands after the loop, in the wall time:
    compare tokens/s and outside_steps_ms, not only the steps), recorded. overlap_context: every Decoder's (the
    drafter's context K/V written on a side stream beside the verify's last target layers; False: in line before
    them, right after the last tapped layer),
    recorded. warmup_passes: untimed passes before each runtime measurement (None: time_runtime's own count;
    0 in tests under Triton's interpreter, where timings mean nothing), recorded when given.
    hf_check_tokens: 0 = off; n > 0 = HF greedy ``generate`` of every prompt once (n new tokens per row, untimed,
    in batches of max(batch_sizes) rows, :func:`hf_greedy`), compared at each batch size with the headline
    mode's AR and spec rows (:func:`compare_with_hf`): ``results["hf_check"]`` and each batch row's
    ``hf_check_lossless`` (None where not run; skipped, with the reason recorded, for random weights, a
    sampled run or a pair without its HF model)."""
    target, drafter = pair.target, pair.drafter
    device = target.embed.weight.device
    B = drafter.block_size
    modes = speedup_gdn.plan_modes(target, gdn_modes)  # [] without GDN layers; user errors before any timing
    longest = max(len(p) for p in pair.prompts)
    max_len = longest + max_new_tokens + B + 1
    # None: the Decoder's default (64 with CUDA graphs, 0 on the CPU), resolved here to make room and record it
    prefill_graph_tokens = default_prefill_graph_tokens(device.type == "cuda", prefill_graph_tokens)
    if 0 < longest <= prefill_graph_tokens:  # the bucketed prefill writes K/V up to its bucket: room for it
        max_len = max(max_len, prefill_bucket(longest))
    decoder_options = dict(
        prefill_graph_tokens=prefill_graph_tokens, gc_pause=bool(gc_pause), overlap_context=bool(overlap_context)
    )
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
        "sampling": dict(sampling or GREEDY),
        "num_prompts": len(pair.prompts),  # every runtime row decodes all (see each method's ``decoded``)
        "prefill_graph_tokens": int(prefill_graph_tokens),  # 0: eager prefill
        "gc_pause": bool(gc_pause),  # the decode loops ran with Python's cyclic GC off
        "overlap_context": bool(overlap_context),  # the drafter's context K/V beside the verify's last layers
        **({} if warmup_passes is None else {"warmup_passes": int(warmup_passes)}),  # a test's override only
        **(extra or {}),
        "attention": attention_in_use(device),  # what decode blocks ran (prefill: SDPA), fallbacks applied
        "gemm": gemm_in_use(device),  # what the target's decode-sized projections ran, fallbacks applied
        "gdn": speedup_gdn.summary(target, gdn_modes, modes, B),
        "gdn_kernel_options": dict(gdn_kernel_options or {}),
        "hf_check": None,  # hf_check_tokens > 0: the HF greedy check (speedup_hf.run_hf_check)
        "batches": {},
    }
    where = f"{pair.label} on {results['device']}"
    log(f"{where}: weights {wbytes / 1e9:.3g} GB, copy {bw / 1e9:.0f} GB/s, bound {bound_ms:.3f} ms/step")
    # each row's prompt. Random weights: one batch of the first N prompts at batch N (a step's time does not
    # depend on the prompt, and every row's τ is meaningless): no device time on repeats of the same figure.
    index_of = {N: prompt_rows(N if pair.random else len(pair.prompts), N) for N in batch_sizes}
    prompts_of = {N: [pair.prompts[i] for i in index_of[N]] for N in batch_sizes}
    rows = {N: {} for N in batch_sizes}
    for N in batch_sizes:
        if pair.hf is not None and hf_new_tokens > 0:  # HF's own GDN path: the same for every mode
            # the first batch only: HF generate is too slow for every prompt at every batch size
            rows[N]["hf"] = time_hf(pair.hf, prompts_of[N][:N], hf_new_tokens, runs, sampling)
    hf_sequences = None  # HF greedy of every prompt, for the check after all modes are measured
    if hf_check_tokens > 0:
        skipped = hf_check_skipped(pair, sampling)
        check_batch = max(batch_sizes)
        if skipped:
            results["hf_check"] = {"new_tokens": hf_check_tokens, "skipped": skipped}
            log(f"HF greedy check skipped: {skipped}")
        else:
            log(
                f"HF greedy check: {len(pair.prompts)} prompts × {hf_check_tokens} new tokens in batches of "
                f"{check_batch} (untimed)"
            )
            # no more tokens than the runtime rows have to compare with
            hf_sequences = hf_greedy(pair.hf, pair.prompts, min(hf_check_tokens, max_new_tokens), check_batch)
            if device.type == "cuda":
                torch.cuda.empty_cache()  # HF's dynamic caches: not in the runtime's way
    batches = sum(len(split_batches(index_of[N], N)) for N in batch_sizes)
    progress = _progress(batches * 2 * runs * max(1, len(modes)))  # timed batches, AR and spec, every mode
    first_ar = {}  # batch -> the headline mode's AR sequences: every mode is compared with them
    measured = (max_new_tokens, runs, bound_ms, wbytes, predict_taus, progress, sampling, seed)  # every mode, N
    sampled = is_sampled(sampling)
    for i, mode in enumerate(modes or [None]):  # None: not a hybrid, one pass with the target as it is
        if progress is not None and mode is not None:
            progress.set_description(f"timed generations, GDN {mode}")
        with speedup_gdn.gdn_mode(target, mode, gdn_kernel_options):
            # new states (and graphs) in this mode
            dec = Decoder(target, drafter, max_len=max_len, **decoder_options)
            for N in batch_sizes:
                prompts = prompts_of[N]
                sub = _measure_mode(
                    dec, prompts, *measured, batch_size=N, prompt_index=index_of[N], warmup_passes=warmup_passes
                )
                if mode is not None:
                    first_ar.setdefault(N, sub["ar"]["sequences"])
                    sub["first_mode"] = cross_mode(target, prompts, first_ar[N], sub, sampled, index_of[N])
                    sub["gdn_layer"] = speedup_gdn.layer_cost(
                        target, mode, N, B, iters=gdn_bench_iters, kernel_options=gdn_kernel_options
                    )
                    # what the engine's GDN states ran, per slot bucket (GDNState resolves e.g. block_v on CUDA)
                    sub["gdn_kernel_options_ran"] = {
                        str(n): s.state.gdn.options_ran()
                        for n, s in sorted(dec.slots.items())
                        if s.state.gdn is not None
                    }
                # the bucket widths the prefills actually ran at ([]: all eager), not just the setting
                sub["prefill_widths"] = prefill_widths(dec)
                if i == 0:
                    rows[N].update(sub, gdn_mode=mode)
                else:
                    rows[N].setdefault("other_gdn_modes", {})[mode] = sub
                log(_row_line(N, rows[N] if i == 0 else sub, bound_ms, mode))
            if i == 0:  # profile and ablation of the headline mode
                if profile and device.type == "cuda":
                    results["profile_ar_batch1"] = profile_ar_step(dec, 1)
                    results["profile_spec_batch1"] = profile_spec_phases(dec, 1)
                if ablate_kernels and device.type == "cuda":
                    # the same graphs with the eager twins inside and SDPA attention: what our Triton kernels buy;
                    # on the first prompt only (a step-time figure at batch 1; its ``decoded`` says so)
                    with kernels.kernels(False):
                        plain = Decoder(target, None, max_len=max_len, **decoder_options)
                        results["ablation_ar_batch1_no_fused_kernels"] = {
                            **_strip(
                                time_runtime(plain, pair.prompts[:1], max_new_tokens, runs, False, None, sampling, seed)
                            ),
                            "gdn_mode": mode,
                            "attention": attention_in_use(device),
                            "gemm": gemm_in_use(device),
                        }
                    del plain
            del dec
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the next mode's caches (native: T states per row) start from a clean pool
    if progress is not None:
        progress.close()
    if hf_sequences is not None:  # before _strip drops the sequences
        results["hf_check"] = run_hf_check(
            target, hf_sequences, min(hf_check_tokens, max_new_tokens), check_batch, rows, prompts_of, index_of
        )
        log(hf_check_line(results["hf_check"]))
    for N, row in rows.items():
        row["hf_check_lossless"] = _hf_check_lossless(results["hf_check"], N)
        if "hf" in row and not sampled:
            n = row["hf"]["new_tokens"]
            hf_ar = zip(row["hf"]["sequences"], row["ar"]["sequences"])  # HF's rows: the first batch's, AR's first
            row["hf_prefix_equals_ar"] = [h[:n] == a[:n] for h, a in hf_ar]
        for _, sub in speedup_gdn.mode_rows(row):
            for k in ("hf", "ar", "spec"):
                if k in sub:
                    sub[k] = _strip(sub[k])
        results["batches"][str(N)] = row
    if output_dir is not None:
        write_results(results, Path(output_dir))
    return results


def prefill_widths(dec: Decoder) -> list[int]:
    """The bucket widths ``dec``'s prefills ran at so far, over all its slots ([]: every prefill was eager)."""
    return sorted({w for slot in dec.slots.values() if slot.prefill for w in slot.prefill.widths})


def _measure_mode(
    dec,
    prompts,
    max_new_tokens,
    runs,
    bound_ms,
    wbytes,
    predict_taus,
    progress,
    sampling=None,
    seed=0,
    *,
    batch_size=None,
    prompt_index=None,
    warmup_passes=None,
) -> dict:
    """(b) and (c) on one Decoder (one GDN mode), their lossless flag and ratios: one (sub-)row. Every row
    of ``prompts`` is decoded in batches of ``batch_size`` (:func:`time_runtime`); lossless = every row of
    every batch equal, the divergence naming its row over all batches and its prompt (``prompt_index``).
    Sampled runs (temperature > 0) have no token-level lossless flag: ``lossless`` is None there."""
    timed = dict(
        runs=runs, progress=progress, sampling=sampling, seed=seed, batch_size=batch_size, warmup_passes=warmup_passes
    )
    ar = time_runtime(dec, prompts, max_new_tokens, spec=False, **timed)
    spec = time_runtime(dec, prompts, max_new_tokens, spec=True, **timed)
    step, spec_step = ar["ms_per_step"]["median"], spec["ms_per_step"]["median"]
    lossless = None if is_sampled(sampling) else spec["sequences"] == ar["sequences"]
    return {
        "ar": ar,
        "spec": spec,
        "ar_fraction_of_bound": bound_ms / step,
        "ar_weight_GBps": wbytes / step / 1e6,
        "verify_over_ar_step": spec["phases_ms"]["verify"]["median"] / step,
        "lossless": lossless,
        "divergence": None
        if lossless is not False
        else first_divergence(dec.model, prompts, ar["sequences"], spec["sequences"], prompt_index),
        "speedup_measured": spec["tokens_per_s"]["median"] / ar["tokens_per_s"]["median"],
        "predicted": [{"tau": t, "speedup": t * step / spec_step, "label": "prediction"} for t in predict_taus],
    }


def cross_mode(model, prompts, first_ar, sub: dict, sampled: bool = False, prompt_index=None) -> dict:
    """Whether a mode's AR and spec outputs equal the first mode's AR output token for token, and the first
    divergence of each (both tokens and their logit margin) where not. Modes differ only in how GDN states
    are kept, so a difference is either rounding (a near-tie margin) or a state bug. Sampled runs: None
    (not compared). Rows and prompt_index as in :func:`first_divergence`."""
    out = {}
    for key in ("ar", "spec"):
        if sampled:
            out[f"{key}_equals_first_mode_ar"] = out[f"{key}_divergence"] = None
            continue
        seqs = sub[key]["sequences"]
        equal = seqs == first_ar
        out[f"{key}_equals_first_mode_ar"] = equal
        out[f"{key}_divergence"] = None if equal else first_divergence(model, prompts, first_ar, seqs, prompt_index)
    return out


def _strip(d: dict) -> dict:
    """Drop the token lists (kept only for the comparisons) from a timing dict."""
    return {k: v for k, v in d.items() if k != "sequences"}


def _progress(total: int):
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="timed generations", leave=False)


def _row_line(N: int, row: dict, bound_ms: float, mode: str | None = None) -> str:
    ar, spec = row["ar"], row["spec"]
    hf = f"HF {row['hf']['tokens_per_s']['median']:.1f} tok/s, " if "hf" in row else ""
    gdn = f" [GDN {mode}]" if mode else ""
    return (
        f"batch {N}{gdn}, {decoded_text(spec['decoded'])}: {hf}AR {ar['ms_per_step']['median']:.3f} ms/step "
        f"({row['ar_fraction_of_bound']:.0%} of bound "
        f"{bound_ms:.3f}), spec {spec['ms_per_step']['median']:.3f} ms/step tau {spec['tau']:.2f}, "
        f"verify/AR {row['verify_over_ar_step']:.2f}, lossless {lossless_text(row['lossless'])}; outside steps "
        f"AR {ar['outside_steps_ms']['median']:.2f} / spec {spec['outside_steps_ms']['median']:.2f} ms per generation"
    )
