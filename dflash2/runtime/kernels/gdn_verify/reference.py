"""Plain-PyTorch twin of the GDN verify kernel (and the runtime's ``mode="reference"`` verify).

Per token, after the short causal conv + SiLU and the q/k L2 norms (HF / fla semantics,
docs/ARCHITECTURE.md §5.1):

    h ← exp(g_t) · h                 g_t = -exp(A_log) · softplus(a_t + dt_bias)  (log decay, fp32)
    u_t = β_t · (v_t − hᵀ k_t)       β_t = sigmoid(b_t)
    h ← h + k_t u_tᵀ
    o_t = hᵀ q_t / sqrt(d_k)

computed for the T tokens of a block from the *untouched* state (a working copy). The
ReplaySSM log keeps (k_t, u_t, g_t); the native-rollback ablation keeps h after every t.

Shapes: N rows, T block tokens, C conv channels (2·Hk·d_k + H·d_v), K conv kernel,
Hk key heads, H value heads (Hk divides H; value head h reads key head h // (H/Hk)).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dflash2.runtime.kernels.gdn_log import GDNLog


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gdn_gates(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """a, b (N, T, H) projections (model dtype); A_log, dt_bias (H,) -> g (N, T, H) fp32, β (N, T, H) in b's dtype.

    g in fp32 (in bf16, exp(A_log) · softplus would lose the small decays); β = sigmoid(b) in
    the model dtype, as HF computes it.

    softplus and sigmoid token by token, so that a token's gates have the same bits whatever block it is
    verified in (an AR step, a verify block, a prefill padded to a bucket): on the CPU, ATen runs a
    tensor's elements through vectorised math in chunks and the few left over through scalar libm, which
    rounds these two differently in the last bit, so in one (N, T, H) call a token's bits depended on T.
    Each token's (N, H) gates as a contiguous tensor of their own take the same path for any T (the add
    and the product are correctly rounded either way: done at once). One token (an AR step) is one call.
    """
    # one token: (N, 1, H) is already a token's own (N, H) tensor. CUDA: every element runs the same device
    # function whatever the tensor's length (no scalar tail), so the T per-token launches would buy nothing
    if a.shape[1] <= 1 or a.is_cuda:
        return -A_log.float().exp() * F.softplus(a.float() + dt_bias), torch.sigmoid(b.contiguous())
    x = (a.float() + dt_bias).transpose(0, 1).contiguous()  # (T, N, H): x[t] contiguous, as at T = 1
    g = -A_log.float().exp() * torch.stack([F.softplus(x_t) for x_t in x], dim=1)
    return g, torch.stack([torch.sigmoid(b_t) for b_t in b.transpose(0, 1).contiguous()], dim=1)


def causal_conv_silu(x: torch.Tensor, conv_state: torch.Tensor, conv_weight: torch.Tensor) -> torch.Tensor:
    """SiLU(depthwise causal conv) over [window | block]: x (N, T, C), conv_state (N, C, K-1) -> (N, T, C).

    Output t sees inputs t-K+1 .. t; computed in the weight's dtype and rounded to x's dtype (as HF).
    """
    C = x.shape[-1]
    window = torch.cat([conv_state, x.transpose(1, 2).to(conv_state.dtype)], dim=-1)  # (N, C, K-1+T)
    y = F.silu(F.conv1d(window.to(conv_weight.dtype), conv_weight, groups=C)).to(x.dtype)  # (N, C, T)
    return y.transpose(1, 2)


def prepare_qkv(
    x: torch.Tensor, conv_state: torch.Tensor, conv_weight: torch.Tensor, H: int, num_k_heads: int, head_k_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Conv + SiLU, split, L2 norms: x (N, T, C) -> fp32 q (N, T, H, d_k) scaled by 1/sqrt(d_k), k_heads
    (N, T, Hk, d_k) (what the log keeps), k (N, T, H, d_k) (k_heads per value head), v (N, T, H, d_v)."""
    N, T, C = x.shape
    dk = head_k_dim
    y = causal_conv_silu(x, conv_state, conv_weight)
    key_dim = num_k_heads * dk
    q, k, v = y.split([key_dim, key_dim, C - 2 * key_dim], dim=-1)
    r = H // num_k_heads  # value heads per key head: head h reads q/k head h // r
    k_heads = l2norm(k.reshape(N, T, num_k_heads, dk).float())  # (N, T, Hk, dk), what the log keeps
    q = l2norm(q.reshape(N, T, num_k_heads, dk).float()).repeat_interleave(r, dim=2) / dk**0.5  # (N, T, H, dk)
    k = k_heads.repeat_interleave(r, dim=2)
    v = v.reshape(N, T, H, -1).float()
    return q, k_heads, k, v


def gdn_verify(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    conv_weight: torch.Tensor,
    rec_state: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    num_k_heads: int,
    head_k_dim: int,
    *,
    native: bool = False,
) -> tuple[torch.Tensor, GDNLog]:
    """Outputs of T tokens per row from the untouched states, plus the commit log.

    x (N, T, C) pre-conv q|k|v projections; conv_state (N, C, K-1); conv_weight (C, 1, K);
    rec_state (N, H, d_k, d_v) fp32 (read only); g (N, T, H) fp32; beta (N, T, H).
    Returns o (N, T, H, d_v) in x's dtype and the :class:`GDNLog` (native: the T states).
    """
    N, T = x.shape[:2]
    H, dk, dv = rec_state.shape[1:]
    q, k_heads, k, v = prepare_qkv(x, conv_state, conv_weight, H, num_k_heads, head_k_dim)
    beta = beta.float()
    h = rec_state.clone()  # working copy; the real state is only changed by commit
    u = torch.empty(N, T, H, dv, dtype=torch.float32, device=x.device)
    o = torch.empty(N, T, H, dv, dtype=torch.float32, device=x.device)
    states = torch.empty(N, T, H, dk, dv, dtype=torch.float32, device=x.device) if native else None
    for t in range(T):
        h = h * g[:, t].exp()[..., None, None]
        u[:, t] = (v[:, t] - (h * k[:, t, :, :, None]).sum(-2)) * beta[:, t, :, None]  # (N, H, dv)
        h = h + k[:, t, :, :, None] * u[:, t, :, None, :]
        o[:, t] = (h * q[:, t, :, :, None]).sum(-2)
        if native:
            states[:, t] = h
    if native:
        return o.to(x.dtype), GDNLog(x=x, states=states)
    return o.to(x.dtype), GDNLog(x=x, k=k_heads, u=u, g=g.float())


def gdn_verify_reference(
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
    native: bool = False,
) -> tuple[torch.Tensor, GDNLog]:
    """The Triton kernel's signature: gates from the raw projections, then :func:`gdn_verify`.

    a, b (N, T, H) in_proj_a / in_proj_b outputs; A_log, dt_bias (H,); the rest as gdn_verify.
    """
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    return gdn_verify(x, conv_state, conv_weight, rec_state, g, beta, num_k_heads, rec_state.shape[2], native=native)
