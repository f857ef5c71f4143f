"""The DFlash2 selector's greedy walk over one block in two launches (twin: the walk's eager ops).

The walk is sequential (each position's scores need the token chosen before it) and tiny: per
position, the chosen predecessor's codebook row times the position's hidden projection, its dot
with the k candidates' successor rows, the unary scores added, the argmax. Eagerly that is about
six launches per position. The expensive part does not need the choice, though: the pair term of
position pos from predecessor j (candidate j of position pos-1; the anchor at pos 0) to candidate c,

    pair[pos, j, c] = round(Σ_r round(P[prev[pos, j], r] · hh[pos, r]) · S[cand[pos, c], r])

(``pred * hh`` in the codebooks' dtype, the einsum's bmm with fp32 accumulation and its output
rounding) is the same whichever j the walk will take. So:

1. the pair tables (N, P, k, k) fp32, one program per (row, position), all positions at once: a
   (k × r) · (r × k) product of the k predecessors' rows times hh and the k candidates' successor
   rows (:func:`selector_pair_table`; position 0's table has the anchor in every row j);
2. the walk, one program per row: every position's table, unary scores and candidate ids are
   loaded up front (no load waits for a choice), the scores unary + pair of every (position, j)
   added up front too, and a position of the chain is only the select of row ``choice`` of its
   scores and their argmax (ties: the first, the higher drafter logit). The tokens are the
   candidate ids at the choices, gathered after the walk.

Before, one program walked the positions and each paid, in sequence, its loads (the hh row, the
candidate ids, their gathered codebook rows), a (k × r) multiply-reduce, the argmax and the row
select of the next predecessor. The tables cost k times the pair arithmetic of the walk (every
predecessor, not only the chosen one: k · k · r products a position, in parallel over positions
and rows). They are a temporary (N, P, k, k) fp32 the launcher allocates (``torch.empty``, so it
fits a captured CUDA graph); the walk holds a row's P · k · k of them in registers.

Inputs as the selector path computes them: hh (N, P, r) = hidden_projection(hidden) (on the
kernel path one GEMM over all positions), cand_ids (N, P, k) long and unary (N, P, k) fp32 from
``CandidateSelector.candidates``, anchor (N,) long, the predecessor / successor codebooks (V, r).
Returns tokens (N, P) long. The dot sums in Triton's order, so a score may differ from the
twin's in its last bit (fp32) or by one rounding of pair (bf16): a near-tie may then choose the
other candidate. The drafts are proposals; the verify keeps decoding lossless whatever they are.

Time: the single-launch walk this replaces (its loads pipelined 3 positions deep) took 17 µs on an
H200 for P = 7, k = 16, r = 256 at batch 1 (9% of the drafter's draft phase); the two launches here
are not measured yet.
"""

import torch
import triton
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


def selector_pair_table_ref(hh, cand_ids, anchor, pred_codebook, succ_codebook) -> torch.Tensor:
    """The pair tables (N, P, k, k) fp32 in the twin's own arithmetic: entry [n, pos, j, c] is the pair term
    :func:`selector_walk_ref` adds to candidate c of position pos when candidate j of position pos-1 (at pos 0:
    the anchor, in every row j) was chosen, i.e. its ``pred * hh`` and einsum, for each j in turn."""
    N, _, k = cand_ids.shape
    prev = torch.cat([anchor[:, None, None].expand(N, 1, k), cand_ids[:, :-1]], dim=1)  # (N, P, k)
    succ = succ_codebook[cand_ids]  # (N, P, k, r)
    rows = [torch.einsum("npr,npkr->npk", pred_codebook[prev[:, :, j]] * hh, succ) for j in range(k)]
    return torch.stack(rows, dim=2).float()


def _selector_pair_kernel(
    hh_ptr,
    cand_ptr,
    anchor_ptr,
    pcb_ptr,
    scb_ptr,
    pair_ptr,
    P,
    K,
    R,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """One (row n, position pos): its k × k pair table (module docstring, step 1)."""
    n = tl.program_id(0).to(tl.int64)
    pos = tl.program_id(1)
    dt = pcb_ptr.dtype.element_ty
    kk = tl.arange(0, BLOCK_K)
    rr = tl.arange(0, BLOCK_R)
    km, rm = kk < K, rr < R
    row = n * P + pos
    h = tl.load(hh_ptr + row * R + rr, mask=rm, other=0.0).to(tl.float32)
    ids = tl.load(cand_ptr + row * K + kk, mask=km, other=0)
    # the predecessors: position pos-1's candidates; at pos 0 the anchor in every row (the walk starts at row 0,
    # the others are equal); pos 0 reads its own row's ids instead of the previous row's, then drops them
    first = pos == 0
    prev = tl.load(cand_ptr + (row - 1 + first.to(tl.int64)) * K + kk, mask=km, other=0)
    prev = tl.where(first, tl.load(anchor_ptr + n), prev)
    rows_m = km[:, None] & rm[None, :]  # padded lanes load 0: padded j rows / c columns of the product are 0
    pred = tl.load(pcb_ptr + prev[:, None] * R + rr[None, :], mask=rows_m, other=0.0).to(tl.float32)
    succ = tl.load(scb_ptr + ids[:, None] * R + rr[None, :], mask=rows_m, other=0.0).to(tl.float32)
    ph = (pred * h[None, :]).to(dt).to(tl.float32)  # pred * hh per predecessor, rounded as the eager product
    # (k × r) · (r × k) in fp32 ("ieee": no TF32 rounding of the operands), then the bmm's output rounding
    pair = tl.dot(ph, tl.trans(succ), input_precision="ieee").to(dt).to(tl.float32)
    tl.store(pair_ptr + (row * K + kk[:, None]) * K + kk[None, :], pair, mask=km[:, None] & km[None, :])


def operands_fit(hh, pred_codebook, succ_codebook) -> bool:
    """Whether the kernels take these operands (else the twins run)."""
    return (
        hh.dtype == pred_codebook.dtype == succ_codebook.dtype
        and pred_codebook.is_contiguous()
        and succ_codebook.is_contiguous()
    )


def selector_pair_table(hh, cand_ids, anchor, pred_codebook, succ_codebook) -> torch.Tensor:
    """The pair tables (N, P, k, k) fp32 of :func:`selector_pair_table_ref`: one launch of (N, P) programs where
    the kernels run (shared by both walks: this one and kernels/selector_sample.py's), else the twin."""
    if not use_triton(hh) or not operands_fit(hh, pred_codebook, succ_codebook):
        return selector_pair_table_ref(hh, cand_ids, anchor, pred_codebook, succ_codebook)
    N, P, K = cand_ids.shape
    R = hh.shape[-1]
    pair = torch.empty(N, P, K, K, dtype=torch.float32, device=hh.device)
    block_r = max(triton_next_pow2(R), 16)  # ≥ 16: tl.dot's smallest tile
    jit(_selector_pair_kernel)[(N, P)](
        hh.contiguous(),
        cand_ids.contiguous(),
        anchor.contiguous(),
        pred_codebook,
        succ_codebook,
        pair,
        P,
        K,
        R,
        BLOCK_K=max(triton_next_pow2(K), 16),
        BLOCK_R=block_r,
        num_warps=4 if block_r >= 256 else 1,
    )
    return pair


def walk_blocks(P: int, K: int) -> dict:
    """The walk kernels' tiles: BLOCK_P positions (≥ 2, so no tensor has a dimension of 1), BLOCK_K candidates
    (≥ 16), and warps for their (BLOCK_P · BLOCK_K) × BLOCK_K tiles held through the walk: at P 15, k 16 one
    is 16 × 16 × 16 fp32, 32 a thread with 4 warps (the greedy walk holds one, its scores; the sampled two,
    its probs and race ratios)."""
    bp, bk = max(triton_next_pow2(P), 2), max(triton_next_pow2(K), 16)
    # the (BLOCK_P · BLOCK_K, BLOCK_K) fp32 tiles at ≤ ~64 values per thread (k ≤ 16 at P 15: 4 warps)
    return dict(BLOCK_P=bp, BLOCK_K=bk, num_warps=min(16, max(4, bp * bk * bk // 1024)))


@triton.jit
def _edge_tiles(pair_ptr, unary_ptr, n, P, K, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr):
    """Row n's pair tables and unary scores as (BLOCK_P · BLOCK_K, BLOCK_K) tiles, shared by both walks: every
    (position, predecessor j) pair one row, tt = pos · BLOCK_K + j (no 3-D tensors); a position's unary scores
    once per row j of its table (the same k values: cache hits, no reshape of tiles). Padded lanes load 0.
    Returns (kk, km, tt, tp, tile_m, pair, unary)."""
    kk = tl.arange(0, BLOCK_K)
    km = kk < K
    tt = tl.arange(0, BLOCK_P * BLOCK_K)
    tp, tj = tt // BLOCK_K, tt % BLOCK_K
    tile_m = ((tp < P) & (tj < K))[:, None] & km[None, :]
    pair = tl.load(pair_ptr + ((n * P + tp[:, None]) * K + tj[:, None]) * K + kk[None, :], mask=tile_m, other=0.0)
    unary = tl.load(unary_ptr + (n * P + tp[:, None]) * K + kk[None, :], mask=tile_m, other=0.0)
    return kk, km, tt, tp, tile_m, pair, unary


def _selector_walk_kernel(
    pair_ptr,
    cand_ptr,
    unary_ptr,
    out_ptr,
    P,
    K,
    BLOCK_P: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One row: the greedy walk over its pair tables (module docstring, step 2)."""
    n = tl.program_id(0).to(tl.int64)
    kk, km, tt, _tp, _mask, pair, unary = _edge_tiles(pair_ptr, unary_ptr, n, P, K, BLOCK_P, BLOCK_K)
    # the scores of every edge, before the walk: the chain below only selects a row and takes its argmax
    score = unary + pair
    # a NaN score as +inf: torch.argmax takes a NaN as the largest, and a NaN must not lose to a padded lane
    score = tl.where(km[None, :], tl.where(score != score, float("inf"), score), float("-inf"))
    pp = tl.arange(0, BLOCK_P)
    choices = tl.zeros([BLOCK_P], dtype=tl.int32)
    choice = tl.zeros([], dtype=tl.int32)  # position 0's table has the anchor in every row: take row 0
    for pos in range(P):
        # row `choice` of position pos's scores (a max of that row and -inf fill: the row itself)
        row = tl.max(tl.where((tt == pos * BLOCK_K + choice)[:, None], score, float("-inf")), axis=0)
        choice = tl.argmax(row, axis=0, tie_break_left=True)
        choices = tl.where(pp == pos, choice, choices)
    # the tokens: each position's candidate id at its choice (off the chain, after it)
    pk = (pp < P)[:, None] & km[None, :]
    ids = tl.load(cand_ptr + (n * P + pp[:, None]) * K + kk[None, :], mask=pk, other=0)
    tokens = tl.sum(tl.where(kk[None, :] == choices[:, None], ids, 0), axis=1)
    tl.store(out_ptr + n * P + pp, tokens, mask=pp < P)


def selector_walk(hh, cand_ids, unary, anchor, pred_codebook, succ_codebook) -> torch.Tensor:
    """tokens (N, P) long: the greedy walk; the Triton kernels on CUDA (and in ``on_cpu()``: the pair tables,
    then the walk), else the twin."""
    if not use_triton(hh) or not operands_fit(hh, pred_codebook, succ_codebook) or unary.dtype != torch.float32:
        return selector_walk_ref(hh, cand_ids, unary, anchor, pred_codebook, succ_codebook)
    N, P, K = cand_ids.shape
    pair = selector_pair_table(hh, cand_ids, anchor, pred_codebook, succ_codebook)
    out = torch.empty(N, P, dtype=torch.long, device=hh.device)
    jit(_selector_walk_kernel)[(N,)](pair, cand_ids.contiguous(), unary.contiguous(), out, P, K, **walk_blocks(P, K))
    return out
