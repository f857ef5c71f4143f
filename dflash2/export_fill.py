"""Exact fillers for a DFlash2 export of a drafter with one addition off (ARCHITECTURE.md §7.3; issue 12).

vLLM's ``qwen3_dflash2`` and z-lab's ``DFlash2DraftModel`` always build *both* additions,
so a drafter trained with only the local conv or only the selector, written as
``DFlash2DraftModel`` without the other's tensors, would be served with uninitialised
weights, silently. The export writes the missing one with weights that compute exactly
what the checkpoint computes:

* **local conv off**: ``base_kernel`` tap 0 = 1, other taps 0, ``kernel_projection`` = 0.
  Each side then multiplies by exactly 1 and adds exact zeros: the identity in any float
  format, so drafts are those of the checkpoint at every temperature.
* **selector off**: ``successor_codebook`` = 0, so every pair term Σ_r P·Hh·S is exactly 0
  and the edge scores are the (scaled) top-k logits. The T=0 walk then picks candidate 0 at
  every position, the drafter's argmax. At T > 0 a served DFlash2 drafter always samples
  from its k candidates (softmax of their scores / T), so the proposal is the checkpoint's
  softmax renormalised over its top k: a different q, still lossless. The predecessor
  codebook and hidden projection get small random values from a fixed seed (not zeros):
  with all three zero every selector gradient is zero, and a fine-tune from the export
  (``drafter.init_from``) could never train it.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from dflash2.drafter.config import DrafterConfig

FILL_SEED = 0  # fixed: the same checkpoint always exports to the same bytes
FILL_STD = 0.02  # the selector's own init scale (selector.py)


def fill_missing_addition(config: DrafterConfig, tensors: dict) -> tuple[DrafterConfig, dict, list[str]]:
    """(config with both additions on, tensors with the filler added, one note per filler) for a
    DFlash2 drafter with exactly one addition off; anything else is returned unchanged."""
    if config.use_local_conv == config.use_selector:
        return config, tensors, []
    out, notes = dict(tensors), []
    d = config.hidden_size
    if not config.use_local_conv:
        # any group size dividing the width serves an all-zero projection; keep the configured one when it does
        config = dataclasses.replace(
            config, use_local_conv=True, conv_group_size=math.gcd(d, config.conv_group_size)
        ).validate()
        taps, groups = config.conv_kernel_size, config.conv_groups
        base = torch.zeros(2, taps, d)
        base[:, 0] = 1.0
        for n in range(config.num_hidden_layers):
            for conv in ("attention_conv", "mlp_conv"):
                out[f"layers.{n}.{conv}.base_kernel"] = base.clone()
                out[f"layers.{n}.{conv}.kernel_projection.weight"] = torch.zeros(2 * taps * groups, d)
        notes.append(
            "local conv: identity filler (base_kernel tap 0 = 1, other taps 0, kernel_projection 0); "
            "drafts are the checkpoint's at every temperature"
        )
    else:
        config = dataclasses.replace(config, use_selector=True).validate()
        V, r = config.vocab_size, config.selector_rank
        g = torch.Generator().manual_seed(FILL_SEED)
        out["candidate_selector.predecessor_codebook"] = torch.randn(V, r, generator=g) * FILL_STD
        out["candidate_selector.successor_codebook"] = torch.zeros(V, r)
        out["candidate_selector.hidden_projection.weight"] = torch.randn(r, d, generator=g) * FILL_STD
        notes.append(
            "candidate selector: zero successor codebook (pair term exactly 0); T=0 drafts are the "
            f"checkpoint's argmax, at T > 0 they are sampled from its top-{config.selector_top_k} candidates"
        )
    return config, out, notes
