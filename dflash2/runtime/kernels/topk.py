"""The k largest values of a few long rows in two launches (twin: a stable descending sort).

Why: the drafter's block hands the DFlash2 selector its k candidates per drafted position, the
top-k of that position's logits over the whole vocabulary. At batch 1 that is P ≈ 7–15 rows of V
values, and ``torch.topk`` on so few rows runs a multi-pass radix select with one thread block
per row: 48 µs of a 257 µs draft phase on the H200 (7 rows × 8192, the GPU-sized pair), half as
much as all the drafter's GEMMs together (95 µs). Here the row is cut into chunks so that many programs
share it:

* stage 1, one program per (row, chunk of ``CHUNK`` values): k rounds of "the largest value
  still in, the lowest index holding it, take it out" → the chunk's k finalists;
* stage 2, one program per row (only when the row has more than one chunk): the same rounds
  over the row's C·k finalists, the lowest *index* winning a tie again.

Order of the result: values descending, equal values by ascending index — exactly
``torch.sort(x, descending=True, stable=True)[..., :k]``, the twin :func:`topk_rows_ref`.
``torch.topk`` (the fallback off the kernel path) leaves the order of equal values unspecified,
so the two may list tied candidates differently; the selector's walk breaks ties by list
position, so a drafted token can differ on an exact tie. Drafts are proposals: verification
keeps the decode lossless whatever they are.

Values compare in fp32 (exact for bf16 / fp16 / fp32 inputs) and come back in the input dtype.
-inf is a value like any other; NaN is not supported (logits are finite).
Shapes: x (..., V) with V ≥ k → values (..., k) in x's dtype, indices (..., k) int64.
"""

from __future__ import annotations

import torch
import triton.language as tl

from dflash2.runtime.kernels import jit, use_triton
from dflash2.runtime.kernels.norm import triton_next_pow2

CHUNK = 1024  # values per stage-1 program: 8 per thread at 4 warps, so a round's two reductions stay short
_NO_INDEX = tl.constexpr(2**62)  # larger than any index: "none" in the min-index reductions (a jit global)


def topk_rows_ref(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The twin: values (..., k) and indices (..., k) of a stable descending sort's first k."""
    values, indices = torch.sort(x, dim=-1, descending=True, stable=True)
    return values[..., :k], indices[..., :k]


def _topk_kernel(
    src_val_ptr,
    src_key_ptr,
    dst_val_ptr,
    dst_key_ptr,
    L,
    S,
    SEG: tl.constexpr,
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_KEYS: tl.constexpr,
):
    """Program (row, seg): the k largest of values [seg·SEG, (seg+1)·SEG) ∩ [0, L) of a row of L, to
    dst[(row · S + seg) · K + i], i < K, with their keys: the vocabulary index. HAS_KEYS: the keys are
    loaded beside the values (stage 2, over stage 1's finalists), else they are the positions (stage 1).

    k rounds: the largest value still in, the smallest key holding it (the tie rule), taken out."""
    row = tl.program_id(0).to(tl.int64)
    seg = tl.program_id(1).to(tl.int64)
    offs = seg * SEG + tl.arange(0, SEG).to(tl.int64)
    inside = offs < L
    x = tl.load(src_val_ptr + row * L + offs, mask=inside, other=float("-inf")).to(tl.float32)
    if HAS_KEYS:  # noqa: SIM108 (a constexpr branch: one of the two is compiled)
        key = tl.load(src_key_ptr + row * L + offs, mask=inside, other=_NO_INDEX)
    else:
        key = offs
    # a stage-1 chunk shorter than k (only the last can be) leaves _NO_INDEX keys: never taken while V >= k
    alive = inside & (key != _NO_INDEX)
    kk = tl.arange(0, BLOCK_K)
    values = tl.full([BLOCK_K], float("-inf"), tl.float32)
    keys = tl.full([BLOCK_K], _NO_INDEX, tl.int64)
    for i in tl.static_range(K):
        best = tl.max(tl.where(alive, x, float("-inf")), axis=0)
        pick = tl.min(tl.where(alive & (x == best), key, _NO_INDEX), axis=0)
        # the picked element's own value (best may be +0.0 where the lowest index holds -0.0)
        value = tl.max(tl.where(alive & (key == pick), x, float("-inf")), axis=0)
        values = tl.where(kk == i, value, values)
        keys = tl.where(kk == i, pick, keys)
        alive = alive & (key != pick)
    out = (row * S + seg) * K + kk
    tl.store(dst_val_ptr + out, values.to(dst_val_ptr.dtype.element_ty), mask=kk < K)
    tl.store(dst_key_ptr + out, keys, mask=kk < K)


def topk_rows(x: torch.Tensor, k: int, *, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """values (..., k) in x's dtype and indices (..., k) int64 of the k largest of each row of x (..., V),
    sorted descending (ties: lower index first). The two-stage Triton kernel on CUDA (and in
    ``on_cpu()``); elsewhere ``torch.topk`` (same set, tie order unspecified)."""
    V = x.shape[-1]
    if not 1 <= k <= V:
        raise ValueError(f"top-k needs 1 <= k <= V, got k={k} for rows of {V} values")
    if not use_triton(x) or k > 64:  # k rounds are unrolled: beyond a few dozen a sort is the better tool
        return torch.topk(x, k, dim=-1)
    lead = x.shape[:-1]
    rows = x.reshape(-1, V).contiguous()
    R = rows.shape[0]
    chunk = min(triton_next_pow2(chunk), triton_next_pow2(V))
    C = -(-V // chunk)
    block_k = triton_next_pow2(k)
    values = torch.empty(R, k, dtype=x.dtype, device=x.device)
    indices = torch.empty(R, k, dtype=torch.long, device=x.device)
    if R == 0:
        return values.reshape(*lead, k), indices.reshape(*lead, k)
    kernel = jit(_topk_kernel)
    warps = 4 if chunk >= 512 else 1
    if C == 1:  # one chunk per row: stage 1 is the answer
        kernel[(R, 1)](
            rows, rows, values, indices, V, 1, SEG=chunk, K=k, BLOCK_K=block_k, HAS_KEYS=False, num_warps=warps
        )
        return values.reshape(*lead, k), indices.reshape(*lead, k)
    finalists = C * k
    part_values = torch.empty(R, finalists, dtype=torch.float32, device=x.device)
    part_indices = torch.empty(R, finalists, dtype=torch.long, device=x.device)
    kernel[(R, C)](
        rows, rows, part_values, part_indices, V, C, SEG=chunk, K=k, BLOCK_K=block_k, HAS_KEYS=False, num_warps=warps
    )
    seg = triton_next_pow2(finalists)
    kernel[(R, 1)](
        part_values,
        part_indices,
        values,
        indices,
        finalists,
        1,
        SEG=seg,
        K=k,
        BLOCK_K=block_k,
        HAS_KEYS=True,
        num_warps=min(8, max(1, seg // 256)),
    )
    return values.reshape(*lead, k), indices.reshape(*lead, k)
