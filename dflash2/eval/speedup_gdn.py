"""GDN modes in ``eval.speedup``: ReplaySSM vs native rollback on a hybrid target (docs/ARCHITECTURE.md §5.5, §6).

A hybrid target (one with Gated DeltaNet layers) is measured once per mode of ``gdn_modes``
(``"replay"``: Triton ReplaySSM, ``"native"``: Triton native rollback, the ablation; ``"reference"``:
the plain-PyTorch loop; ``"auto"``: the device's default). The engine is the same for all of them:
only the states the target makes change (``model.gdn_mode``). Per mode and batch size this module
adds to what ``speedup.run_speedup`` measures end to end:

* the per-GDN-layer cost of one speculative step at the target's *own* GDN shape and the drafter's
  block size, from ``dflash2.runtime.bench_gdn.measure`` (verify of every GDN layer + commit of the
  whole block — ReplaySSM's deferred: the fold runs in the next verify —, random inputs, CUDA
  graphs; timed on CUDA, and on the CPU only under Triton's
  interpreter, where the numbers mean nothing but the path runs);
* the speculative-state bytes per request (from the shapes, so always; checked against the bytes the
  bench's logs really held whenever it runs) and the committed state per request for scale.

A target without GDN layers has nothing to choose: the modes are recorded as not applicable and the
run measures the runtime once, as before.
"""

from __future__ import annotations

import json
from contextlib import contextmanager

import torch

from dflash2.errors import DFlash2Error
from dflash2.runtime.bench_gdn import GDNShape, MiB, measure, spec_bytes
from dflash2.runtime.gdn_state import GDN_MODE_CHOICES, NATIVE_MAX_TOKENS, resolve_gdn_mode

TRITON_MODES = ("replay", "native")


def _interpreting() -> bool:
    """Triton's interpreter is on (CPU tensors can run the kernels); False when Triton is missing."""
    from dflash2.runtime import kernels

    if not kernels.available():
        return False
    from dflash2.runtime.kernels.triton_util import interpreting

    return interpreting()


def check_names(requested) -> list[str]:
    """The mode names as strings; a name GDNState does not know is a user error (before any model loads)."""
    requested = [str(m) for m in requested]
    bad = [m for m in requested if m not in GDN_MODE_CHOICES]
    if bad:
        raise DFlash2Error(f"gdn_modes {bad} not known; use some of {list(GDN_MODE_CHOICES)}")
    return requested


def plan_modes(target, requested) -> list[str]:
    """The concrete modes to measure, in the order asked (the first is the headline); [] when the
    target has no GDN layers. A mode that cannot run here is a user error, before anything is timed.

    requested: names from ``GDN_MODE_CHOICES``; ``"auto"`` is resolved by the target's device.
    """
    requested = check_names(requested)
    if GDNShape.of_model(target) is None:
        return []
    if not requested:
        raise DFlash2Error("gdn_modes is empty: a hybrid target needs at least one GDN mode to run")
    device = target.embed.weight.device
    modes = [resolve_gdn_mode(m, device) for m in requested]
    if len(set(modes)) != len(modes):
        raise DFlash2Error(f"gdn_modes {requested} name one mode twice (on {device.type}: {modes})")
    triton = [m for m in modes if m in TRITON_MODES]
    if triton and device.type != "cuda" and not _interpreting():
        raise DFlash2Error(
            f"gdn_modes {triton} run Triton kernels, which need a CUDA target (or TRITON_INTERPRET=1 in the "
            "environment on the CPU, very slow); pass gdn_modes=[reference] on the CPU"
        )
    return modes


def summary(target, requested, modes: list[str], block_size: int) -> dict:
    """What results.json records about the modes: applicable or not, and the GDN shape measured."""
    shape = GDNShape.of_model(target)
    if shape is None:
        return {
            "applicable": False,
            "requested": [str(m) for m in requested],
            "reason": "the target has no GDN layers",
        }
    return {
        "applicable": True,
        "requested": [str(m) for m in requested],
        "modes": list(modes),
        "headline": modes[0],
        "shape": {**vars(shape), "conv_dim": shape.conv_dim},
        "block_size": block_size,
    }


@contextmanager
def gdn_mode(target, mode: str | None, kernel_options: dict | None = None):
    """States made inside use ``mode`` (None: leave the target's own) and, if given, GDNState's
    ``kernel_options`` (e.g. {"chunked": True}); the target's own are restored after."""
    old = target.gdn_mode, getattr(target, "gdn_kernel_options", {})
    if mode is not None:
        target.gdn_mode = mode
    if kernel_options is not None:
        target.gdn_kernel_options = dict(kernel_options)
    try:
        yield
    finally:
        target.gdn_mode, target.gdn_kernel_options = old


def committed_bytes(shape: GDNShape, itemsize: int) -> int:
    """Committed GDN state per request over all GDN layers: recurrent (H, d_k, d_v) fp32 + conv window
    (C, K-1) in the model dtype (what ``GDNState`` allocates per row)."""
    rec = shape.num_v_heads * shape.head_k_dim * shape.head_v_dim * 4
    return shape.num_layers * (rec + shape.conv_dim * (shape.conv_kernel - 1) * itemsize)


def layer_cost(target, mode: str, N: int, T: int, *, iters: int = 50, kernel_options: dict | None = None) -> dict:
    """One speculative step's GDN cost at the target's shape, per GDN layer: verify of T tokens in every
    GDN layer + commit of all T (the most a fold does), N rows, the target's dtype and device. ReplaySSM
    commits as the engine's slots do, deferred: its verify µs include the fold of the previous commit.

    Returns verify_us / commit_us / total_us (None when not timed), spec_bytes_per_request (all GDN
    layers: ReplaySSM's k/u/g logs (and the deferred commit's counts and stash) or native's T states,
    plus the T pre-conv inputs),
    state_bytes_per_request (committed), spec_layout ('replay' | 'native': native stores states only
    for blocks of ≤ NATIVE_MAX_TOKENS tokens) and timed. kernel_options: GDNState's (bench_gdn --options).
    """
    shape = GDNShape.of_model(target)
    weight = target.embed.weight
    itemsize, device = weight.element_size(), weight.device
    layout = "native" if mode == "native" and T <= NATIVE_MAX_TOKENS else "replay"
    out = {
        "verify_us": None,
        "commit_us": None,
        "total_us": None,
        "spec_bytes_per_request": spec_bytes(shape, T, layout, x_itemsize=itemsize, deferred=mode == "replay"),
        "state_bytes_per_request": committed_bytes(shape, itemsize),
        "spec_layout": layout,
        "timed": False,
    }
    cuda = device.type == "cuda"
    if not (cuda or _interpreting()):  # the Triton modes cannot run on CPU tensors; the bytes need no run
        return out
    # interpreted (CPU): one pass, so the path is exercised and its bytes checked; its µs mean nothing
    row = measure(
        shape,
        N,
        T,
        mode,
        dtype=weight.dtype,
        device=device,
        iters=iters if cuda else 1,
        warmup=3 if cuda else 0,
        kernel_options=kernel_options,
    )
    # the formula must be what the logs hold, at the block_v the state ran (GDNState picks one on CUDA: its
    # pending counts are one int32 per recurrence program)
    bv = (row.resolved_options or {}).get("block_v")
    out["spec_bytes_per_request"] = spec_bytes(
        shape, T, layout, x_itemsize=itemsize, deferred=mode == "replay", block_v=bv
    )
    if row.spec_bytes_per_request != out["spec_bytes_per_request"]:
        raise RuntimeError(f"{mode}: logs held {row.spec_bytes_per_request} B/request, shapes say {out}")
    out.update(verify_us=row.verify_us, commit_us=row.commit_us, total_us=row.total_us, timed=True)
    out["kernel_options_ran"] = dict(row.resolved_options or {})  # the bench state's, resolved as the engine's
    if cuda:
        torch.cuda.empty_cache()  # native's T states per row are large; the next mode starts clean
    return out


# ----------------------------------------------------------------------------- report
def _size(b: float) -> str:
    return f"{b / MiB:.2f} MiB" if b >= MiB else f"{b / 1024:.1f} KiB"


def _us(v) -> str:
    return "—" if v is None else f"{v:.1f}"


def mode_rows(row: dict) -> list[tuple[str | None, dict]]:
    """(mode, sub-row) of one batch row: the headline first, then the other modes (mode None: not hybrid)."""
    return [(row.get("gdn_mode"), row), *row.get("other_gdn_modes", {}).items()]


def markdown_lines(results: dict) -> list[str]:
    """The GDN section of results.md: per (batch, mode) the per-layer cost, the bytes, end-to-end
    tokens/s and the cross-mode check; or one line saying the modes do not apply."""
    info = results.get("gdn")
    if not info:
        return []
    if not info["applicable"]:
        return ["", f"GDN modes {info['requested']}: not applicable ({info['reason']})."]
    s = info["shape"]
    lines = [
        "",
        f"GDN modes (headline: {info['headline']}). Per GDN layer, at this target's GDN shape ({s['num_layers']} "
        f"layers, {s['num_k_heads']} key / {s['num_v_heads']} value heads, d_k {s['head_k_dim']}, "
        f"d_v {s['head_v_dim']}, conv {s['conv_kernel']}) and block {info['block_size']}: verify of the block + "
        "commit of all of it (bench_gdn, random inputs; ReplaySSM's commit is deferred: its verify folds the "
        "previous commit); spec state = what a step keeps between verify and commit, per request, all GDN "
        "layers. Tokens/s: the end-to-end runs above.",
        "",
        "| batch | mode | verify µs | commit µs | total µs | spec state / request | committed / request "
        "| AR tokens/s | spec tokens/s | lossless | AR, spec == first mode's AR |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for N, row in results["batches"].items():
        for mode, sub in mode_rows(row):
            c, x = sub["gdn_layer"], sub["first_mode"]
            same = "/".join(_same_text(x[f"{k}_equals_first_mode_ar"]) for k in ("ar", "spec"))
            lines.append(
                f"| {N} | {mode} | {_us(c['verify_us'])} | {_us(c['commit_us'])} | {_us(c['total_us'])} "
                f"| {_size(c['spec_bytes_per_request'])} | {_size(c['state_bytes_per_request'])} "
                f"| {sub['ar']['tokens_per_s']['median']:.1f} | {sub['spec']['tokens_per_s']['median']:.1f} "
                f"| {_same_text(sub['lossless'], 'true', 'FALSE')} | {same} |"
            )
            notes += [
                f"- batch {N}, {mode} {k} vs first mode's AR: {json.dumps(x[f'{k}_divergence'])}"
                for k in ("ar", "spec")
                if x[f"{k}_divergence"]
            ]
        by = dict(mode_rows(row))
        rep, nat = by.get("replay"), by.get("native")
        if rep and nat:
            rc, nc = rep["gdn_layer"], nat["gdn_layer"]
            ratio = f"time {nc['total_us'] / rc['total_us']:.2f}×, " if rc["timed"] and nc["timed"] else ""
            tps = rep["spec"]["tokens_per_s"]["median"] / nat["spec"]["tokens_per_s"]["median"]
            notes.append(
                f"- batch {N}: native ÷ replay per GDN layer {ratio}speculative state "
                f"{nc['spec_bytes_per_request'] / rc['spec_bytes_per_request']:.1f}×; end-to-end spec tokens/s "
                f"replay ÷ native {tps:.2f}×"
            )
    return [*lines, "", *notes] if notes else lines


def _same_text(flag: bool | None, yes: str = "yes", no: str = "NO") -> str:
    """A comparison flag for the table: None (a sampled run, where tokens are not compared) as n/a."""
    return "n/a" if flag is None else (yes if flag else no)
