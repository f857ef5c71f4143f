"""The DFlash2 selector's T>0 walk over one block in one launch (twin: the sampled walk's eager ops).

At T>0 the selector samples position by position from softmax(edge scores / T) over its k
candidates, given the *sampled* predecessor (``CandidateSelector.sample_path``; selector_path.py's
``selector_sample_sparse`` keeps q sparse). Eagerly a position is about ten launches (its hidden
projection, the pair term's product and bmm, the add, the scale, the softmax, the race draw, the
divide, the argmax, the predecessor gather). Here one program per row walks all P positions as
kernels/selector.py's greedy walk does (the same scores, rounded the same way), and per position

    x    = score · (1 / T)                          (fp32; torch scales by a CPU scalar so on CUDA)
    prob = exp(x − max x) / Σ exp(x − max x)        (the softmax over the k candidates)
    pick = argmax(prob / race[pos])                 (the exponential race: a draw from prob)

writing prob (the q of that position, on the k candidate ids) and the picked token. The races
(P, N, k) fp32 are drawn before the launch in torch, P draws of (N, k) in the order the eager walk
draws them, so the generator advances alike (also one registered with a CUDA graph).

Why the rounding does not matter for losslessness: the kernel draws from the prob it returns as q,
so the proposal's q is exactly the distribution its draft was drawn from, which is all rejection
sampling needs. Against the twin the scores differ as in the greedy walk (dot order), and exp and
the softmax's sum are Triton's, so probs agree to a few ulps and a near-tie of prob / race may pick
the other candidate (then the walks diverge: another, equally valid, proposal).

Shapes: N rows, P positions, k candidates, r selector rank, V vocabulary.
"""

import torch
import torch.nn.functional as F
import triton.language as tl

from dflash2.runtime.kernels import jit, use_triton
from dflash2.runtime.kernels.norm import triton_next_pow2
from dflash2.runtime.kernels.selector import WALK_STAGES


def selector_sample_walk_ref(hh, cand_ids, unary, anchor, pred_codebook, succ_codebook, temperature, races):
    """The eager twin (``selector_sample_sparse``'s walk from given hh and races) -> tokens (N, P) long,
    probs (N, P, k) fp32. hh (N, P, r); cand_ids (N, P, k) long; unary (N, P, k) fp32; anchor (N,) long;
    codebooks (V, r); temperature > 0; races (P, N, k) fp32 ~ Exp(1)."""
    P = cand_ids.shape[1]
    pred = pred_codebook[anchor][:, None]  # (N, 1, r)
    tokens, probs = [], []
    for pos in range(P):
        sl = slice(pos, pos + 1)
        pair = torch.einsum("npr,npkr->npk", pred * hh[:, sl], succ_codebook[cand_ids[:, sl]])  # (N, 1, k)
        prob = F.softmax((unary[:, sl] + pair)[:, 0] / temperature, dim=-1)  # (N, k)
        choice = (prob / races[pos]).argmax(-1)  # sampling.sample's draw with this race
        token = cand_ids[:, pos].gather(1, choice[:, None])  # (N, 1)
        tokens.append(token[:, 0])
        probs.append(prob)
        pred = pred_codebook[token]  # (N, 1, r)
    return torch.stack(tokens, dim=1), torch.stack(probs, dim=1)


def _selector_sample_kernel(
    hh_ptr,
    cand_ptr,
    unary_ptr,
    anchor_ptr,
    pcb_ptr,
    scb_ptr,
    race_ptr,
    out_ptr,
    probs_ptr,
    inv_t,
    N,
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
        race = tl.load(race_ptr + (pos * N + n) * K + kk, mask=km, other=1.0)
        # the edge scores exactly as kernels/selector.py's greedy walk rounds them
        ph = (pred * h).to(dt).to(tl.float32)
        pair = tl.sum(ph[None, :] * succ.to(tl.float32), axis=1).to(dt).to(tl.float32)
        x = tl.where(km, (unary + pair) * inv_t, float("-inf"))
        e = tl.exp(x - tl.max(x, axis=0))  # 0 on the padding lanes
        prob = tl.div_rn(e, tl.sum(e, axis=0))
        tl.store(probs_ptr + row * K + kk, prob, mask=km)
        choice = tl.argmax(tl.where(km, tl.div_rn(prob, race), -1.0), axis=0, tie_break_left=True)
        tl.store(out_ptr + row, tl.sum(tl.where(kk == choice, ids, 0), axis=0))
        # the next predecessor: row `choice` of the candidates' rows (as in the greedy walk)
        pred = tl.sum(tl.where((kk == choice)[:, None], pred_rows, 0.0), axis=0)


def selector_sample_walk(
    hh, cand_ids, unary, anchor, pred_codebook, succ_codebook, temperature, races, *, stages: int = WALK_STAGES
):
    """tokens (N, P) long, probs (N, P, k) fp32: the sampled walk; the Triton kernel on CUDA (and in
    ``on_cpu()``), else the twin. Arguments: see :func:`selector_sample_walk_ref`; stages: as selector_walk's."""
    fits = (
        hh.dtype == pred_codebook.dtype == succ_codebook.dtype
        and unary.dtype == races.dtype == torch.float32
        and pred_codebook.is_contiguous()
        and succ_codebook.is_contiguous()
    )
    if not use_triton(hh) or not fits:
        return selector_sample_walk_ref(hh, cand_ids, unary, anchor, pred_codebook, succ_codebook, temperature, races)
    N, P, K = cand_ids.shape
    R = hh.shape[-1]
    out = torch.empty(N, P, dtype=torch.long, device=hh.device)
    probs = torch.empty(N, P, K, dtype=torch.float32, device=hh.device)
    block_r = max(triton_next_pow2(R), 16)
    jit(_selector_sample_kernel)[(N,)](
        hh.contiguous(),
        cand_ids.contiguous(),
        unary.contiguous(),
        anchor.contiguous(),
        pred_codebook,
        succ_codebook,
        races.contiguous(),
        out,
        probs,
        1.0 / temperature,
        N,
        P,
        K,
        R,
        BLOCK_K=max(triton_next_pow2(K), 16),
        BLOCK_R=block_r,
        num_warps=4 if block_r >= 256 else 1,
        STAGES=stages,
    )
    return out, probs
