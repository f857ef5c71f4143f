"""Plain-PyTorch twin of the verify's *chunked* recurrence (``chunked=True``; kernel: chunk_kernel.py).

The sequential recurrence (reference.py) per token, from a state S (d_k × d_v):

    S ← exp(g_t) S;   u_t = β_t (v_t − Sᵀk_t);   S ← S + k_t u_tᵀ;   o_t = Sᵀq_t

Unrolled over a chunk of tokens t = 1..C from S0, with G_t = g_1 + … + g_t (log of the cumulative
decay γ_t = exp(G_t)), the state before token t's update is γ_t S0 + Σ_{s<t} exp(G_t − G_s) k_s u_sᵀ, so

    u_t + β_t Σ_{s<t} exp(G_t − G_s) (k_tᵀk_s) u_s = β_t (v_t − exp(G_t) S0ᵀk_t)
        i.e. (I + A) U = B,  A[t, s] = β_t exp(G_t − G_s) k_tᵀk_s (s < t), B_t = β_t (v_t − exp(G_t) S0ᵀk_t)
    o_t = exp(G_t) S0ᵀq_t + Σ_{s≤t} exp(G_t − G_s) (q_tᵀk_s) u_s
    S_C = exp(G_C) S0 + Σ_s exp(G_C − G_s) k_s u_sᵀ       (the state the next chunk starts from)

A unit-lower-triangular C × C system and matrix products instead of C dependent steps. The decays
are taken as differences of the log cumsum, never as ratios of products: γ_t underflows to 0 after a
few strong gates (g ≪ 0), and γ_t/γ_s would be 0/0, while G_t − G_s ≤ 0 for s ≤ t keeps every
exp in (0, 1]. Equal to the sequential recurrence in exact arithmetic; in fp32 the sums run in
another order (rounding-level differences, tests/test_runtime_gdn_chunked.py).

Shapes: N rows, T tokens, H value heads, d_k, d_v head dims.
"""

from __future__ import annotations

import torch

from dflash2.runtime.kernels.gdn_log import GDNLog
from dflash2.runtime.kernels.gdn_verify.reference import gdn_gates, prepare_qkv

CHUNK = 16  # the kernel's tokens per chunk (tl.dot's smallest tile)


def chunked_recurrence(
    h0: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk: int = CHUNK,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The module docstring's chunk equations, chunk after chunk, in ``dtype`` (fp32 as the kernel;
    float64 gives the equations' exact values to compare the kernel's own fp32 rounding with).

    h0 (N, H, d_k, d_v) the state before token 1; q (N, T, H, d_k) (already scaled by 1/sqrt(d_k)),
    k (N, T, H, d_k), v (N, T, H, d_v), g (N, T, H) log decays, beta (N, T, H).
    Returns o (N, T, H, d_v), u (N, T, H, d_v) and the state after token T (N, H, d_k, d_v), in dtype.
    """
    N, T, H, dv = v.shape
    # heads first: (N, H, T, d)
    q, k, v = (t.to(dtype).transpose(1, 2) for t in (q, k, v))
    g, beta = (t.to(dtype).transpose(1, 2) for t in (g, beta))
    h = h0.to(dtype).clone()
    o = torch.empty(N, H, T, dv, dtype=dtype, device=v.device)
    u = torch.empty_like(o)
    for t0 in range(0, T, chunk):
        sl = slice(t0, min(t0 + chunk, T))
        qc, kc, vc, gc, bc = q[:, :, sl], k[:, :, sl], v[:, :, sl], g[:, :, sl], beta[:, :, sl]
        C = vc.shape[2]
        G = gc.cumsum(-1)  # (N, H, C): log γ_t
        lower = torch.ones(C, C, dtype=torch.bool, device=v.device).tril()  # [t, s]: s ≤ t
        # log(γ_t / γ_s) = Σ_{s<r≤t} g_r summed as its own segment, not as G_t − G_s: after a strong early
        # gate both G are large and their difference would lose |G|·2⁻²⁴ of the exponent
        idx = torch.arange(C, device=v.device)
        seg = (idx[None, None, :] > idx[None, :, None]) & (idx[None, None, :] <= idx[:, None, None])  # [t, s, r]
        D = (gc[..., None, None, :] * seg).sum(-1)  # (N, H, C, C)
        decay = torch.where(lower, D, 0.0).exp() * lower  # the other entries are never used (0 there)
        strict = lower.tril(-1)  # s < t: A's entries (its diagonal is the system's I)
        A = bc[..., None] * decay * (kc @ kc.transpose(-1, -2)) * strict
        B = bc[..., None] * (vc - G.exp()[..., None] * (kc @ h))
        eye = torch.eye(C, dtype=dtype, device=v.device)
        uc = torch.linalg.solve_triangular(eye + A, B, upper=False, unitriangular=True)
        o[:, :, sl] = G.exp()[..., None] * (qc @ h) + (decay * (qc @ kc.transpose(-1, -2))) @ uc
        u[:, :, sl] = uc
        last = G[..., -1:]  # (N, H, 1)
        tail = D[..., -1, :]  # (N, H, C): Σ_{s<r≤C-1} g_r, the decay from token s to the chunk's end
        h = last.exp()[..., None] * h + kc.transpose(-1, -2) @ (tail.exp()[..., None] * uc)
    return o.transpose(1, 2), u.transpose(1, 2), h


def gdn_verify_chunked_reference(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    conv_weight: torch.Tensor,
    rec_state: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    num_k_heads: int,
    *,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, GDNLog]:
    """gdn_verify_reference (ReplaySSM) with :func:`chunked_recurrence` for the token walk: same
    arguments, same (o (N, T, H, d_v) in x's dtype, GDNLog with k, u, g); the states are only read.
    dtype: the recurrence's (the prep stays fp32, as the kernel's); float64 returns o and u in float64."""
    H, dk = rec_state.shape[1:3]
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    q, k_heads, k, v = prepare_qkv(x, conv_state, conv_weight, H, num_k_heads, dk)
    o, u, _ = chunked_recurrence(rec_state, q, k, v, g, beta.float(), dtype=dtype)
    return (o if dtype == torch.float64 else o.to(x.dtype)), GDNLog(x=x, k=k_heads, u=u, g=g.float())
