"""Gated DeltaNet states with verify / commit (ReplaySSM, docs/ARCHITECTURE.md §5).

A GDN layer carries two states per row: the short causal conv's window
(the last K-1 pre-conv inputs) and the recurrent state h (H, d_k, d_v) in fp32.
Per token, after the conv + SiLU and the q/k L2 norms (HF / fla semantics):

    h ← exp(g_t) · h                 g_t = -exp(A_log) · softplus(a_t + dt_bias)  (log decay, fp32)
    u_t = β_t · (v_t − hᵀ k_t)       β_t = sigmoid(b_t)
    h ← h + k_t u_tᵀ
    o_t = hᵀ q_t / sqrt(d_k)

Speculative decoding verifies T tokens per row and keeps only n[r] of them, so the
state must end up as if exactly n[r] tokens had been fed. Instead of writing T
states and picking one, :meth:`GDNState.verify` computes the T outputs from the
*untouched* state and logs (k_t, u_t, g_t) and the T pre-conv inputs;
:meth:`GDNState.commit` folds the first n[r] logged tokens into the state with the
same two updates in the same order (the "exact fold": u_t already holds the
correction term, so replay needs no hᵀk and is not sequential in anything but h),
and the new conv window is the last K-1 columns of ``[old window | x_1 .. x_n]``.

This module is the plain-PyTorch implementation (a loop over T); Triton verify /
replay kernels will implement the same two functions, :func:`gdn_verify` and
:func:`gdn_replay`, and be tested against them.

Shapes: N rows, T block tokens, C conv channels (2·Hk·d_k + H·d_v), K conv kernel,
Hk key heads, H value heads (Hk divides H), L_g GDN layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class GDNLog:
    """What :func:`gdn_verify` logs for one layer so that :func:`gdn_replay` can commit n tokens.

    x: (N, T, C) pre-conv inputs (model dtype); k: (N, T, H, d_k) fp32, L2-normed keys (per value
    head); u: (N, T, H, d_v) fp32, β·(v − hᵀk); g: (N, T, H) fp32 log decays.
    """

    x: torch.Tensor
    k: torch.Tensor
    u: torch.Tensor
    g: torch.Tensor


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gdn_verify(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    conv_weight: torch.Tensor,
    rec_state: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    num_k_heads: int,
    head_k_dim: int,
) -> tuple[torch.Tensor, GDNLog]:
    """Outputs of T tokens per row from the untouched states, plus the commit log.

    x (N, T, C) pre-conv q|k|v projections; conv_state (N, C, K-1); conv_weight (C, 1, K);
    rec_state (N, H, d_k, d_v) fp32 (read only); g (N, T, H) fp32; beta (N, T, H).
    Returns o (N, T, H, d_v) in x's dtype and the :class:`GDNLog`.
    """
    N, T, C = x.shape
    H, dk, dv = rec_state.shape[1:]
    # causal depthwise conv over [window | block]: output t sees inputs t-K+1 .. t
    window = torch.cat([conv_state, x.transpose(1, 2).to(conv_state.dtype)], dim=-1)  # (N, C, K-1+T)
    y = F.silu(F.conv1d(window.to(conv_weight.dtype), conv_weight, groups=C)).to(x.dtype)  # (N, C, T)
    y = y.transpose(1, 2)  # (N, T, C)
    key_dim = num_k_heads * head_k_dim
    q, k, v = y.split([key_dim, key_dim, C - 2 * key_dim], dim=-1)
    r = H // num_k_heads  # value heads per key head: head h reads q/k head h // r
    q = _l2norm(q.reshape(N, T, num_k_heads, dk).float()).repeat_interleave(r, dim=2) / dk**0.5  # (N, T, H, dk)
    k = _l2norm(k.reshape(N, T, num_k_heads, dk).float()).repeat_interleave(r, dim=2)
    v = v.reshape(N, T, H, dv).float()
    beta = beta.float()
    h = rec_state.clone()  # working copy; the real state is only changed by commit
    u = torch.empty(N, T, H, dv, dtype=torch.float32, device=x.device)
    o = torch.empty(N, T, H, dv, dtype=torch.float32, device=x.device)
    for t in range(T):
        h = h * g[:, t].exp()[..., None, None]
        u[:, t] = (v[:, t] - (h * k[:, t, :, :, None]).sum(-2)) * beta[:, t, :, None]  # (N, H, dv)
        h = h + k[:, t, :, :, None] * u[:, t, :, None, :]
        o[:, t] = (h * q[:, t, :, :, None]).sum(-2)
    return o.to(x.dtype), GDNLog(x=x, k=k, u=u, g=g.float())


def gdn_replay(
    conv_state: torch.Tensor, rec_state: torch.Tensor, log: GDNLog, n: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold the first n[r] logged tokens of row r into the states; n (N,) long in [0, T].

    Returns the new (conv_state (N, C, K-1), rec_state (N, H, d_k, d_v) fp32). Same updates in
    the same order as :func:`gdn_verify`, so the result equals feeding the n tokens one by one.
    """
    T = log.x.shape[1]
    h = rec_state
    for t in range(T):
        folded = h * log.g[:, t].exp()[..., None, None]  # decay first, then the rank-1 update,
        folded = folded + log.k[:, t, :, :, None] * log.u[:, t, :, None, :]  # exactly as verify rounds
        h = torch.where((t < n)[:, None, None, None], folded, h)
    km1 = conv_state.shape[-1]
    window = torch.cat([conv_state, log.x.transpose(1, 2).to(conv_state.dtype)], dim=-1)  # (N, C, K-1+T)
    idx = (n[:, None] + torch.arange(km1, device=n.device))[:, None, :].expand(-1, window.shape[1], -1)
    return window.gather(-1, idx), h  # window columns n .. n+K-2 = the last K-1 inputs after n tokens


class GDNState:
    """Conv + recurrent states of all GDN layers of a target, with verify / commit.

    conv: (L_g, N, C, K-1) model dtype; rec: (L_g, N, H, d_k, d_v) fp32. Both are
    preallocated and updated in place (static addresses, CUDA-graph friendly); zeros
    = the empty prefix, as HF starts. ``verify(slot, ...)`` is called once per layer
    per forward and keeps that layer's log until ``commit(n)`` consumes all of them.
    """

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        *,
        conv_dim: int,
        conv_kernel: int,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        self.conv = torch.zeros(num_layers, batch_size, conv_dim, conv_kernel - 1, dtype=dtype, device=device)
        self.rec = torch.zeros(
            num_layers, batch_size, num_v_heads, head_k_dim, head_v_dim, dtype=torch.float32, device=device
        )
        self.num_k_heads, self.head_k_dim = num_k_heads, head_k_dim
        self.logs: list[GDNLog | None] = [None] * num_layers
        self._static: dict[int, list[GDNLog]] = {}  # T -> per-layer logs at fixed addresses (reserve)

    def reserve(self, T: int) -> None:
        """Preallocate the logs of T-token verifies: later verifies of T tokens write into them.

        Why: a captured verify graph and a captured commit graph must meet at the same addresses,
        whichever verify graph (one per attended-length bucket) ran last.
        """
        if T in self._static:
            return
        L, N, C = self.conv.shape[:3]
        H, dk, dv = self.rec.shape[2:]
        f32 = dict(dtype=torch.float32, device=self.rec.device)
        self._static[T] = [
            GDNLog(
                x=torch.zeros(N, T, C, dtype=self.conv.dtype, device=self.conv.device),
                k=torch.zeros(N, T, H, dk, **f32),
                u=torch.zeros(N, T, H, dv, **f32),
                g=torch.zeros(N, T, H, **f32),
            )
            for _ in range(L)
        ]

    def use_static(self, T: int) -> None:
        """Point the logs a commit folds at the reserved T-token logs (what the last T-token verify wrote)."""
        self.logs = list(self._static[T])

    def reset(self) -> None:
        """Empty prefix for every row (zero states), as a new generation starts."""
        self.conv.zero_()
        self.rec.zero_()
        self.logs = [None] * len(self.logs)

    def verify(
        self, slot: int, x: torch.Tensor, conv_weight: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
    ) -> torch.Tensor:
        """Layer ``slot``: x (N, T, C) pre-conv, conv_weight (C, 1, K), g / beta (N, T, H) -> o (N, T, H, d_v)."""
        o, log = gdn_verify(x, self.conv[slot], conv_weight, self.rec[slot], g, beta, self.num_k_heads, self.head_k_dim)
        static = self._static.get(x.shape[1])
        if static is not None:  # copy into the fixed addresses (small: T tokens of one layer)
            for dst, src in zip(
                (static[slot].x, static[slot].k, static[slot].u, static[slot].g), (log.x, log.k, log.u, log.g)
            ):
                dst.copy_(src)
            log = static[slot]
        self.logs[slot] = log
        return o

    def commit(self, n: torch.Tensor) -> None:
        """Fold n[r] tokens of the last verify into row r of every layer; n (N,) long in [0, T]."""
        if any(log is None for log in self.logs):
            raise RuntimeError("GDNState.commit without a verify of every GDN layer since the last commit")
        for slot, log in enumerate(self.logs):
            conv, rec = gdn_replay(self.conv[slot], self.rec[slot], log, n)
            self.conv[slot].copy_(conv)
            self.rec[slot].copy_(rec)
        self.logs = [None] * len(self.logs)
