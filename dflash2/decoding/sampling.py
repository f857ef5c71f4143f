"""Sampling and lossless acceptance for speculative decoding (ARCHITECTURE.md §4).

Pure tensor functions, no host sync (gpt-fast style): the decoder reads the
accepted count once per step, nothing here calls ``.item()``.

Shapes: ``...`` = any leading batch dims (rows), P = drafted positions (B-1),
V = vocabulary. ``p`` is always the *target's* distribution at the P+1 verify
positions (position i predicts the token after verify input i, so p[..., P, :]
is the bonus distribution); ``q`` is the drafter's proposal at the P drafted
positions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dflash2.errors import DFlash2Error


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen. temperature 0 = greedy (top_k / top_p ignored).

    top_k=0 and top_p=1.0 mean "off". The same params warp the target's p and the
    drafter's q (§4, warping: one warp for both before the test).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not (
            isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature >= 0
        ):
            raise DFlash2Error(f"temperature={self.temperature!r} must be a finite number >= 0 (0 = greedy)")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise DFlash2Error(f"top_k={self.top_k!r} must be an integer >= 0 (0 = off)")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise DFlash2Error(f"top_p={self.top_p!r} must be in (0, 1] (1 = off)")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


def warp_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits (..., V) -> probabilities (..., V) fp32 after temperature, top-k, top-p (HF order).

    top-k keeps every token whose logit >= the k-th largest (ties at the edge are
    kept, identically for p and q); top-p keeps the smallest prefix of the sorted
    distribution whose mass reaches top_p (the most likely token always survives).
    Greedy params give the plain softmax (temperature 1): callers use argmax then.
    """
    x = logits.float() / (params.temperature if params.temperature > 0 else 1.0)
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]  # (..., 1)
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        sorted_p = torch.softmax(sorted_x, dim=-1)
        mass_before = sorted_p.cumsum(-1) - sorted_p  # mass of strictly more likely tokens
        drop_sorted = mass_before >= params.top_p  # the top token has mass_before 0: never dropped
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return torch.softmax(x, dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """probs (..., V) -> tokens (...) long, one draw per row."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


def point_mass(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """tokens (...) -> one-hot (..., V) fp32: the proposal q of a deterministic (argmax) draft.

    With q = δ_x, rejection sampling accepts x with probability p(x) and the
    residual is p with x removed, renormalised (§4).
    """
    out = torch.zeros(*tokens.shape, vocab_size, dtype=torch.float32, device=tokens.device)
    return out.scatter_(-1, tokens[..., None], 1.0)


def _accepted_prefix(accept: torch.Tensor) -> torch.Tensor:
    """accept (..., P) bool -> (...) long: length of the leading run of True."""
    return accept.long().cumprod(dim=-1).sum(dim=-1)


def greedy_accept(target_argmax: torch.Tensor, drafts: torch.Tensor):
    """T=0 acceptance (§4). target_argmax (..., P+1), drafts (..., P) -> (num_accepted (...), next_token (...)).

    Accept the longest prefix where d_i == argmax p_i; the next token (the bonus)
    is the target's argmax right after it — at the first mismatch that is the
    correction, after a full match it is the block's extra token. The output is
    therefore exactly what greedy decoding of the target emits.
    """
    a = _accepted_prefix(drafts == target_argmax[..., :-1])  # (...)
    nxt = target_argmax.gather(-1, a[..., None])[..., 0]
    return a, nxt


def rejection_accept(
    p: torch.Tensor, q: torch.Tensor, draft_tokens: torch.Tensor, generator: torch.Generator | None = None
):
    """T>0 lossless acceptance by sequential rejection sampling (§4).

    p: (..., P+1, V) target probabilities at the verify positions (already warped);
    q: (..., P, V) the proposals the drafts were sampled from (warped the same way;
       a point mass for argmax drafts); draft_tokens: (..., P) long.
    Returns (num_accepted (...) long in [0, P], next_token (...) long).

    For i = 0, 1, ...: accept d_i with probability min(1, p_i(d_i) / q_i(d_i)); at
    the first rejection draw the replacement from the residual
    norm(max(0, p_i - q_i)); if all P are accepted draw the bonus from p_P. Every
    emitted token is then distributed exactly as the target's p given its prefix,
    whatever q is (Leviathan et al. 2023, Chen et al. 2023).
    """
    P, V = draft_tokens.shape[-1], p.shape[-1]
    px = p[..., :P, :].gather(-1, draft_tokens[..., None])[..., 0]  # (..., P) p_i(d_i)
    qx = q.gather(-1, draft_tokens[..., None])[..., 0]  # (..., P) q_i(d_i) > 0: d_i ~ q_i
    u = torch.rand(px.shape, generator=generator, device=p.device, dtype=torch.float32)
    # accept iff u < p/q  <=>  u·q < p  (no division; p >= q always accepts since u < 1)
    a = _accepted_prefix(u * qx < px)  # (...)
    # One formula for both cases: pad q with a zero row at position P, so the
    # "residual" after a full accept is max(0, p_P - 0) = p_P, i.e. the bonus.
    q_pad = torch.cat([q.float(), q.new_zeros(*q.shape[:-2], 1, V, dtype=torch.float32)], dim=-2)
    idx = a[..., None, None].expand(*a.shape, 1, V)
    p_a = p.float().gather(-2, idx)[..., 0, :]  # (..., V)
    q_a = q_pad.gather(-2, idx)[..., 0, :]
    resid = (p_a - q_a).clamp_min(0.0)
    mass = resid.sum(-1, keepdim=True)
    # mass == 0 only when p_a == q_a, where a rejection has probability 0 (rounding): fall back to p
    resid = torch.where(mass > 0, resid / mass.clamp_min(1e-30), p_a)
    return a, sample(resid, generator)
