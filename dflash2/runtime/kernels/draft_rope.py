"""The runtime drafter's q/k RMSNorm + RoPE + K/V cache write in one launch (twin: its eager ops).

The drafter's version of :func:`~dflash2.runtime.kernels.rope.qk_norm_rope_write`, with the
drafter's arithmetic (``dflash2.runtime.draft_math``): fp32 norm weights, one row per head, and
one rounding after the weight's product; RoPE on all head dims with the tables of
``draft_math.rope_tables`` (the rotate_half sign folded into sin). Input is a projection ``qkv``
(N, T, W) laid out per token as ``[H q heads | L·Hkv k heads | L·Hkv v heads]`` of hd each.
Per q / k head j (norm weight row j):

    x = round((x·rstd(x))·w[j])                                (draft_math.rms_norm)
    y = round(round(x·cos) + round(roll(x, hd/2)·sin±))       (draft_math.rotate)

q goes to a new (N, H, T, hd) tensor; k and v are written into the caches at ``positions``
(N, T), K/V head h = l·Hkv + j of layer slot l. One call serves a draft step's layer (H query
heads, one cache slot) and the context append of every layer at once (H = 0, L slots, no q).

The twin is the eager code, so on the CPU the drafter stays bit for bit with its modules. The
kernel rounds at the same points; its one reduction (a head's sum of squares) sums in Triton's
order and is scaled by the fp32 reciprocal of hd as ``torch.mean`` on CUDA does (the CPU's mean
divides), so rstd may differ in the last fp32 bit: fp32 outputs agree to a few ulps, bf16 ones
to one unit in the last place where that flips a rounding.

Shapes: N rows, T tokens, H query heads, L cache slots of Hkv heads, hd head_dim; k_cache /
v_cache (L, N, Hkv, S, hd) (one slot may be passed as (N, Hkv, S, hd)).
"""

import torch
import triton.language as tl

from dflash2.runtime.draft_math import rms_norm, rotate
from dflash2.runtime.kernels import jit, use_triton
from dflash2.runtime.kernels.norm import triton_next_pow2


def _slots(cache: torch.Tensor) -> torch.Tensor:
    return cache[None] if cache.dim() == 4 else cache


def draft_qk_rope_write_ref(qkv, norm32, cos, signed_sin, positions, k_cache, v_cache, *, num_heads: int, eps: float):
    """The eager twin (the runtime drafter's ops): returns q (N, H, T, hd) (a view; None when H = 0) and
    writes k, v into the caches at positions (one scatter each)."""
    k_cache, v_cache = _slots(k_cache), _slots(v_cache)
    N, T, _ = qkv.shape
    L, _, Hkv, _, hd = k_cache.shape
    H, K = num_heads, L * Hkv
    heads = qkv.view(N, T, -1, hd)  # (N, T, H + 2·L·Hkv, hd)
    qk = rotate(rms_norm(heads[:, :, : H + K], norm32, eps), cos, signed_sin)  # (N, T, H + L·Hkv, hd)
    per_slot = (N, T, L, Hkv, hd)  # -> (L, N, Hkv, T, hd)
    k = qk[:, :, H:].view(per_slot).permute(2, 0, 3, 1, 4)
    v = heads[:, :, H + K :].view(per_slot).permute(2, 0, 3, 1, 4)
    index = positions[None, :, None, :, None].expand(k.shape)
    k_cache.scatter_(3, index, k)
    v_cache.scatter_(3, index, v)
    return qk[:, :, :H].transpose(1, 2) if H else None


def _draft_qk_rope_kernel(
    qkv_ptr,
    w_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    q_ptr,
    kc_ptr,
    vc_ptr,
    T,
    H,
    K,
    HKV,
    W,
    eps,
    s_cl,
    s_cn,
    s_ch,
    s_cs,
    D: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # program (token m = n·T + t, head j): j < H a query head, else key/value head j - H (slot (j-H) // HKV)
    m = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    n = m // T
    t = m % T
    dt = kc_ptr.dtype.element_ty
    d = tl.arange(0, BLOCK)
    dm = d < D
    partner = tl.where(d < D // 2, d + D // 2, d - D // 2)  # roll(x, hd/2)
    base = qkv_ptr + m * W + j * D  # q and k heads are consecutive rows of hd
    x = tl.load(base + d, mask=dm, other=0.0).to(tl.float32)
    xp = tl.load(base + partner, mask=dm, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + j * D + d, mask=dm, other=0.0).to(tl.float32)
    wp = tl.load(w_ptr + j * D + partner, mask=dm, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) * (1.0 / D) + eps)  # torch.mean on CUDA: the sum times 1/D
    x = ((x * rstd) * w).to(dt).to(tl.float32)  # the norm: fp32 products, one rounding
    xp = ((xp * rstd) * wp).to(dt).to(tl.float32)
    c = tl.load(cos_ptr + m * D + d, mask=dm, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + m * D + d, mask=dm, other=0.0).to(tl.float32)  # the sign already folded in
    y = ((x * c).to(dt).to(tl.float32) + (xp * s).to(dt).to(tl.float32)).to(dt)  # each product rounds, then the sum
    if j < H:
        tl.store(q_ptr + ((n * H + j) * T + t) * D + d, y, mask=dm)
    else:
        hk = j - H
        pos = tl.load(pos_ptr + m)
        off = (hk // HKV) * s_cl + n * s_cn + (hk % HKV) * s_ch + pos * s_cs + d
        tl.store(kc_ptr + off, y, mask=dm)
        v = tl.load(qkv_ptr + m * W + (H + K + hk) * D + d, mask=dm, other=0.0)
        tl.store(vc_ptr + off, v.to(vc_ptr.dtype.element_ty), mask=dm)


def draft_qk_rope_write(
    qkv: torch.Tensor,
    norm32: torch.Tensor,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    num_heads: int,
    eps: float,
) -> torch.Tensor | None:
    """q (N, H, T, hd) normed + rotated (None when num_heads = 0); k, v written into the caches.

    qkv (N, T, (H + 2·L·Hkv)·hd); norm32 (H + L·Hkv, hd) fp32: the q heads' then the k heads' norm
    weights (``DraftWeights``' qk_norm, or context_k_norm with H = 0); cos, signed_sin (N, T, 1, hd)
    from ``draft_math.rope_tables`` in qkv's dtype; positions (N, T) long; k_cache, v_cache
    (L, N, Hkv, S, hd) or one slot (N, Hkv, S, hd), unit stride in hd. The Triton kernel on CUDA (and
    under the interpreter in ``on_cpu()``), else the twin."""
    kc, vc = _slots(k_cache), _slots(v_cache)
    N, T, W = qkv.shape
    L, _, Hkv, _, D = kc.shape
    H, K = num_heads, L * Hkv
    fits = (
        W == (H + 2 * K) * D
        and D % 2 == 0
        and tuple(norm32.shape) == (H + K, D)
        and norm32.dtype == torch.float32
        and kc.dtype == qkv.dtype
        and kc.stride(-1) == 1
        and kc.stride() == vc.stride()
        and cos.shape[-1] == D
    )
    if not use_triton(qkv) or not fits:
        return draft_qk_rope_write_ref(
            qkv, norm32, cos, signed_sin, positions, k_cache, v_cache, num_heads=num_heads, eps=eps
        )
    qkv = qkv.contiguous()
    norm32, positions = norm32.contiguous(), positions.contiguous()
    cos, signed_sin = cos.contiguous(), signed_sin.contiguous()  # (N, T, 1, hd): row m·hd
    q = torch.empty(N, H, T, D, dtype=qkv.dtype, device=qkv.device) if H else None
    jit(_draft_qk_rope_kernel)[(N * T, H + K)](
        qkv,
        norm32,
        cos,
        signed_sin,
        positions,
        kc if q is None else q,  # never written when H = 0
        kc,
        vc,
        T,
        H,
        K,
        Hkv,
        W,
        eps,
        kc.stride(0),
        kc.stride(1),
        kc.stride(2),
        kc.stride(3),
        D=D,
        BLOCK=max(triton_next_pow2(D), 16),
        num_warps=1 if D <= 256 else 4,
    )
    return q
