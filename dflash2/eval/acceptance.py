"""Acceptance evaluation: real lossless speculative decoding on a prompt set (issue 4).

Hydra-free (the CLI is ``dflash2.eval.acceptance_cli``). ``evaluate_acceptance``
decodes every prompt with the reference speculative decoder, one prompt at a time
(so τ is each sequence's own), and reports:

* mean τ = tokens emitted by verify steps / verify steps, over all steps of all
  prompts (``SpecResult.mean_tau``): a step emits its accepted drafts + 1 (the
  target's bonus or correction); the prefill's first token is not a verify step's
  and is not counted; a last step cut by EOS / max_new_tokens counts only what it
  emitted. So mean τ = (generated tokens - prompts) / steps;
* per-position acceptance from the raw accepted-draft counts (before any cut):
  rate_k = #steps with accepted_drafts >= k / #steps, k = 1..B-1 (every step drafts
  all B-1 positions; position k is accepted iff 1..k all are), so
  Σ_k rate_k = mean_accepted_drafts, and mean τ <= 1 + mean_accepted_drafts, equal
  unless some last step was cut (``truncated_steps`` counts those);
* the histogram of accepted drafts 0..B-1, steps, tokens, wall time, settings;
* with ``check_lossless`` (default at T=0): whether every output equals plain
  greedy decoding of the target, and the first mismatch with the target's logit
  margin between the two tokens there (ARCHITECTURE.md §4: near rounding = numerics, large = bug).

Files in ``output_dir``: results.json, outputs.jsonl, results.md,
per_position_acceptance.png, tau_histogram.png.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from dflash2.decoding.decoder import DFlashProposer, greedy_generate, speculative_generate
from dflash2.decoding.sampling import SamplingParams
from dflash2.errors import DFlash2Error
from dflash2.eval.prompt_counts import counts_line, prompt_counts
from dflash2.eval.prompts import Prompt

log = logging.getLogger(__name__)
FILES = ("results.json", "outputs.jsonl", "results.md", "per_position_acceptance.png", "tau_histogram.png")


# ------------------------------------------------------------------ inputs
def as_prompts(prompts, tokenizer) -> list[Prompt]:
    """Prompt objects, strings (encoded with the target's tokenizer) or id lists -> list[Prompt]."""
    if prompts is None or len(prompts) == 0:
        raise DFlash2Error("the prompt set is empty; pass at least one prompt")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, Prompt):
            out.append(p)
        elif isinstance(p, str):
            if tokenizer is None:
                raise DFlash2Error("text prompts need the target's tokenizer, and this target has none; pass token ids")
            out.append(Prompt(text=p, ids=list(tokenizer(p)["input_ids"]), source=f"prompt {i}"))
        else:
            ids = [int(t) for t in p]
            text = tokenizer.decode(ids) if tokenizer is not None else ""
            out.append(Prompt(text=text, ids=ids, source=f"prompt {i}"))
    return out


def context_limit(target, drafter) -> int | None:
    """The smaller of the target's and the drafter's max_position_embeddings (None if neither says)."""
    limits = [
        getattr(target.text_config, "max_position_embeddings", None),
        getattr(drafter.config, "max_position_embeddings", None),
    ]
    limits = [int(x) for x in limits if x]
    return min(limits) if limits else None


def default_eos(target) -> list[int] | None:
    tok = target.tokenizer
    if tok is not None and tok.eos_token_id is not None:
        return [int(tok.eos_token_id)]
    eos = getattr(target.text_config, "eos_token_id", None)
    if eos is None:
        return None
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if 0 <= int(e) < target.vocab_size]


# ------------------------------------------------------------------ statistics
def acceptance_stats(accepted_drafts: list[list[int]], emitted: list[list[int]], block_size: int) -> dict:
    """Per prompt and verify step: accepted drafts (before any EOS / max_new_tokens cut) and tokens
    emitted (after it), as in ``SpecResult`` -> τ, per-position rates, histogram."""
    flat = [a for per_prompt in accepted_drafts for a in per_prompt]
    flat_emitted = [e for per_prompt in emitted for e in per_prompt]
    steps = len(flat)
    hist = [sum(1 for a in flat if a == k) for k in range(block_size)]
    rates = [sum(1 for a in flat if a >= k) / steps if steps else 0.0 for k in range(1, block_size)]
    return {
        "steps": steps,
        "mean_tau": sum(flat_emitted) / steps if steps else float("nan"),  # emitted tokens per verify step
        "mean_accepted_drafts": sum(flat) / steps if steps else float("nan"),  # = Σ per_position_acceptance
        "truncated_steps": sum(1 for a, e in zip(flat, flat_emitted) if e < a + 1),  # last steps cut short
        "per_position_acceptance": rates,  # index 0 = position k=1
        "accepted_drafts_histogram": hist,  # index = accepted drafts
    }


def first_mismatch(target, prompts: list[Prompt], spec: list[list[int]], greedy: list[list[int]]) -> dict | None:
    """The first (prompt, token) where spec != greedy, with the target's logit margin there."""
    for i, (s, g) in enumerate(zip(spec, greedy)):
        if s == g:
            continue
        j = next((k for k in range(min(len(s), len(g))) if s[k] != g[k]), min(len(s), len(g)))
        out = {
            "prompt_index": i,
            "token_index": j,
            "spec_token": s[j] if j < len(s) else None,
            "greedy_token": g[j] if j < len(g) else None,
            "logit_margin": None,
        }
        if out["spec_token"] is not None and out["greedy_token"] is not None:
            ids = torch.tensor([prompts[i].ids + g[:j]], device=target.embed_tokens.weight.device)
            logits = target(ids).logits[0, -1].float()
            out["logit_margin"] = float(logits[g[j]] - logits[s[j]])  # >= 0: greedy's token is the argmax
        return out
    return None


# ------------------------------------------------------------------ main entry
def evaluate_acceptance(
    target,
    drafter,
    prompts,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    max_new_tokens: int = 128,
    check_lossless: bool | None = None,
    output_dir=None,
    seed: int = 0,
    eos_token_id="auto",
    max_context: int | None = None,
    settings: dict | None = None,
    show_progress: bool = True,
    prompt_set: dict | None = None,
) -> dict:
    """Speculative decoding of ``target`` with ``drafter`` on ``prompts``; returns the results dict.

    prompts: list of str (encoded with target.tokenizer), of id lists, or of ``Prompt``.
    check_lossless: None = True at T=0 (greedy comparison is meaningless at T>0).
    eos_token_id: "auto" = the tokenizer's (else the config's) EOS; None = never stop early.
    max_context: positions available (default: min of target/drafter max_position_embeddings);
    a prompt with len + max_new_tokens + B - 1 > max_context is skipped with a warning and counted.
    settings: extra entries recorded under results["settings"] (e.g. paths from the CLI).
    prompt_set: what the prompts are (PromptSet.info: set, seed, data split, keys + offsets, counts),
    recorded as results["prompt_set"]; results["prompt_counts"] says how many prompts were asked,
    given and evaluated, and why any went missing (also logged).
    Writes the files of ``FILES`` into output_dir when given.
    """
    DFlashProposer(drafter, target)  # raises DFlash2Error for a drafter of another target (vocab/width/taps)
    params = SamplingParams(float(temperature), int(top_k), float(top_p))
    if check_lossless is None:
        check_lossless = params.greedy
    if check_lossless and not params.greedy:
        raise DFlash2Error(
            f"check_lossless=true needs temperature=0 (got {temperature}): sampled outputs cannot "
            "be compared token by token; leave check_lossless=null"
        )
    if max_new_tokens < 1:
        raise DFlash2Error(f"max_new_tokens={max_new_tokens} must be >= 1")
    all_prompts = as_prompts(prompts, target.tokenizer)
    B = drafter.config.block_size
    limit = max_context if max_context is not None else context_limit(target, drafter)
    eos = default_eos(target) if eos_token_id == "auto" else eos_token_id
    device = target.embed_tokens.weight.device

    kept, skipped = [], []
    for i, p in enumerate(all_prompts):
        need = len(p.ids) + max_new_tokens + B - 1  # the last verify block reaches this far
        if not p.ids or (limit is not None and need > limit):
            reason = (
                "empty" if not p.ids else f"{len(p.ids)} prompt tokens + {max_new_tokens} new + {B - 1} draft > {limit}"
            )
            log.warning("skipping prompt %d (%s): %s", i, p.source, reason)
            skipped.append({"index": i, "source": p.source, "prompt_tokens": len(p.ids), "reason": reason})
        else:
            kept.append((i, p))
    counts = prompt_counts(prompt_set, len(all_prompts), skipped, limit)
    if counts_line(counts):
        log.warning("%s", counts_line(counts))
    if not kept:
        raise DFlash2Error(
            f"all {len(all_prompts)} prompts were skipped (longer than the context limit {limit} with "
            f"max_new_tokens={max_new_tokens}); use shorter prompts or fewer new tokens"
        )

    records, spec_time = [], 0.0
    bar = tqdm(kept, desc="speculative decoding", unit="prompt", disable=not show_progress)
    for i, p in bar:
        gen = torch.Generator(device=device).manual_seed(int(seed) + i)  # per prompt: reproducible alone
        t0 = time.perf_counter()
        res = speculative_generate(
            target,
            drafter,
            [p.ids],
            max_new_tokens=max_new_tokens,
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            eos_token_id=eos,
            generator=gen,
        )
        spec_time += time.perf_counter() - t0
        records.append(
            {
                "index": i,
                "prompt": p,
                "ids": res.sequences[0],
                "accepted_drafts": res.accepted_drafts[0],
                "emitted": res.emitted[0],
            }
        )
        bar.set_postfix(tau=f"{res.mean_tau:.2f}")

    stats = acceptance_stats([r["accepted_drafts"] for r in records], [r["emitted"] for r in records], B)
    tokens = sum(len(r["ids"]) for r in records)
    results = {
        "num_prompts": len(records),
        "skipped_prompts": len(skipped),
        "skipped": skipped,
        "prompt_counts": counts,
        **stats,
        "tokens": tokens,  # generated, the prefill's first token of each prompt included
        "wall_time_s": spec_time,
        "tokens_per_s": tokens / spec_time if spec_time > 0 else float("nan"),
        "lossless": None,
        "first_mismatch": None,
    }
    if check_lossless:
        t0 = time.perf_counter()
        greedy = [greedy_generate(target, [r["prompt"].ids], max_new_tokens, eos)[0] for r in records]
        results["greedy_wall_time_s"] = time.perf_counter() - t0
        for r, g in zip(records, greedy):
            r["lossless"] = r["ids"] == g
        results["lossless"] = all(r["lossless"] for r in records)
        mismatch = first_mismatch(target, [r["prompt"] for r in records], [r["ids"] for r in records], greedy)
        if mismatch is not None:
            mismatch["prompt_index"] = records[mismatch["prompt_index"]]["index"]  # index in the given set
            log.warning("speculative output differs from greedy: %s", mismatch)
        results["first_mismatch"] = mismatch
    results["settings"] = {
        "target": str(getattr(target, "name_or_path", "")),
        "drafter_version": "dflash2" if drafter.config.is_v2 else "dflash",
        "block_size": B,
        "temperature": params.temperature,
        "top_k": params.top_k,
        "top_p": params.top_p,
        "max_new_tokens": max_new_tokens,
        "check_lossless": bool(check_lossless),
        "seed": int(seed),
        "eos_token_id": eos,
        "max_context": limit,
        "num_prompts_given": len(all_prompts),
        "num_prompts_asked": counts["asked"],
        "device": str(device),
        "dtype": str(target.embed_tokens.weight.dtype).removeprefix("torch."),
        **(settings or {}),
    }
    if prompt_set is not None:
        results["prompt_set"] = prompt_set
    if output_dir is not None:
        write_outputs(Path(output_dir), results, records, target.tokenizer)
    return results


# ------------------------------------------------------------------ writers
def write_outputs(out: Path, results: dict, records: list[dict], tokenizer) -> None:
    """results.json, outputs.jsonl, results.md and the two PNG plots."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(_jsonable(results), indent=2) + "\n")
    with open(out / "outputs.jsonl", "w") as f:
        for r in records:
            row = {
                "index": r["index"],
                "source": r["prompt"].source,
                "offset": r["prompt"].offset,
                "prompt": r["prompt"].text,
                "generated_text": tokenizer.decode(r["ids"]) if tokenizer is not None else None,
                "generated_ids": r["ids"],
                "accepted_drafts": r["accepted_drafts"],
                "emitted": r["emitted"],
                "tau": sum(r["emitted"]) / len(r["emitted"]) if r["emitted"] else None,
            }
            if "lossless" in r:
                row["lossless"] = r["lossless"]
            f.write(json.dumps(row) + "\n")
    (out / "results.md").write_text(markdown_table(results))
    _plot_bars(
        out / "per_position_acceptance.png",
        list(range(1, len(results["per_position_acceptance"]) + 1)),
        results["per_position_acceptance"],
        "drafted position k",
        "acceptance rate",
        f"Per-position acceptance (mean τ {results['mean_tau']:.2f})",
        ylim=(0, 1),
    )
    hist = results["accepted_drafts_histogram"]
    _plot_bars(
        out / "tau_histogram.png",
        list(range(len(hist))),
        hist,
        "accepted drafts (the step emits them + 1)",
        "verify steps",
        f"accepted drafts per step ({results['steps']} steps)",
    )


def markdown_table(results: dict) -> str:
    s = results["settings"]
    lossless = {None: "not checked", True: "yes", False: "**NO**"}[results["lossless"]]
    rows = [
        ("target", f"`{s['target']}`"),
        ("drafter", f"{s['drafter_version']} (block {s['block_size']})"),
        ("temperature / top-k / top-p", f"{s['temperature']} / {s['top_k']} / {s['top_p']}"),
        ("prompts", f"{results['num_prompts']} evaluated, {results['skipped_prompts']} skipped"),
        *[("fewer prompts", note) for note in results.get("prompt_counts", {}).get("notes", [])],
        ("mean τ (tokens emitted per verify step incl. bonus; prefill token excluded)", f"{results['mean_tau']:.3f}"),
        ("mean accepted drafts per step (before EOS / length cuts)", f"{results['mean_accepted_drafts']:.3f}"),
        ("verify steps", f"{results['steps']} ({results['truncated_steps']} last steps cut by EOS / length)"),
        ("generated tokens", str(results["tokens"])),
        ("wall time (reference decoder)", f"{results['wall_time_s']:.2f} s ({results['tokens_per_s']:.1f} tok/s)"),
        ("lossless vs greedy", lossless),
    ]
    if results["first_mismatch"]:
        rows.append(("first mismatch", f"`{json.dumps(results['first_mismatch'])}`"))
    lines = ["# Acceptance evaluation", "", "| metric | value |", "|---|---|", *[f"| {k} | {v} |" for k, v in rows], ""]
    rates = results["per_position_acceptance"]
    lines += [
        "## Per-position acceptance",
        "",
        "| position k | " + " | ".join(str(k) for k in range(1, len(rates) + 1)) + " |",
        "|---|" + "---|" * len(rates),
        "| rate | " + " | ".join(f"{r:.3f}" for r in rates) + " |",
        "",
    ]
    hist = results["accepted_drafts_histogram"]
    lines += [
        "## Accepted drafts per step",
        "",
        "| accepted | " + " | ".join(str(k) for k in range(len(hist))) + " |",
        "|---|" + "---|" * len(hist),
        "| steps | " + " | ".join(str(c) for c in hist) + " |",
        "",
    ]
    return "\n".join(lines)


def _plot_bars(path: Path, x, y, xlabel: str, ylabel: str, title: str, ylim=None) -> None:
    """One bar chart as PNG through the Agg canvas (no pyplot: no global backend switch)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 3.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.bar(x, y, color="tab:blue")
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title, xticks=x)
    if ylim is not None:
        ax.set_ylim(*ylim)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _jsonable(x):
    """NaN/inf -> None so results.json is strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x
