"""The drafter's element-wise arithmetic in fewer ops: RMSNorm, RoPE and the DFlash2 local conv of one block.

Why: at batch 1 a draft step is a string of small kernels, each costing a few µs on a GPU however
little it computes (``python -m dflash2.runtime.phase_ops`` counts them), and the drafter modules
(dflash2/drafter/) are written for training: every RMSNorm casts its weight to fp32, RoPE builds
rotate_half with a negation and a concatenation per tensor, the local conv repeats its per-group
kernel over channels, rebuilds its in-block position mask and shifts its input once per tap and
side. These functions compute the same values with the same roundings (every element goes
through the same float operations, in the same order, on the same operands; bit for bit on the
CPU, tests/test_runtime_draft_math.py; the one reduction, a norm's mean over a row, sums in the
order of the library's kernel, which on a GPU may depend on how many rows a call has), with the
constant parts prepared once (:mod:`dflash2.runtime.draft_weights`) and the rest batched:

* :func:`rms_norm`: ``RMSNorm.forward`` with the fp32 weight made once (one cast fewer per call);
  rows of several heads or layers normalised in one call with a weight per row (stacked weights);
* :func:`rope_tables` / :func:`rotate`: RoPE as ``x·cos + roll(x)·sin±``, with the sign of
  rotate_half folded into the sin table (negation is exact, and (−a)·b = a·(−b)), so q and k of
  a layer (or K of every layer) rotate in four ops; :func:`rope_rows` makes the tables of every
  position once, which a step indexes;
* :func:`conv_kernels` / :func:`conv_side`: the per-position kernels of both sides and all taps in
  one add (the group delta broadcast instead of repeated), and each side as one product over a
  strided window of the zero-padded input plus the sum of its taps (taps stored reversed, so
  that the window's order is the kernel's); :func:`conv_kernels_of` / :func:`conv_apply` are the
  same from the projection's output and for one side, the twin of the fused Triton kernel
  (:func:`~dflash2.runtime.kernels.local_conv.local_conv`: kernel add, pad, products and sum of a
  side in one launch).

Shapes: N rows, T block tokens (T ≤ B, one block from its first position), d hidden, hd head_dim,
h heads (any stack of heads: q and k, or K of several layers), K conv taps, G conv groups.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dflash2.drafter.rounded_ops import product_as


def rms_norm(x: torch.Tensor, weight32: torch.Tensor, eps: float) -> torch.Tensor:
    """``dflash2.drafter.model.RMSNorm`` (rms_norm's forward) with its weight already in fp32.

    x (..., D) any float dtype (a strided view is fine), weight32 fp32 broadcastable to x: (D,), or
    one row per head / layer, e.g. (h, D) for x (N, T, h, D). Returns (..., D) in x's dtype."""
    x32 = x.float()  # x itself when x is fp32: then never written into
    r = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    y = x32.mul_(r) if x32 is not x else x32 * r
    return product_as(y, weight32, x.dtype, in_place=True)


def rope_tables(positions: torch.Tensor, freqs: torch.Tensor, sign: torch.Tensor, dtype: torch.dtype):
    """``rope_cos_sin`` laid out for (N, T, h, hd) tensors, the rotate_half sign folded into sin.

    positions (N, T) long; freqs (hd,) fp32: rope_cos_sin's inverse frequencies twice ([f, f], made
    once), so the angles come out in rotate-half layout without a concatenation, each the same fp32
    product position · f; sign (hd,) fp32: −1 on the first half, +1 on the second. Returns cos,
    sin± (N, T, 1, hd) in ``dtype``: cos and sin rounded as ``.to(dtype)`` rounds them, sin± the
    rounded sin times the sign (rounding is symmetric: round(−s) = −round(s))."""
    angles = positions.float()[..., None] * freqs  # (N, T, hd)
    cos = angles.cos().to(dtype)
    signed_sin = product_as(angles.sin(), sign, dtype, in_place=True)
    return cos[:, :, None], signed_sin[:, :, None]


def rope_rows(max_len: int, freqs: torch.Tensor, sign: torch.Tensor, dtype: torch.dtype):
    """:func:`rope_tables` of positions 0..max_len-1, made once per drafter context: cos, sin± (max_len, 1, hd).
    ``table[positions]`` is then :func:`rope_tables` (positions) bit for bit, in one gather per table
    instead of about five element-wise launches (each row: the same ops on the same operands)."""
    cos, sin = rope_tables(torch.arange(max_len, device=freqs.device)[None], freqs, sign, dtype)
    return cos[0], sin[0]


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """``apply_rope`` on x (N, T, h, hd) with :func:`rope_tables`: x·cos + [x2, x1]·[−sin1, sin2].

    apply_rope computes x·cos + [−x2, x1]·sin; (−x2)·sin1 = x2·(−sin1) exactly, so every product and
    the sum round as there. Returns (N, T, h, hd) in x's dtype."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def conv_kernels(x: torch.Tensor, projection: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """Per-position kernels of both sides of a ``BlockLocalConv`` from its normed input x (N, T, d).

    projection (2·K·G, d) and base (2, K, G, gs) are the conv's kernel_projection weight and base
    kernel with the taps reversed (:class:`~dflash2.runtime.draft_weights.ConvWeights`). Returns
    W (N, T, 2, K, d) in x's dtype: W[n, i, s, K-1-t, c] = base[s, t, c] + δ[n, i, s, t, c // gs], the
    module's ``base_kernel[s, t] + δ.repeat_interleave(gs)``, one add for every side and tap."""
    return conv_kernels_of(F.linear(x, projection), base)  # the module's deltas(x), taps reversed


def conv_kernels_of(delta: torch.Tensor, base: torch.Tensor, side: int | None = None) -> torch.Tensor:
    """:func:`conv_kernels` from the projection's output delta (N, T, 2·K·G) (taps reversed, as ``ConvWeights``).

    Returns W (N, T, 2, K, d) in delta's dtype (x's), or with ``side`` only that side's (N, T, K, d): the
    same add on half of the operands, so every element is the same value."""
    N, T, _ = delta.shape
    K, G = base.shape[1:3]
    delta = delta.view(N, T, 2, K, G, 1)
    if side is None:
        return (base.to(delta.dtype) + delta).view(N, T, 2, K, -1)
    return (base[side].to(delta.dtype) + delta[:, :, side]).view(N, T, K, -1)


def conv_side(x: torch.Tensor, kernels: torch.Tensor, side: int) -> torch.Tensor:
    """One side of the block-local conv on x (N, T, d), one block (T ≤ B, starting at its first position).

    kernels: :func:`conv_kernels` (N, T, 2, K, d). out[i] = Σ_t W_t[i]·x[i−t], x[j < 0] = 0, summed as
    ``BlockLocalConv.forward`` sums (term 0, then + term 1, ...). Its in-block mask multiplies by 1
    inside one block (the zero padding already stands for i − t < 0), so it is left out."""
    return conv_apply(x, kernels[:, :, side])


def conv_apply(x: torch.Tensor, kernels: torch.Tensor) -> torch.Tensor:
    """:func:`conv_side` with one side's kernels (N, T, K, d) (taps reversed). Returns (N, T, d) in x's dtype."""
    N, T, d = x.shape
    K = kernels.shape[2]
    padded = F.pad(x, (0, 0, K - 1, 0))  # (N, K-1+T, d)
    s = padded.stride()
    window = padded.as_strided((N, T, K, d), (s[0], s[1], s[1], s[2]))  # window[n, i, j] = x[i + j - (K-1)]
    terms = window * kernels  # (N, T, K, d): term t at j = K-1-t
    out = terms[:, :, K - 1]
    for j in range(K - 2, -1, -1):
        out = out + terms[:, :, j]
    return out
