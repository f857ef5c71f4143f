"""What a GDN verify keeps for the commit (docs/ARCHITECTURE.md §5.3, §5.5).

One :class:`GDNLog` per GDN layer and verify, consumed by the commit of the same step — or,
with ReplaySSM's deferred commit, by the next verify of the layer (:class:`PendingFold`).
ReplaySSM logs (k, u, g): u_t = β_t (v_t − h_{t−1}ᵀ k_t) already holds the delta-rule
correction, so folding n tokens needs no hᵀk and no v. The native-rollback ablation
instead keeps the full state after every position. Both keep the T pre-conv inputs x,
from which the commit builds the new conv window.

Shapes: N rows, T block tokens, C conv channels, Hk key heads, H value heads, P programs of
the verify's recurrence per row (H · d_v / block_v).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class GDNLog:
    """x: (N, T, C) pre-conv inputs (model dtype), always kept.

    ReplaySSM (``states is None``): k (N, T, Hk, d_k) fp32 L2-normed keys, one per *key* head
    (value head h reads key head h // (H / Hk)); u (N, T, H, d_v) fp32; g (N, T, H) fp32 log decays.
    Native rollback: states (N, T, H, d_k, d_v) fp32, the recurrent state after each position;
    k / u / g are None.
    """

    x: torch.Tensor
    k: torch.Tensor | None = None
    u: torch.Tensor | None = None
    g: torch.Tensor | None = None
    states: torch.Tensor | None = None

    @property
    def native(self) -> bool:
        return self.states is not None

    def nbytes(self) -> int:
        """Speculative-state bytes this log holds (what a step keeps per layer until the commit)."""
        return sum(t.numel() * t.element_size() for t in (self.x, self.k, self.u, self.g, self.states) if t is not None)


def new_log(
    x: torch.Tensor,
    *,
    num_k_heads: int,
    num_v_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    native: bool,
    alloc=torch.empty,
) -> GDNLog:
    """A log around x (N, T, C) with fresh fp32 tensors in the layout of the mode (native: the states).

    alloc: torch.empty for a verify's outputs, torch.zeros for reserved (CUDA-graph) logs.
    """
    N, T = x.shape[:2]
    f32 = dict(dtype=torch.float32, device=x.device)
    H = num_v_heads
    if native:
        return GDNLog(x=x, states=alloc(N, T, H, head_k_dim, head_v_dim, **f32))
    k = alloc(N, T, num_k_heads, head_k_dim, **f32)
    return GDNLog(x=x, k=k, u=alloc(N, T, H, head_v_dim, **f32), g=alloc(N, T, H, **f32))


@dataclass
class PendingFold:
    """A commit that has not been folded yet (ReplaySSM's deferred commit): what the next verify needs.

    n: (N, P) int32, the tokens to fold per row, once per program of the verify's recurrence kernel
    (all P equal within a row; each program zeroes its own after folding, so the counts say what is
    still pending). k: (N, T, Hk, d_k) and g: (N, T, H) fp32, the layer's stash of the pending tokens'
    logged k and g, copied there by the deferred commit kernel (gdn_replay/defer_kernel.py), which
    also rolled the conv window: the verify folds only the recurrent state, reading these and the
    log's u. The log itself is the verify's ``out``.
    """

    n: torch.Tensor
    k: torch.Tensor
    g: torch.Tensor

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.n, self.k, self.g))


@dataclass
class NextLayerFold:
    """Another GDN layer's pending fold, done ahead by this layer's verify (gdn_verify_triton's ``fold_next``).

    rec: (N, H, d_k, d_v) fp32, that layer's recurrent state, folded in place; u: (N, T, H, d_v) fp32, its
    log's u (the pending tokens' u, which its own next verify would overwrite); fold: its PendingFold (counts,
    stash of k / g). All of one block length T and the shapes of this layer's.
    """

    rec: torch.Tensor
    u: torch.Tensor
    fold: PendingFold


def default_block_v(head_v_dim: int) -> int:
    """The verify / commit kernels' default value-slice width: d_v rounded up to a power of two, at most
    16 (the H200 sweep's best at batch 64; docs/BENCHMARKS.md). Plain Python: no Triton import."""
    return min(1 << max(head_v_dim - 1, 0).bit_length(), 16)


def default_fma(fma: bool | None) -> bool:
    """The recurrence's ``fma`` setting (gdn_verify_triton's docstring) when the caller left it out (None): on,
    except under Triton's interpreter. There the sums' reduction with a user combine runs element by element
    (slice by slice with interpreter_reduce.py), which made the CPU suites' GDN tests about 1.6–3× slower; the
    interpreter's fma path has its own tests (tests/test_runtime_gdn_fma.py), and on a GPU every GDN test runs
    it. The verify and the commit resolve it alike, so a log is always committed with its verify's setting."""
    if fma is not None:
        return bool(fma)
    from dflash2.runtime.kernels.triton_util import interpreting

    return not interpreting()


def occupancy_block_v(batch: int, num_v_heads: int, head_v_dim: int, programs_wanted: int) -> int:
    """:func:`default_block_v`, halved (down to 4) while the recurrence would run fewer than ``programs_wanted``
    programs (batch · H · ceil(d_v / block_v); GDNState passes the GPU's SM count). Why: at a small batch the
    recurrence is a latency chain per program, and a narrower value slice shortens each program's per-token
    work while more SMs share the layer. H200, block 8, the embedded small target's GDN shape (8 value heads,
    d_v 96) at batch 1, verify + commit: 48 programs at block_v 16, 13.2 µs per layer; 192 at block_v 4,
    11.2 µs. The 9B shape already has 256 programs at batch 1 and keeps 16 (docs/BENCHMARKS.md, stop 17)."""
    bv = default_block_v(head_v_dim)
    while bv > 4 and batch * num_v_heads * -(-head_v_dim // bv) < programs_wanted:
        bv //= 2
    return bv


def recur_programs(num_v_heads: int, head_v_dim: int, block_v: int | None = None) -> int:
    """P, the verify recurrence kernel's programs per row: H · ceil(d_v / block_v) (PendingFold.n's width)."""
    bv = block_v or default_block_v(head_v_dim)
    return num_v_heads * -(-head_v_dim // bv)
