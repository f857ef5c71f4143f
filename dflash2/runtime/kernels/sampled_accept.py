"""The T>0 accept phase in two launches: rejection sampling and the step's bookkeeping (twin: tensor ops).

After a T>0 verify, row r holds the target's warped p (B, V) at its block positions, its P = B-1
drafts d and their q (sparse: k ids and probs per position, a point mass being k = 1; or dense
(P, V)), and the step's random draws, made beforehand in torch (:func:`~dflash2.runtime.sampling.
accept_noise`: the uniforms u (P,), then the exponential race (V,), the order and shapes the
unfused path draws them in, so a generator, also one registered with a CUDA graph, advances alike).
The accept is

    a     = drafts accepted while u_i · q_i(d_i) < p_i(d_i)          (accept with prob min(1, p/q))
    r     = max(0, p_a − q_a)                                       (q_a = 0 after a full accept: r = p_P)
    bonus = argmax_v r[v] / race[v]   if that max is > 0,  else  argmax_v p_a[v] / race[v]

then the greedy accept's bookkeeping (kernels/accept.py) on the emitted row d_1 .. d_a, bonus: the
emission ends at its first EOS or the budget; count, active, commit_n = (a + 1) · still, token, the
output row and the step log (was active, a · active, n) are written in place. A row that finishes
now commits nothing: it never decodes again, and a frozen row's length stays ≤ prompt + emitted − 1,
which is what the caches are sized for (a cut block commits more than it emits).

Why two launches: the bonus reads two vocabulary-long rows (p_a and the race), and one program per
row walking them in chunks of 2048 took 0.83 ms per step on the H200 at Qwen3-8B's V = 151,936
(block 16, batch 1; the greedy accept: ~8 µs): 75 chunks one after another, the loop's latency on
one SM. So the vocabulary is cut into C = ⌈V / CHUNK⌉ chunks (149 at that V, 8 at the small pair's
8192) and

* launch 1, one program per (row, chunk): the accepted count a (the walk over the P drafts is a few
  gathers, so every chunk makes it rather than wait for one that did; chunk 0 stores it), then the
  chunk's max and first argmax of r / race and of p_a / race, to (N, 2, C) partials;
* launch 2, one program per row: each race's max over its C partials and the smallest index holding
  it (a chunk's argmax is its first index and chunks ascend, so that is the global first-index
  argmax), the bonus, and the bookkeeping.

The residual never exists in memory. The partials are allocated per call with shapes fixed by
(N, V), as the other multi-launch kernels here do, so the accept stays capturable in a CUDA graph.

Why the bonus is argmax(r / race) and not, as ``rejection_accept_proposal`` does, argmax((r / Σr) /
race): with race ~ Exp(1) i.i.d., P(argmax_v w_v / race_v = x) = w_x / Σw for any w ≥ 0 (the
exponential race), so both are a draw from r / Σr: dividing every entry by one positive constant
cannot change the law. Bit for bit they may differ: the kernel's Σr (its own summation order)
rounds otherwise than torch's, and so can r_v / Σr, which can flip an argmax between two scores a
few ulps apart. Leaving r unnormalised removes the one reduction whose rounding the kernel cannot
match, so kernel and twin are the same elementwise fp32 operations (a subtraction, a max with 0,
an IEEE division — ``tl.div_rn``: Triton's ``/`` on fp32 is an approximate division on NVIDIA GPUs
— and a first-index argmax) and agree exactly; the twin equals the unfused path wherever the draw
is not such a near-tie (tests/test_runtime_sampled_accept_kernel.py), and the engine's chi-square
tests check the law (tests/test_runtime_sampling.py).

The fallback: the unfused path draws from p_a where Σr == 0 (p_a == q_a up to rounding, where a
rejection has probability 0). Here the test is max(r / race) > 0, a test the kernel makes without a
sum. Both agree unless every positive r_v / race_v underflows to zero (each r_v below half the
smallest fp32 subnormal, ~7e-46, times its race): Σr is then below ~4e-44 · V (a race of Exp(1)
exceeds 50 with probability e^-50), and the rejection that leads here had probability Σr.

Shapes: N rows, B = P+1 block positions, V vocabulary, C vocabulary chunks, k sparse candidates,
E EOS slots (-1 = none), W output columns (≥ count + B).
"""

from __future__ import annotations

import torch
import triton.language as tl

from dflash2.runtime.kernels import jit, use_triton
from dflash2.runtime.kernels.norm import triton_next_pow2
from dflash2.runtime.sampling import Proposal, accepted_prefix, residual, with_q

CHUNK = 1024  # vocabulary per chunk program: 149 programs per row at V = 151,936; 8 fp32 per thread at 4 warps
MAX_TILE = 8192  # a sparse q's membership test holds a (BLOCK_V, BLOCK_K) tile


def race_bonus(resid: torch.Tensor, p_a: torch.Tensor, race: torch.Tensor) -> torch.Tensor:
    """bonus (N,) long: argmax(resid / race), or argmax(p_a / race) where every resid / race is 0.
    resid, p_a, race (N, V) fp32 (see the module docstring for why resid is not normalised)."""
    score = resid / race
    return torch.where(score.amax(-1) > 0, score.argmax(-1), (p_a / race).argmax(-1))


def sampled_accept_ref(
    p, proposal: Proposal, u, race, eos, active, count, limit, out, commit_n, token, *, log=None, step=None
) -> None:
    """The twin, in place. p (N, B, V) fp32 warped target probabilities; proposal: drafts (N, P = B-1) long
    and their q (sparse ids / probs (N, P, k), dense (N, P, V), or none = point masses); u (N, P) fp32;
    race (N, V) fp32; eos (E,) long (-1 = none); active (N,) bool; count / limit / commit_n / token (N,) long;
    out (N, W ≥ count + B) long; log (S, 3, N) long and step (1,) long, or None (no log)."""
    proposal = with_q(proposal)
    drafts = proposal.tokens
    N, P = drafts.shape
    B = P + 1
    a = accepted_prefix(p, proposal, u)
    bonus = race_bonus(*residual(p, proposal, a), race)
    idx = torch.arange(B, device=drafts.device)
    # the emitted row d_1 .. d_a, bonus (then the next drafts, 0 at the end: rewritten by the next step)
    tokens = torch.where(idx == a[:, None], bonus[:, None], torch.cat([drafts, drafts.new_zeros(N, 1)], 1))
    is_eos = (tokens[..., None] == eos).any(-1) & (idx <= a[:, None])  # (N, B), emitted places only
    first = torch.where(is_eos, idx, B).amin(-1)  # the first EOS, B when there is none
    n = torch.minimum(first, a) + 1
    budget = limit - count
    fin = (first < B) | (budget <= n)
    n = torch.minimum(n, budget) * active
    still = active > fin  # active & ~fin
    out.scatter_(1, count[:, None] + idx, tokens)
    if log is not None:
        log.index_copy_(0, step, torch.stack([active.long(), a * active, n])[None])
    torch.mul(a + 1, still, out=commit_n)
    count.add_(n)
    active.copy_(still)
    torch.where(still, bonus, token, out=token)


def _race_chunk_kernel(
    p_ptr,
    dr_ptr,
    ids_ptr,
    probs_ptr,
    q_ptr,
    u_ptr,
    race_ptr,
    a_ptr,
    best_ptr,
    arg_ptr,
    P,
    K,
    V,
    C,
    BLOCK_B: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    DENSE: tl.constexpr,
):
    """Program (row r, chunk c): r's accepted count a (to a_ptr[r], from chunk 0), then the two races over
    vocabulary [c · BLOCK_V, (c+1) · BLOCK_V) ∩ [0, V): the chunk's max and first argmax of r / race and of
    p_a / race, to best / arg[r, 0 | 1, c] ((N, 2, C) fp32 / int32)."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    B = P + 1
    jj = tl.arange(0, BLOCK_B)
    kk = tl.arange(0, BLOCK_K)
    dm, km = jj < P, kk < K
    # ---- the accepted prefix: p_i(d_i), q_i(d_i), u_i at the P drafted positions (every chunk walks it:
    # P gathers beside the chunk's 2 · BLOCK_V reads, where a third launch, or chunks waiting on chunk 0,
    # would add a serial step)
    d = tl.load(dr_ptr + r * P + jj, mask=dm, other=0)
    px = tl.load(p_ptr + (r * B + jj) * V + d, mask=dm, other=0.0).to(tl.float32)
    if DENSE:
        qx = tl.load(q_ptr + (r * P + jj) * V + d, mask=dm, other=0.0).to(tl.float32)
    else:
        at_ij = (r * P + jj)[:, None] * K + kk[None, :]
        m2 = dm[:, None] & km[None, :]
        ids = tl.load(ids_ptr + at_ij, mask=m2, other=-1)
        pr = tl.load(probs_ptr + at_ij, mask=m2, other=0.0).to(tl.float32)
        qx = tl.sum(tl.where(ids == d[:, None], pr, 0.0), axis=1)  # one id matches: the value itself, exactly
    u = tl.load(u_ptr + r * P + jj, mask=dm, other=1.0)
    ok = (u * qx < px) & dm
    a = tl.min(tl.where(ok, BLOCK_B, jj), axis=0)  # the first rejection, P after a full accept
    tl.store(a_ptr + r, a, mask=c == 0)  # every chunk found the same a: one writes it for the finish
    # q_a exists (else the residual is p_P itself); a vector, as the interpreter makes a scalar & vector an int
    keep = (a + kk * 0) < P
    at = tl.maximum(tl.minimum(a, P - 1), 0).to(tl.int64)
    # ---- this chunk of the two exponential races, the residual's and p_a's (the fallback)
    v0 = c * BLOCK_V
    vv = v0 + tl.arange(0, BLOCK_V)
    vm = vv < V
    pv = tl.load(p_ptr + (r * B + a.to(tl.int64)) * V + vv, mask=vm, other=0.0).to(tl.float32)
    e = tl.load(race_ptr + r * V + vv, mask=vm, other=1.0)
    if DENSE:
        qm = vm & ((a + vv * 0) < P)
        qv = tl.load(q_ptr + (r * P + at) * V + vv, mask=qm, other=0.0).to(tl.float32)
    else:  # q_a at this chunk: probs at the ids that fall here, 0 elsewhere (p − 0 = p)
        ids_a = tl.load(ids_ptr + (r * P + at) * K + kk, mask=km & keep, other=-1)
        pr_a = tl.load(probs_ptr + (r * P + at) * K + kk, mask=km & keep, other=0.0).to(tl.float32)
        qv = tl.sum(tl.where(vv[:, None] == ids_a[None, :], pr_a[None, :], 0.0), axis=1)
    # every score is ≥ 0; the padding's -1 never wins (a chunk holds ≥ 1 vocabulary entry)
    s_r = tl.where(vm, tl.div_rn(tl.maximum(pv - qv, 0.0), e), -1.0)
    s_p = tl.where(vm, tl.div_rn(pv, e), -1.0)
    out = r * 2 * C + c
    tl.store(best_ptr + out, tl.max(s_r, axis=0))
    tl.store(arg_ptr + out, tl.argmax(s_r, axis=0, tie_break_left=True) + v0)
    tl.store(best_ptr + out + C, tl.max(s_p, axis=0))
    tl.store(arg_ptr + out + C, tl.argmax(s_p, axis=0, tie_break_left=True) + v0)


def _sampled_accept_finish_kernel(
    dr_ptr,
    a_ptr,
    best_ptr,
    arg_ptr,
    eos_ptr,
    active_ptr,
    count_ptr,
    limit_ptr,
    out_ptr,
    commit_ptr,
    token_ptr,
    log_ptr,
    step_ptr,
    N,
    P,
    V,
    C,
    E,
    W,
    BLOCK_B: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_E: tl.constexpr,
    LOG: tl.constexpr,
):
    """Program r: the bonus from row r's chunk partials, then the greedy accept's bookkeeping."""
    r = tl.program_id(0).to(tl.int64)
    B = P + 1
    jj = tl.arange(0, BLOCK_B)
    a = tl.load(a_ptr + r)
    # ---- the bonus: each race's max over the chunks, and the smallest index holding it (chunk argmaxes
    # are first indices, so this is the global first-index argmax: torch.argmax's rule)
    cc = tl.arange(0, BLOCK_C)
    cm = cc < C
    at = r * 2 * C + cc
    best_r = tl.load(best_ptr + at, mask=cm, other=-1.0)
    best_p = tl.load(best_ptr + at + C, mask=cm, other=-1.0)
    top_r = tl.max(best_r, axis=0)
    top_p = tl.max(best_p, axis=0)
    arg_r = tl.min(tl.where(cm & (best_r == top_r), tl.load(arg_ptr + at, mask=cm, other=0), V), axis=0)
    arg_p = tl.min(tl.where(cm & (best_p == top_p), tl.load(arg_ptr + at + C, mask=cm, other=0), V), axis=0)
    bonus = tl.where(top_r > 0, arg_r, arg_p).to(tl.int64)
    # ---- the bookkeeping (kernels/accept.py's, on the row d_1 .. d_a, bonus)
    d = tl.load(dr_ptr + r * P + jj, mask=jj < P, other=0)
    tok = tl.where(jj == a, bonus, d)
    ee = tl.arange(0, BLOCK_E)
    eos = tl.load(eos_ptr + ee, mask=ee < E, other=0)
    hits = (tok[:, None] == eos[None, :]) & (ee < E)[None, :]
    is_eos = (tl.sum(hits.to(tl.int32), axis=1) > 0) & (jj <= a)
    first = tl.min(tl.where(is_eos, jj, BLOCK_B), axis=0)  # the first emitted EOS, BLOCK_B when none
    act = tl.load(active_ptr + r) != 0
    count = tl.load(count_ptr + r)
    budget = tl.load(limit_ptr + r) - count
    n = (tl.minimum(first, a) + 1).to(tl.int64)
    fin = (first <= a) | (budget <= n)
    n = tl.where(act, tl.minimum(n, budget), 0)
    still = act & (fin == 0)
    tl.store(out_ptr + r * W + count + jj, tok, mask=jj < B)
    a = a.to(tl.int64)
    if LOG:
        log_at = log_ptr + tl.load(step_ptr) * 3 * N + r
        tl.store(log_at, act.to(tl.int64))
        tl.store(log_at + N, tl.where(act, a, 0))
        tl.store(log_at + 2 * N, n)
    tl.store(commit_ptr + r, tl.where(still, a + 1, 0))
    tl.store(count_ptr + r, count + n)
    tl.store(active_ptr + r, still)
    tl.store(token_ptr + r, tl.where(still, bonus, tl.load(token_ptr + r)))


def sampled_accept(
    p,
    proposal: Proposal,
    u,
    race,
    eos,
    active,
    count,
    limit,
    out,
    commit_n,
    token,
    *,
    log=None,
    step=None,
    block_v=None,
) -> None:
    """The T>0 accept in place (see the module docstring): the two Triton launches on CUDA (and in
    ``on_cpu()``), else the twin. Arguments: see :func:`sampled_accept_ref`; block_v: the vocabulary
    chunk of a program (tests; by default :data:`CHUNK`, less for a wide sparse q)."""
    proposal = with_q(proposal)
    drafts, dense = proposal.tokens, proposal.dense
    q = [dense] if dense is not None else [proposal.ids, proposal.probs]
    tensors = [p, drafts, *q, u, race, eos, active, count, limit, out, commit_n, token]
    tensors += [log, step] if log is not None else []
    fits = (
        all(t.is_contiguous() for t in tensors)
        and drafts.dtype == out.dtype == torch.long
        and u.dtype == race.dtype == torch.float32
        and (dense is not None or proposal.ids.dtype == torch.long)
    )
    if not use_triton(p) or not fits:
        return sampled_accept_ref(
            p, proposal, u, race, eos, active, count, limit, out, commit_n, token, log=log, step=step
        )  # fmt: skip
    N, B, V = p.shape
    K = 1 if dense is not None else proposal.ids.shape[-1]
    block_k = max(triton_next_pow2(K), 2)
    if block_v is None:
        block_v = min(triton_next_pow2(V), CHUNK, CHUNK if dense is not None else MAX_TILE // block_k)
    block_v = max(triton_next_pow2(block_v), 16)
    C = -(-V // block_v)
    block_b = max(triton_next_pow2(B), 2)
    # the chunks' partials: fixed shapes per (N, V), so a captured graph allocates them from its pool once
    a = torch.empty(N, dtype=torch.int32, device=p.device)
    best = torch.empty(N, 2, C, dtype=torch.float32, device=p.device)
    arg = torch.empty(N, 2, C, dtype=torch.int32, device=p.device)
    jit(_race_chunk_kernel)[(N, C)](
        p,
        drafts,
        proposal.ids if dense is None else drafts,
        proposal.probs if dense is None else u,
        dense if dense is not None else p,
        u,
        race,
        a,
        best,
        arg,
        B - 1,
        K,
        V,
        C,
        BLOCK_B=block_b,
        BLOCK_K=block_k,
        BLOCK_V=block_v,
        DENSE=dense is not None,
        num_warps=4,
    )
    block_c = max(triton_next_pow2(C), 2)
    jit(_sampled_accept_finish_kernel, do_not_specialize=("N", "W"))[(N,)](
        drafts,
        a,
        best,
        arg,
        eos,
        active,
        count,
        limit,
        out,
        commit_n,
        token,
        log if log is not None else count,
        step if step is not None else count,
        N,
        B - 1,
        V,
        C,
        eos.numel(),
        out.shape[1],
        BLOCK_B=block_b,
        BLOCK_C=block_c,
        BLOCK_E=max(triton_next_pow2(eos.numel()), 2),
        LOG=log is not None,
        num_warps=1 if block_c <= 256 else 4,
    )
