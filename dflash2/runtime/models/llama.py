"""Llama (and Llama-3 RoPE scaling) in the runtime: the Qwen3 decoder without q/k norms.

Same pre-norm block and forward as qwen3.py (``DenseBlock``); what differs is only
what the HF config switches: no per-head q/k RMSNorm, optional attention / MLP
biases (``attention_bias``, ``mlp_bias``), and RoPE variants such as ``llama3``
(handled by ``rope_inv_freq``). The checkpoint layout is the same as Qwen3's.
"""

from __future__ import annotations

from dflash2.runtime.models.qwen3 import QWEN3_KEYS, Qwen3

LLAMA_KEYS = QWEN3_KEYS  # model.layers.{i}.self_attn.* / mlp.* / *_layernorm.weight: identical names


class Llama(Qwen3):
    """Llama target: ``forward(tokens (N, T), state)`` -> logits (N, T, V) and taps (N, T, K·d)."""

    KEY_MAP = LLAMA_KEYS
    QK_NORM = False
