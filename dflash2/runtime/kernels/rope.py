"""One attention layer's q/k RMSNorm + RoPE + K/V cache write in one launch (twin: the eager ops).

Input is the fused projection ``qkv`` (N, T, W), laid out per token as
``[q heads | k heads | v heads]``; with an output gate (Qwen3.5) each q head is
``[q_h | gate_h]`` (2·D wide) and the gate is left in place for the caller. Per head:

    x = RMSNorm(x)                         (q_norm / k_norm; skipped for Llama)
    x[:R] = x[:R]·cos + rotate_half(x[:R])·sin     (RoPE on the first R dims; R = D unless partial)

q goes to a new (N, H, T, D) tensor; k and v are written into the layer's cache at
``positions`` (N, T) — K/V never exist as separate tensors. Every rounding of the
eager code (norm, each RoPE product, the sum) is reproduced, so bf16 outputs match.

Shapes: N rows, T tokens, H query / Hkv key-value heads, D head_dim, R rotary dims,
k_cache / v_cache (N, Hkv, S, D) (one layer's slot of :class:`~dflash2.runtime.cache.KVCache`).
"""

import torch
import triton.language as tl

from dflash2.runtime.kernels import jit, use_triton
from dflash2.runtime.kernels.norm import add_rms_norm_ref, triton_next_pow2


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Eager RoPE on the first R dims (all when R == D); the rest pass through. x (N, h, T, D), cos/sin (N, 1, T, R)."""
    rot = cos.shape[-1]
    xr, xp = x[..., :rot], x[..., rot:]
    x1, x2 = xr.chunk(2, dim=-1)
    xr = xr * cos + torch.cat([-x2, x1], dim=-1) * sin
    return torch.cat([xr, xp], dim=-1) if xp.shape[-1] else xr


def split_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, gated: bool):
    """qkv (N, T, W) -> q (N, T, H, D), gate (N, T, H, D) or None, k, v (N, T, Hkv, D): views."""
    N, T, _ = qkv.shape
    qd = num_heads * head_dim * (2 if gated else 1)
    kd = num_kv_heads * head_dim
    q = qkv[..., :qd].view(N, T, num_heads, -1)
    gate = q[..., head_dim:] if gated else None
    k = qkv[..., qd : qd + kd].view(N, T, num_kv_heads, head_dim)
    v = qkv[..., qd + kd :].view(N, T, num_kv_heads, head_dim)
    return q[..., :head_dim], gate, k, v


def qk_norm_rope_write_ref(qkv, q_norm_w, k_norm_w, cos, sin, positions, k_cache, v_cache, **shape):
    """The eager twin: returns q (N, H, T, D) and writes k, v into the caches at positions.

    shape: num_heads, num_kv_heads, head_dim, gated, eps, offset (as :func:`qk_norm_rope_write`)."""
    num_kv_heads, head_dim = shape["num_kv_heads"], shape["head_dim"]
    q, _, k, v = split_qkv(qkv, shape["num_heads"], num_kv_heads, head_dim, shape["gated"])
    if q_norm_w is not None:
        q = add_rms_norm_ref(q, None, q_norm_w, shape["eps"], shape["offset"])[1]
        k = add_rms_norm_ref(k, None, k_norm_w, shape["eps"], shape["offset"])[1]
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (N, h, T, D)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    index = positions[:, None, :, None].expand(-1, num_kv_heads, -1, head_dim)  # (N, Hkv, T, D)
    k_cache.scatter_(2, index, k)
    v_cache.scatter_(2, index, v)
    return q


def _qk_rope_kernel(
    qkv_ptr,
    qw_ptr,
    kw_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    q_ptr,
    kc_ptr,
    vc_ptr,
    T,
    H,
    W,
    q_head_stride,
    k_off,
    v_off,
    eps,
    s_cn,
    s_ch,
    s_cs,
    D: tl.constexpr,
    R: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_NORM: tl.constexpr,
    OFFSET: tl.constexpr,
):
    # program (token m = n·T + t, head j): j < H a query head, else key/value head j - H
    m = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    n = m // T
    t = m % T
    dt = q_ptr.dtype.element_ty
    d = tl.arange(0, BLOCK)
    dm = d < D
    rot = d < R
    partner = tl.where(d < R // 2, d + R // 2, d - R // 2)  # rotate_half: [-x2, x1]
    sign = tl.where(d < R // 2, -1.0, 1.0)
    is_q = j < H
    col = tl.where(is_q, j * q_head_stride, k_off + (j - H) * D)
    base = qkv_ptr + m * W + col
    x = tl.load(base + d, mask=dm, other=0.0).to(tl.float32)
    xp = tl.load(base + partner, mask=dm & rot, other=0.0).to(tl.float32)
    if HAS_NORM:
        if is_q:
            w = tl.load(qw_ptr + d, mask=dm, other=0.0).to(tl.float32)
            wp = tl.load(qw_ptr + partner, mask=dm & rot, other=0.0).to(tl.float32)
        else:
            w = tl.load(kw_ptr + d, mask=dm, other=0.0).to(tl.float32)
            wp = tl.load(kw_ptr + partner, mask=dm & rot, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
        if OFFSET:  # one rounding after the (1 + w) scale
            x = (x * rstd * (1.0 + w)).to(dt).to(tl.float32)
            xp = (xp * rstd * (1.0 + wp)).to(dt).to(tl.float32)
        else:  # round the normalised value, then the weight's product
            x = (w * (x * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
            xp = (wp * (xp * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    c = tl.load(cos_ptr + m * R + d, mask=dm & rot, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + m * R + d, mask=dm & rot, other=0.0).to(tl.float32)
    a = (x * c).to(dt).to(tl.float32)  # each eager product rounds, then the sum
    b = (sign * xp * s).to(dt).to(tl.float32)
    y = tl.where(rot, (a + b).to(dt), x.to(dt))
    if is_q:
        tl.store(q_ptr + ((n * H + j) * T + t) * D + d, y, mask=dm)
    else:
        hk = j - H
        pos = tl.load(pos_ptr + m)
        off = n * s_cn + hk * s_ch + pos * s_cs + d
        tl.store(kc_ptr + off, y, mask=dm)
        v = tl.load(qkv_ptr + m * W + v_off + hk * D + d, mask=dm, other=0.0)
        tl.store(vc_ptr + off, v.to(vc_ptr.dtype.element_ty), mask=dm)


def qk_norm_rope_write(
    qkv: torch.Tensor,
    q_norm_w: torch.Tensor | None,
    k_norm_w: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    gated: bool = False,
    eps: float = 1e-6,
    offset: bool = False,
) -> torch.Tensor:
    """q (N, H, T, D) normed + rotated; k, v written into the caches. Triton on CUDA, else the twin.

    qkv (N, T, W); q_norm_w / k_norm_w (D,) or None (no q/k norm); cos, sin (N, 1, T, R) in qkv's
    dtype; positions (N, T) long; k_cache, v_cache (N, Hkv, S, D) with unit stride in D.
    """
    kw = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, gated=gated, eps=eps, offset=offset)
    same = q_norm_w is None or q_norm_w.dtype == qkv.dtype
    if not use_triton(qkv) or not same or k_cache.stride(-1) != 1 or k_cache.stride() != v_cache.stride():
        return qk_norm_rope_write_ref(qkv, q_norm_w, k_norm_w, cos, sin, positions, k_cache, v_cache, **kw)
    N, T, W = qkv.shape
    H, Hkv, D = num_heads, num_kv_heads, head_dim
    R = cos.shape[-1]
    qkv = qkv.contiguous()
    cos, sin, positions = cos.contiguous(), sin.contiguous(), positions.contiguous()
    q = torch.empty(N, H, T, D, dtype=qkv.dtype, device=qkv.device)
    qd = H * D * (2 if gated else 1)
    dummy = q if q_norm_w is None else None
    jit(_qk_rope_kernel)[(N * T, H + Hkv)](
        qkv,
        q_norm_w if dummy is None else dummy,
        k_norm_w if dummy is None else dummy,
        cos,
        sin,
        positions,
        q,
        k_cache,
        v_cache,
        T,
        H,
        W,
        D * (2 if gated else 1),
        qd,
        qd + Hkv * D,
        eps,
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        D=D,
        R=R,
        BLOCK=max(triton_next_pow2(D), 16),
        HAS_NORM=q_norm_w is not None,
        OFFSET=offset,
        num_warps=1 if D <= 256 else 4,
    )
    return q
