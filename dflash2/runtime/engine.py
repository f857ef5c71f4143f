"""The runtime's decoding loops: plain AR decode and lossless speculative decode (docs/ARCHITECTURE.md §4, §6).

Both take a batch of N prompts of any lengths and run every row in the same tensors:

    prefill      one forward of the right-padded prompts; row r commits its own length
    per step     [draft]  verify  accept  commit  emit          (step.py, drafter.py)

Rows are ragged throughout: lengths live on the device, each row advances by its own
accepted count inside the same step (KV: a length update; GDN: replay of n[r] tokens;
drafter context: the taps of those positions), and rows that finished (EOS or their
token budget) keep taking part in the fixed-shape forwards but commit and emit
nothing, so they never stall the others. The step has no loop over rows and reads
one small tensor back per step (whether any row is active, and the longest row,
which bounds how much of the caches attention reads).

Results: :func:`generate_ar` returns the token lists; :func:`generate_spec` returns a
``dflash2.decoding.SpecResult`` with the reference decoder's per-step bookkeeping.

Shapes: N rows, P_max longest prompt, B block size, V vocabulary, W output width.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from dflash2.decoding.decoder import SpecResult
from dflash2.decoding.sampling import SamplingParams, warp_probs
from dflash2.errors import DFlash2Error
from dflash2.runtime.drafter import RuntimeDrafter
from dflash2.runtime.step import (
    accept_greedy,
    accept_sampled,
    choose,
    commit,
    emit,
    eos_ids,
    finish_step,
    prefill,
    verify,
)

KV_BUCKET = 64  # attention reads the caches up to the longest row rounded up to this (fewer distinct shapes)


def pad_prompts(prompts, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, P) tensor or N id lists -> right-padded ids (N, P_max) long and lengths (N,) long, on ``device``."""
    if isinstance(prompts, torch.Tensor):
        rows = [r.tolist() for r in (prompts[None] if prompts.dim() == 1 else prompts)]
    else:
        rows = [[int(t) for t in r] for r in prompts]
    if not rows:
        raise DFlash2Error("no prompts to decode; pass at least one prompt")
    if any(not r for r in rows):
        raise DFlash2Error("a prompt is empty; every prompt needs at least one token")
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.long)
    return ids.to(device), torch.tensor([len(r) for r in rows], dtype=torch.long, device=device)


def _kv_len(longest: int, T: int, max_len: int) -> int:
    """Cache positions a T-token step must attend: longest committed row + T, rounded up to a bucket."""
    return min(max_len, -(-(longest + T) // KV_BUCKET) * KV_BUCKET)


def _max_len(state) -> int:
    """Positions a DecodeState holds (its KV cache's S_max; unbounded for a target without attention)."""
    return state.kv.max_len if state.kv is not None else 1 << 62


def _poll(active: torch.Tensor, lengths: torch.Tensor) -> tuple[bool, int]:
    """The step's one host read: (any row active, longest committed row)."""
    any_active, longest = torch.stack([active.any().long(), lengths.max()]).tolist()
    return bool(any_active), int(longest)


def _start(model, prompts, max_new_tokens: int, eos_token_id, extra: int):
    """Checks, padded prompts, state sized for prompt + new tokens + ``extra``, and the output buffers."""
    if max_new_tokens < 0:
        raise DFlash2Error(f"max_new_tokens={max_new_tokens} must be >= 0")
    device = model.embed.weight.device
    ids, lengths = pad_prompts(prompts, device)
    N, max_len = ids.shape[0], ids.shape[1] + max_new_tokens + extra
    out = torch.zeros(N, max_new_tokens + extra + 1, dtype=torch.long, device=device)  # W ≥ count + T always
    return ids, lengths, model.new_state(N, max_len), out, eos_ids(eos_token_id, device)


def _first_token(logits, out, max_new_tokens, params, generator, eos):
    """The prefill's token (N,) -> (anchor, count (N,), active (N,)): it is emitted, then decoding goes on."""
    token = choose(logits, params, generator)  # (N,)
    count = emit(out, torch.zeros_like(token), token[:, None], torch.ones_like(token))
    done = count >= max_new_tokens
    if eos is not None:
        done |= (token[:, None] == eos).any(-1)
    return token, count, ~done


def _sequences(out: torch.Tensor, count: torch.Tensor) -> list[list[int]]:
    return [row[:n] for row, n in zip(out.tolist(), count.tolist())]


@torch.no_grad()
def generate_ar(
    model,
    prompts,
    max_new_tokens: int,
    eos_token_id: int | Iterable[int] | None = None,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> list[list[int]]:
    """Plain autoregressive decoding with the runtime target, one token per row per forward.

    prompts: (N, P) long tensor or N id lists (lengths may differ). Returns N lists of generated
    ids (prompt excluded; EOS kept, nothing after it). T=0 is greedy; T>0 samples the warped p.
    """
    params = SamplingParams(float(temperature), int(top_k), float(top_p))
    ids, lengths, state, out, eos = _start(model, prompts, max_new_tokens, eos_token_id, 1)
    if max_new_tokens == 0:
        return [[] for _ in range(ids.shape[0])]
    logits = prefill(model, state, ids, lengths)
    token, count, active = _first_token(logits, out, max_new_tokens, params, generator, eos)
    no_drafts = token.new_zeros(token.shape[0], 0)  # an AR step is a verify step with P = 0
    max_len = _max_len(state)
    while True:
        any_active, longest = _poll(active, state.lengths)
        if not any_active:
            break
        logits = verify(model, state, token[:, None], kv_len=_kv_len(longest, 1, max_len))
        nxt = choose(logits[:, 0], params, generator)  # (N,)
        zero = torch.zeros_like(nxt)
        acc = finish_step(zero, nxt, no_drafts, active=active, eos_token_id=eos, budget=max_new_tokens - count)
        commit(state, acc.commit)  # the fed token (the previous one) enters the caches
        count = emit(out, count, acc.tokens, acc.num_emitted)
        active = active & ~acc.finished
        token = torch.where(active, nxt, token)
    return _sequences(out, count)


@torch.no_grad()
def generate_spec(
    model,
    drafter,
    prompts,
    max_new_tokens: int,
    eos_token_id: int | Iterable[int] | None = None,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    argmax_drafts: bool = False,
) -> SpecResult:
    """Lossless speculative decoding of the runtime target ``model`` with a runtime ``drafter``.

    drafter: a :class:`~dflash2.runtime.drafter.RuntimeDrafter` (or any object with its
    ``block_size``, ``new_context``, ``append`` and ``propose``), or a ``DFlashDrafter`` / drafter
    folder, wrapped in one. prompts: (N, P) tensor or N id
    lists. At T=0 the output equals :func:`generate_ar` (and plain greedy decoding) token for token;
    at T>0 every token follows the target's warped distribution. argmax_drafts: at T>0 draft the
    T=0 drafts and verify them as point masses (no q over the vocabulary at all).
    """
    params = SamplingParams(float(temperature), int(top_k), float(top_p))
    if not hasattr(drafter, "propose"):  # a DFlashDrafter or its folder
        drafter = RuntimeDrafter(drafter, model)
    B = drafter.block_size
    ids, lengths, state, out, eos = _start(model, prompts, max_new_tokens, eos_token_id, B)
    N = ids.shape[0]
    if max_new_tokens == 0:
        return SpecResult([[] for _ in range(N)], [[] for _ in range(N)], B)
    max_len = _max_len(state)
    ctx = drafter.new_context(N, ids.shape[1] + max_new_tokens + B)
    # prefill: the prompt's taps go to a buffer of their own (variable length), then into the context
    taps = None if ctx.taps is None else ctx.taps.new_empty(N, ids.shape[1], ctx.taps.shape[-1])
    logits = prefill(model, state, ids, lengths, taps_out=taps)
    drafter.append(ctx, taps, lengths)
    anchor, count, active = _first_token(logits, out, max_new_tokens, params, generator, eos)
    log = []  # per step (was active, accepted drafts, emitted): stays on the device until the end
    while True:
        any_active, longest = _poll(active, state.lengths)
        if not any_active:
            break
        kv_len = _kv_len(longest, B, max_len)
        proposal = drafter.propose(ctx, anchor, params, generator, kv_len=kv_len, argmax_drafts=argmax_drafts)
        block = torch.cat([anchor[:, None], proposal.tokens], dim=1)  # (N, B)
        logits = verify(model, state, block, taps_out=ctx.taps, kv_len=kv_len)  # taps land in the context buffer
        finish = dict(active=active, eos_token_id=eos, budget=max_new_tokens - count)
        if params.greedy:
            acc = accept_greedy(logits.argmax(-1), proposal.tokens, **finish)
        else:
            acc = accept_sampled(warp_probs(logits, params), proposal, generator, **finish)
        # rows that finish now commit nothing: they never decode again, and a frozen row's length stays
        # ≤ prompt + emitted − 1, which is what the caches are sized for (a cut block commits more than it emits)
        commit(state, torch.where(acc.finished, 0, acc.commit), drafter, ctx)
        count = emit(out, count, acc.tokens, acc.num_emitted)
        log.append(torch.stack([active.long(), acc.num_accepted, acc.num_emitted]))
        active = active & ~acc.finished  # finished rows keep their anchor: their state is frozen
        anchor = torch.where(active, acc.next_anchor, anchor)
    return SpecResult(_sequences(out, count), _per_row_steps(log, N), B)


def _per_row_steps(log: list[torch.Tensor], N: int) -> list[list[int]]:
    """Stacked per-step records (S, 3, N) -> per row, the accepted drafts of each step it took part in."""
    if not log:
        return [[] for _ in range(N)]
    steps = torch.stack(log).tolist()  # one read at the end
    return [[acc[r] for was, acc, _ in steps if was[r]] for r in range(N)]
