"""The T=0 accept phase's bookkeeping in one launch (twin: the same in a dozen-odd tensor ops).

After the verify, row r of a greedy step holds the target's argmax at each block position,
``argmax[r]`` (B,), and its drafts ``drafts[r]`` (P = B-1; an AR step has P = 0 and its argmax is
the token it chose). Everything the accept phase does from there is integer bookkeeping:

    a      = longest prefix of drafts equal to argmax            (accepted drafts)
    L      = longest prefix of drafts equal to argmax and not EOS (≤ a; the last emitted index)
    n      = min(L + 1, budget) · active                          (emitted: d_1 .. d_a, bonus = argmax)
    fin    = EOS at L  or  budget ≤ L + 1  or  not active         (the row finishes now)
    commit = (a + 1) · (active before | after the step)           (AR commits a finishing row's token)

and it writes argmax[r] into out[r, count[r]:count[r]+B] (the accepted drafts equal the argmaxes,
the bonus is argmax[a]; columns past count + n are rewritten by the next step), adds n to count,
clears active on finish, sets token to the bonus for rows still active, and (speculative steps)
logs (was active, a · active, n) in ``log[step]``. This is exactly what
``step.accept_greedy`` + ``finish_step`` + ``emit`` and the engine's accept give (tests compare
them), in place on the slot's buffers, with no host read. The caller advances ``step``.

The kernel runs one program per row; everything is integer, so it equals the twin exactly.
"""

from __future__ import annotations

import torch
import triton.language as tl

from dflash2.runtime.kernels import jit, use_triton
from dflash2.runtime.kernels.norm import triton_next_pow2


def greedy_accept_ref(
    argmax, drafts, eos, active, count, limit, out, commit_n, token, *, commit_finishing=False, log=None, step=None
):
    """The twin, in place. argmax (N, B) long; drafts (N, B-1) long; eos (E,) long (-1 = none); active (N,)
    bool; count / limit / commit_n / token (N,) long; out (N, W ≥ count + B) long; log (S, 3, N) long and
    step (1,) long, or None (no log). commit_finishing: rows that finish this step still commit (AR)."""
    B = argmax.shape[1]
    budget = limit - count
    is_eos = (argmax[..., None] == eos).any(-1)  # (N, B)
    if B == 1:  # an AR step: a = L = 0, the bonus is the chosen token
        a, bonus, fin_eos, n = None, argmax[:, 0], is_eos[:, 0], budget.clamp(max=1)
        fin = fin_eos | (budget <= 1)
    else:
        match = drafts == argmax[:, :-1]  # (N, P)
        # both prefixes in one cumprod: matches, and matches that are not EOS (m > e is m & ~e)
        a, last = torch.stack([match, match > is_eos[:, :-1]], dim=1).cumprod(-1).sum(-1).unbind(1)
        bonus = argmax.gather(1, a[:, None])[:, 0]
        fin_eos = is_eos.gather(1, last[:, None])[:, 0]
        n = last + 1
        fin = fin_eos | (budget <= n)
        n = torch.minimum(n, budget)
    n = n * active
    still = active > fin  # active & ~fin
    cols = count[:, None] if B == 1 else count[:, None] + torch.arange(B, device=count.device)
    out.scatter_(1, cols, argmax)
    if log is not None:
        a_log = torch.zeros_like(n) if a is None else a * active
        log.index_copy_(0, step, torch.stack([active, a_log, n])[None])
    if a is None:
        commit_n.copy_(active if commit_finishing else still)
    else:
        torch.mul(a + 1, active if commit_finishing else still, out=commit_n)
    count.add_(n)
    active.copy_(still)
    torch.where(still, bonus, token, out=token)


def _greedy_accept_kernel(
    am_ptr,
    dr_ptr,
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
    B,
    E,
    W,
    BLOCK_B: tl.constexpr,
    BLOCK_E: tl.constexpr,
    COMMIT_FINISHING: tl.constexpr,
    LOG: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    P = B - 1
    jj = tl.arange(0, BLOCK_B)
    ee = tl.arange(0, BLOCK_E)
    in_b = jj < B
    am = tl.load(am_ptr + r * B + jj, mask=in_b, other=0)
    dr = tl.load(dr_ptr + r * P + jj, mask=jj < P, other=0)
    eos = tl.load(eos_ptr + ee, mask=ee < E, other=0)
    hits = (am[:, None] == eos[None, :]) & in_b[:, None] & (ee < E)[None, :]
    is_eos = tl.sum(hits.to(tl.int32), axis=1) > 0  # (BLOCK_B,)
    match = (dr == am) & (jj < P)
    a = tl.min(tl.where(match, BLOCK_B, jj), axis=0)  # first mismatch (P when every draft matches)
    last = tl.min(tl.where(match & (is_eos == 0), BLOCK_B, jj), axis=0)
    bonus = tl.sum(tl.where(jj == a, am, 0), axis=0)
    fin_eos = tl.sum(tl.where((jj == last) & is_eos, 1, 0), axis=0) > 0
    act = tl.load(active_ptr + r) != 0
    count = tl.load(count_ptr + r)
    budget = tl.load(limit_ptr + r) - count
    n = (last + 1).to(tl.int64)
    fin = fin_eos | (budget <= n)
    n = tl.where(act, tl.minimum(n, budget), 0)
    still = act & (fin == 0)
    tl.store(out_ptr + r * W + count + jj, am, mask=in_b)
    a = a.to(tl.int64)
    if LOG:
        at = log_ptr + tl.load(step_ptr) * 3 * N + r
        tl.store(at, act.to(tl.int64))
        tl.store(at + N, tl.where(act, a, 0))
        tl.store(at + 2 * N, n)
    if COMMIT_FINISHING:
        tl.store(commit_ptr + r, tl.where(act, a + 1, 0))
    else:
        tl.store(commit_ptr + r, tl.where(still, a + 1, 0))
    tl.store(count_ptr + r, count + n)
    tl.store(active_ptr + r, still)
    tl.store(token_ptr + r, tl.where(still, bonus, tl.load(token_ptr + r)))


def greedy_accept(
    argmax, drafts, eos, active, count, limit, out, commit_n, token, *, commit_finishing=False, log=None, step=None
) -> None:
    """The T=0 accept in place (see the module docstring): the Triton kernel on CUDA (and in ``on_cpu()``),
    else the twin. Arguments: see :func:`greedy_accept_ref`."""
    N, B = argmax.shape
    tensors = [argmax, drafts, eos, active, count, limit, out, commit_n, token]
    tensors += [log, step] if log is not None else []
    fits = all(t.is_contiguous() for t in tensors) and argmax.dtype == drafts.dtype == out.dtype == torch.long
    if not use_triton(argmax) or not fits:
        return greedy_accept_ref(
            argmax, drafts, eos, active, count, limit, out, commit_n, token,
            commit_finishing=commit_finishing, log=log, step=step,
        )  # fmt: skip
    jit(_greedy_accept_kernel, do_not_specialize=("N", "W"))[(N,)](
        argmax,
        drafts,
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
        B,
        eos.numel(),
        out.shape[1],
        BLOCK_B=max(triton_next_pow2(B), 2),
        BLOCK_E=max(triton_next_pow2(eos.numel()), 2),
        COMMIT_FINISHING=bool(commit_finishing),
        LOG=log is not None,
        num_warps=1,
    )
