"""The DFlash2 selector's greedy walk over one block in one launch (twin: the walk's eager ops).

The walk is sequential (each position's scores need the token chosen before it) and tiny: per
position, the chosen predecessor's codebook row times the position's hidden projection, its dot
with the k candidates' successor rows, the unary scores added, the argmax. Eagerly that is about
six launches per position; here one program per row walks all P positions:

    ph    = round(P[pred] · hh[pos])                    (``pred * hh``, in the codebooks' dtype)
    pair  = round(Σ_r ph[r] · S[cand[pos, c], r])       (the einsum's bmm, fp32 accumulation)
    score = unary[pos] + pair                           (fp32)
    pred  = cand[pos, argmax(score)]                    (ties: the first, the higher drafter logit)

Inputs as the selector path computes them: hh (N, P, r) = hidden_projection(hidden) (on the
kernel path one GEMM over all positions), cand_ids (N, P, k) long and unary (N, P, k) fp32 from
``CandidateSelector.candidates``, anchor (N,) long, the predecessor / successor codebooks (V, r).
Returns tokens (N, P) long. The dot sums in Triton's order, so a score may differ from the
twin's in its last bit (fp32) or by one rounding of pair (bf16): a near-tie may then choose the
other candidate. The drafts are proposals; the verify keeps decoding lossless whatever they are.
"""

import torch
import triton.language as tl

from dflash2.runtime.kernels import jit, use_triton
from dflash2.runtime.kernels.norm import triton_next_pow2


def selector_walk_ref(hh, cand_ids, unary, anchor, pred_codebook, succ_codebook):
    """The eager twin: ``SelectorWalk``'s greedy walk (selector_path.py) from given hh."""
    P = cand_ids.shape[1]
    pred = pred_codebook[anchor][:, None]  # (N, 1, r)
    out = []
    for pos in range(P):
        sl = slice(pos, pos + 1)
        pair = torch.einsum("npr,npkr->npk", pred * hh[:, sl], succ_codebook[cand_ids[:, sl]])  # (N, 1, k)
        choice = (unary[:, sl] + pair)[:, 0].argmax(-1)  # (N,)
        token = cand_ids[:, pos].gather(1, choice[:, None])  # (N, 1)
        out.append(token[:, 0])
        pred = pred_codebook[token]  # (N, 1, r)
    return torch.stack(out, dim=1)


def _selector_walk_kernel(
    hh_ptr,
    cand_ptr,
    unary_ptr,
    anchor_ptr,
    pcb_ptr,
    scb_ptr,
    out_ptr,
    P,
    K,
    R,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    STAGES: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    dt = pcb_ptr.dtype.element_ty
    kk = tl.arange(0, BLOCK_K)
    rr = tl.arange(0, BLOCK_R)
    km, rm = kk < K, rr < R
    anchor = tl.load(anchor_ptr + n)
    pred = tl.load(pcb_ptr + anchor * R + rr, mask=rm, other=0.0).to(tl.float32)
    # Why every load below is the position's own and none waits for the previous choice: the chosen
    # token's predecessor row is picked out of the candidates' rows (loaded with the position) by the
    # choice, in registers, instead of being read from memory once the choice is known. The walk took
    # 18 µs for 7 positions on an H200 (one program); whether these loads now overlap the previous
    # position's reductions is the compiler's choice, not measured yet: profile before claiming it.
    # software-pipelined (tl.range): a position's loads (its hidden projection, candidates, their codebook rows,
    # unary scores) do not depend on the previous choice, so the next STAGES-1 positions' loads are issued ahead
    # while this one reduces and chooses; the arithmetic is unchanged (STAGES 1: one position at a time)
    for pos in tl.range(0, P, num_stages=STAGES):
        row = n * P + pos
        h = tl.load(hh_ptr + row * R + rr, mask=rm, other=0.0).to(tl.float32)
        ids = tl.load(cand_ptr + row * K + kk, mask=km, other=0)
        rows_m = km[:, None] & rm[None, :]
        succ = tl.load(scb_ptr + ids[:, None] * R + rr[None, :], mask=rows_m, other=0.0)
        pred_rows = tl.load(pcb_ptr + ids[:, None] * R + rr[None, :], mask=rows_m, other=0.0).to(tl.float32)
        unary = tl.load(unary_ptr + row * K + kk, mask=km, other=0.0)
        ph = (pred * h).to(dt).to(tl.float32)  # pred * hh, rounded as the eager product
        pair = tl.sum(ph[None, :] * succ.to(tl.float32), axis=1).to(dt).to(tl.float32)  # the bmm's output rounding
        score = tl.where(km, unary + pair, float("-inf"))
        choice = tl.argmax(score, axis=0, tie_break_left=True)
        token = tl.sum(tl.where(kk == choice, ids, 0), axis=0)
        tl.store(out_ptr + row, token)
        # the next predecessor: row `choice` of the candidates' rows (a sum with one term: the value itself,
        # except that a -0.0 entry comes back +0.0, which rounds every product and sum the same)
        pred = tl.sum(tl.where((kk == choice)[:, None], pred_rows, 0.0), axis=0)


# software-pipeline stages of the walks' position loop (kernels/selector.py, selector_sample.py); 1 = none
WALK_STAGES = 3


def selector_walk(
    hh, cand_ids, unary, anchor, pred_codebook, succ_codebook, *, stages: int = WALK_STAGES
) -> torch.Tensor:
    """tokens (N, P) long: the greedy walk; the Triton kernel on CUDA (and in ``on_cpu()``), else the twin.
    stages: the kernel's pipeline depth over positions (the same arithmetic at any depth)."""
    fits = (
        hh.dtype == pred_codebook.dtype == succ_codebook.dtype
        and unary.dtype == torch.float32
        and pred_codebook.is_contiguous()
        and succ_codebook.is_contiguous()
    )
    if not use_triton(hh) or not fits:
        return selector_walk_ref(hh, cand_ids, unary, anchor, pred_codebook, succ_codebook)
    N, P, K = cand_ids.shape
    R = hh.shape[-1]
    out = torch.empty(N, P, dtype=torch.long, device=hh.device)
    block_r = max(triton_next_pow2(R), 16)
    jit(_selector_walk_kernel)[(N,)](
        hh.contiguous(),
        cand_ids.contiguous(),
        unary.contiguous(),
        anchor.contiguous(),
        pred_codebook,
        succ_codebook,
        out,
        P,
        K,
        R,
        BLOCK_K=max(triton_next_pow2(K), 16),
        BLOCK_R=block_r,
        num_warps=4 if block_r >= 256 else 1,
        STAGES=stages,
    )
    return out
