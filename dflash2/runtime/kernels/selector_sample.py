"""The DFlash2 selector's T>0 walk over one block in two launches (twin: the sampled walk's eager ops).

At T>0 the selector samples position by position from softmax(edge scores / T) over its k
candidates, given the *sampled* predecessor (``CandidateSelector.sample_path``; selector_path.py's
``selector_sample_sparse`` keeps q sparse). Eagerly a position is about ten launches (its hidden
projection, the pair term's product and bmm, the add, the scale, the softmax, the race draw, the
divide, the argmax, the predecessor gather). Here, as kernels/selector.py's greedy walk does, the
pair tables (N, P, k, k) fp32 of every position and every predecessor candidate come first, from the
same launch (``selector_pair_table``: the same scores, rounded the same way), then one program per
row walks all P positions. What a position's draw needs but its predecessor does not decide is made
before the walk, for every (position, predecessor j) row of the tables at once:

    x    = (unary + pair) · (1 / T)                 (fp32; torch scales by a CPU scalar so on CUDA)
    prob = exp(x − max x) / Σ exp(x − max x)        (the softmax over the k candidates)
    pick = argmax(prob / race[pos])                 (the exponential race: a draw from prob)

so the chain of a position is only the select of row ``choice`` (the previous pick) and the argmax
of its prob / race; the walk writes that row's prob (the q of that position, on the k candidate ids)
and, after the walk, the picked tokens. Making the softmax of all k rows costs k times the exps of
one (16 × 16 per position at the drafter's k = 16), off the chain. The races (P, N, k) fp32 are drawn
before the launches in torch, P draws of (N, k) in the order the eager walk draws them, so the
generator advances alike (also one registered with a CUDA graph).

Why the rounding does not matter for losslessness: the kernel draws from the prob it returns as q,
so the proposal's q is exactly the distribution its draft was drawn from, which is all rejection
sampling needs. Against the twin the scores differ as in the greedy walk (dot order), and exp and
the softmax's sum are Triton's, so probs agree to a few ulps and a near-tie of prob / race may pick
the other candidate (then the walks diverge: another, equally valid, proposal).

Time: these two launches are not measured yet (the greedy walk's figure before the tables:
kernels/selector.py's docstring).

Shapes: N rows, P positions, k candidates, r selector rank, V vocabulary.
"""

import torch
import torch.nn.functional as F
import triton.language as tl

from dflash2.runtime.kernels import jit, use_triton
from dflash2.runtime.kernels.selector import _edge_tiles, operands_fit, selector_pair_table, walk_blocks


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
    pair_ptr,
    cand_ptr,
    unary_ptr,
    race_ptr,
    out_ptr,
    probs_ptr,
    inv_t,
    N,
    P,
    K,
    BLOCK_P: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One row: the sampled walk over its pair tables (kernels/selector.py's ``selector_pair_table``)."""
    n = tl.program_id(0).to(tl.int64)
    # the greedy walk's tiles (kernels/selector.py _edge_tiles), plus this row's races in the same layout
    kk, km, tt, tp, tile_m, pair, unary = _edge_tiles(pair_ptr, unary_ptr, n, P, K, BLOCK_P, BLOCK_K)
    race = tl.load(race_ptr + (tp[:, None] * N + n) * K + kk[None, :], mask=tile_m, other=1.0)
    # the softmax of every (position, j) row and its race ratios, before the walk (padded rows: all-zero scores,
    # a finite uniform softmax never read): the chain below only selects a row and takes its argmax
    x = tl.where(km[None, :], (unary + pair) * inv_t, float("-inf"))
    e = tl.exp(x - tl.max(x, axis=1)[:, None])  # 0 on the padding lanes
    prob = tl.div_rn(e, tl.sum(e, axis=1)[:, None])
    ratio = tl.div_rn(prob, race)  # argmax: the exponential race's draw from prob
    # a NaN ratio as +inf (torch.argmax takes a NaN as the largest; a padded lane must never win)
    ratio = tl.where(km[None, :], tl.where(ratio != ratio, float("inf"), ratio), -1.0)
    pp = tl.arange(0, BLOCK_P)
    choices = tl.zeros([BLOCK_P], dtype=tl.int32)
    choice = tl.zeros([], dtype=tl.int32)  # position 0's table has the anchor in every row: take row 0
    for pos in range(P):
        at = (tt == pos * BLOCK_K + choice)[:, None]
        # the row's q (a sum with one term: the value itself; probs are ≥ 0, never -0.0), stored off the chain
        tl.store(probs_ptr + (n * P + pos) * K + kk, tl.sum(tl.where(at, prob, 0.0), axis=0), mask=km)
        choice = tl.argmax(tl.max(tl.where(at, ratio, -1.0), axis=0), axis=0, tie_break_left=True)
        choices = tl.where(pp == pos, choice, choices)
    # the tokens: each position's candidate id at its choice (off the chain, after it)
    pk = (pp < P)[:, None] & km[None, :]
    ids = tl.load(cand_ptr + (n * P + pp[:, None]) * K + kk[None, :], mask=pk, other=0)
    tokens = tl.sum(tl.where(kk[None, :] == choices[:, None], ids, 0), axis=1)
    tl.store(out_ptr + n * P + pp, tokens, mask=pp < P)


def selector_sample_walk(hh, cand_ids, unary, anchor, pred_codebook, succ_codebook, temperature, races):
    """tokens (N, P) long, probs (N, P, k) fp32: the sampled walk; the Triton kernels on CUDA (and in
    ``on_cpu()``: the greedy walk's pair tables, then this walk), else the twin. Arguments: see
    :func:`selector_sample_walk_ref`."""
    fits = operands_fit(hh, pred_codebook, succ_codebook) and unary.dtype == races.dtype == torch.float32
    if not use_triton(hh) or not fits:
        return selector_sample_walk_ref(hh, cand_ids, unary, anchor, pred_codebook, succ_codebook, temperature, races)
    N, P, K = cand_ids.shape
    pair = selector_pair_table(hh, cand_ids, anchor, pred_codebook, succ_codebook)
    out = torch.empty(N, P, dtype=torch.long, device=hh.device)
    probs = torch.empty(N, P, K, dtype=torch.float32, device=hh.device)
    jit(_selector_sample_kernel)[(N,)](
        pair,
        cand_ids.contiguous(),
        unary.contiguous(),
        races.contiguous(),
        out,
        probs,
        # 1 / T as torch scales on CUDA: fp32(T), then its fp32 reciprocal (not a double's, rounded)
        float(torch.tensor(temperature, dtype=torch.float32).reciprocal()),
        N,
        P,
        K,
        **walk_blocks(P, K),
    )
    return out, probs
