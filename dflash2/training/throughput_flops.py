"""Model FLOPs of one drafter training step: the numerator of the MFU that ``bench_throughput`` reports.

What is counted (2 FLOPs per multiply-add; matmuls only): the work the step *needs* to get the
gradient of every trainable drafter parameter, the same number for every attention / loss / feature
variant of one shape, so that the variants' MFUs compare their speed on the same work.

With N rows, L context positions, A anchor slots per row, B the block size, S = A·B block queries
per row, P = B − 1 drafted positions per block, M = N·A·P, d the hidden size, H / H_kv / h the
drafter's query heads, K/V heads and head dim, I its MLP width, K·d_t the width of the taps, r the
selector rank, V the vocabulary, ℓ the drafter's layers:

* drafter linear layers, 6 × weights × rows they multiply (forward 2, gradient of the input 2,
  gradient of the weight 2), each layer with its own token count:
  q_proj, o_proj (d·H·h each), gate/up/down (3·d·I) and the two block-local conv projections
  (2 × d·2·k·G, DFlash2) over the N·S block tokens; k_proj, v_proj (d·H_kv·h each) over the N·L
  context tokens *and* the N·S block tokens (KV injection, ARCHITECTURE.md §2.4). Two exceptions
  at 4 × weights × rows, because their input needs no gradient: ``fc`` (K·d_t·d over the N·L
  context tokens: the taps are constants) and the selector's ``hidden_projection`` (d·r over the
  M drafted positions: the selector reads the hidden states detached, §3.2).
* drafter attention, 12 · H·h · (attended pairs) per layer: forward QKᵀ and PV are 2·h FLOPs per
  (query, key) pair and head each, backward twice the forward. Only the pairs the training mask
  allows are counted (``attended_pairs``: block j's B queries see anchor_j context keys and their
  B own-block keys), for flex and dense alike: dense SDPA computes all S·(L+S) pairs and flex every
  pair of the 128 × 128 tiles it visits; that extra work is the variant's cost, not model FLOPs.
* the frozen LM head, 4 · d·V · M: forward and the gradient to the hidden states; no weight
  gradient (frozen). The chunked CE's recompute of the logits in backward is not counted.
* (online features only) the frozen target's forward, 2 × its decoder's linear weights × N·L plus
  4 · H_t·h_t · N·L(L+1)/2 per layer for causal attention. ``tap_features`` runs the decoder without
  the LM head, so neither the head nor the embedding (a gather) is counted.

Not counted: norms, RoPE, softmax, the conv's elementwise taps, embedding and codebook gathers, the
selector's k-candidate pair scores (≈ 6·r·(k+1) per position), the chunked head's recompute, the
greedy selector path and top-k of the metrics, the optimizer.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from dflash2.drafter.config import DrafterConfig
from dflash2.errors import DFlash2Error


@dataclass(frozen=True)
class StepFlops:
    """Model FLOPs of one step by part; ``target_forward`` is 0 for offline features."""

    drafter_linear: int
    drafter_attention: int
    lm_head: int
    target_forward: int

    @property
    def excluding_target(self) -> int:
        """The drafter's own training work: linear layers, attention and the LM head."""
        return self.drafter_linear + self.drafter_attention + self.lm_head

    @property
    def total(self) -> int:
        return self.excluding_target + self.target_forward

    def as_dict(self) -> dict:
        return {**asdict(self), "excluding_target": self.excluding_target, "total": self.total}


def attended_pairs(anchors: torch.Tensor, anchor_valid: torch.Tensor, block_size: int) -> int:
    """(query, key) pairs the training mask allows, over all rows: Σ_j B·(B + anchor_j·valid_j).

    anchors, anchor_valid: (N, A) as ``sample_anchors`` returns them. Block j's B queries see the
    anchor_j context positions before its anchor (none for a padding anchor) and the B keys of their
    own block. Equals ``dense_block_mask(anchors, anchor_valid, L, B).sum()`` for any L > max anchor.
    """
    context = torch.where(anchor_valid, anchors, torch.zeros_like(anchors)).long()
    return int(block_size * (block_size * anchors.numel() + int(context.sum())))


def drafter_linear_flops(config: DrafterConfig, rows: int, context_len: int, anchor_slots: int) -> int:
    """Training FLOPs of the drafter's linear layers for ``rows`` rows of ``context_len`` tokens and
    ``anchor_slots`` blocks each (padding anchors are computed as well: they count)."""
    c = config
    d, h = c.hidden_size, c.head_dim
    context = rows * context_len  # rows the context path multiplies
    block = rows * anchor_slots * c.block_size  # N·S block tokens
    drafted = rows * anchor_slots * (c.block_size - 1)  # M
    per_layer = 6 * (2 * d * c.num_key_value_heads * h) * (context + block)  # k_proj, v_proj
    per_layer += 6 * (2 * d * c.num_attention_heads * h + 3 * d * c.intermediate_size) * block  # q, o, MLP
    if c.use_local_conv:  # attention_conv and mlp_conv: kernel_projection d -> 2·k·G each
        groups = d // c.conv_group_size
        per_layer += 6 * 2 * (d * 2 * c.conv_kernel_size * groups) * block
    flops = c.num_hidden_layers * per_layer
    flops += 4 * (c.num_taps * c.target_hidden_size * d) * context  # fc: the taps need no gradient
    if c.use_selector:
        flops += 4 * (d * c.selector_rank) * drafted  # hidden_projection of the detached hidden states
    return flops


def drafter_attention_flops(config: DrafterConfig, pairs: int) -> int:
    """12 · H·h per attended (query, key) pair and layer (forward 4, backward 8)."""
    if config.layer_types and any(kind != "full_attention" for kind in config.layer_types):
        raise DFlash2Error("the FLOP count knows full-attention drafter layers only (no sliding_attention)")
    return 12 * config.num_attention_heads * config.head_dim * pairs * config.num_hidden_layers


def lm_head_flops(hidden: int, vocab: int, drafted: int) -> int:
    """The frozen head on M drafted positions: forward 2·d·V·M and the gradient to the hidden states
    2·d·V·M; no weight gradient."""
    return 4 * hidden * vocab * drafted


def target_forward_flops(text_config, rows: int, seq: int) -> int:
    """One forward of a dense softmax-attention decoder (Qwen3 / Llama) over ``rows`` × ``seq`` tokens,
    without the LM head: 2 × linear weights × tokens + causal attention 4·H·h·seq(seq+1)/2 per row
    and layer. Hybrid (Gated DeltaNet) and mixture-of-experts targets are refused."""
    t = text_config
    kinds = set(getattr(t, "layer_types", None) or ["full_attention"])
    if kinds - {"full_attention"} or getattr(t, "num_experts", None):
        raise DFlash2Error("the FLOP count knows dense full-attention targets only (Qwen3 / Llama shapes)")
    d, heads, kv = int(t.hidden_size), int(t.num_attention_heads), int(t.num_key_value_heads)
    h = int(getattr(t, "head_dim", None) or d // heads)
    weights = 2 * d * heads * h + 2 * d * kv * h + 3 * d * int(t.intermediate_size)  # q, o; k, v; MLP
    causal_pairs = rows * seq * (seq + 1) // 2
    return int(t.num_hidden_layers) * (2 * weights * rows * seq + 4 * heads * h * causal_pairs)


def step_flops(
    config: DrafterConfig,
    *,
    rows: int,
    context_len: int,
    anchors: torch.Tensor,
    anchor_valid: torch.Tensor,
    target_text_config=None,
) -> StepFlops:
    """Model FLOPs of one step on the anchors it drew ((N, A) each); ``target_text_config``: the
    target's text config when the step runs the target (online features), else None."""
    slots = anchors.shape[1]
    drafted = rows * slots * (config.block_size - 1)
    return StepFlops(
        drafter_linear=drafter_linear_flops(config, rows, context_len, slots),
        drafter_attention=drafter_attention_flops(config, attended_pairs(anchors, anchor_valid, config.block_size)),
        lm_head=lm_head_flops(config.hidden_size, config.vocab_size, drafted),
        target_forward=0 if target_text_config is None else target_forward_flops(target_text_config, rows, context_len),
    )
