"""Cross-entropy through the frozen LM head, chunk by chunk (issue 15; docs/TRAINING.md "Chunked loss through
the LM head").

Training reads five things off the drafter's logits at each of the M = N·A·P drafted positions
(ARCHITECTURE.md §2.6, §3.2). With r_m = W h_m + b the raw logits (the head's compute dtype) and
z_m = scale_logits(r_m) the served ones (fp32, §3.4), for a label y_m:

    ce (M,) fp32          logsumexp(z_m) - z_m[y_m], the only differentiable output (w.r.t. h)
    argmax (M,) int64     argmax r_m: the top-1 prediction of the accuracy / τ-estimate metrics
    top_ids (M, k) int64  the k largest r_m, by raw logit desc: the selector's candidates
    top_raw (M, k)        their raw logits (head dtype), the selector's unary terms before scaling
    label_raw (M,)        r_m[y_m] (head dtype): the selector's injected gold candidate

The plain path (``head_outputs_from_logits``) reads them off the full (M, V) logits, which
autograd keeps with an fp32 copy and their gradient: ~9 G elements for a 151,936-token vocabulary
at 8 rows × 512 anchors × 15 positions. ``chunked_head_outputs`` computes the same on row chunks
of C positions and recomputes a chunk's logits in backward instead of storing them, so it never
holds more than a few (C, V) tensors at a time (with ``keep_logits`` it keeps every chunk's raw logits
from forward to backward instead: one matmul per chunk fewer, M · V values held). The head is frozen: W and b
get no gradient.

Per chunk the elementwise work over (C, V) costs about as much memory traffic as the head's matmul, so
it is kept to few passes without changing a value (tests/test_chunked_head_passes.py, bit for bit against
the arithmetic it replaced): without serving scales the served logits are float(raw), which is never
stored (``logsumexp_of_float``; in backward ``raw - lse`` promotes to fp32 in the subtraction itself),
and the last factor of the gradient is multiplied in while rounding to the head's dtype (``rounded_ops``).

``fused=True`` (``drafter.loss_kernels``, on by default since it was timed on the H200) runs those passes, without
serving scales, as Triton kernels (``ce_kernels.py``): one read of the logits for lse, argmax and the label's
logit in forward, and the gradient written over the recomputed logits in one pass in backward; values to
fp32 rounding (tests/test_chunked_head_kernels.py). With serving scales it keeps the passes here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from dflash2.drafter.rounded_ops import product_as

log = logging.getLogger(__name__)
_NOTED: set[str] = set()  # why fused=True fell back, each said once per process


@dataclass(frozen=True)
class HeadOutputs:
    """What training reads off the logits, for positions of any leading shape (...): see the module doc."""

    ce: torch.Tensor  # (...) fp32
    argmax: torch.Tensor  # (...) int64
    top_ids: torch.Tensor  # (..., k) int64
    top_raw: torch.Tensor  # (..., k) head dtype
    label_raw: torch.Tensor  # (...) head dtype


def head_outputs_from_logits(raw: torch.Tensor, served: torch.Tensor, labels: torch.Tensor, top_k: int) -> HeadOutputs:
    """The plain path, from the full logits: raw (..., V) the head's output, served (..., V) the drafter's
    served logits (``DFlashDrafter.block_logits``), labels (...) int64 in [0, V), top_k >= 0 (0: none)."""
    ce = F.cross_entropy(served.float().flatten(0, -2), labels.flatten(), reduction="none").view_as(labels)
    top_raw, top_ids = torch.topk(raw, top_k, dim=-1)  # the selector's top_candidates
    label_raw = raw.gather(-1, labels[..., None])[..., 0]
    return HeadOutputs(ce, raw.argmax(-1), top_ids, top_raw, label_raw)


def head_compute_dtype(weight: torch.Tensor, device_type: str) -> torch.dtype:
    """The dtype the plain path's ``lm_head(h.to(W.dtype))`` computes in: autocast's when autocast is on for
    the device (linear is one of its lower-precision ops on CUDA and CPU), else the weight's. Fixed once so
    that the chunks recomputed in backward, where the caller's autocast no longer applies, are the same."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return weight.dtype


def chunked_head_outputs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    *,
    chunk: int,
    top_k: int = 0,
    multiplier: float = 1.0,
    softcap: float | None = None,
    fused: bool = False,
    keep_logits: bool = False,
    topk_kernel: bool = False,
) -> HeadOutputs:
    """``head_outputs_from_logits`` without the full logits.

    hidden (..., d) any float dtype (gradient flows back to it through ``ce``); weight (V, d) and bias (V,)
    or None: the frozen LM head (no gradient reaches them); labels (...) int64 in [0, V); chunk: positions
    per chunk (>= 1); top_k >= 0; multiplier / softcap: the drafter's serving scales (§3.4); fused: each
    chunk's passes over its logits as Triton kernels (``ce_kernels.py``) where ``use_fused_passes`` allows
    (no serving scales, tensors the kernels can run on), else the torch passes; keep_logits: each chunk's raw
    logits kept from forward to backward (M · V values in the head's dtype held between them) instead of
    recomputed there: one head matmul per chunk fewer; backward then consumes them (a second backward
    through the same graph is refused); topk_kernel: the top_k candidates through the runtime's two-stage
    Triton top-k (``runtime/kernels/topk.py``: the same values, ties by the lower index) where it runs, else
    ``torch.topk``.
    Returns HeadOutputs with the leading shape (...) of hidden.
    """
    if chunk < 1:
        raise ValueError(f"chunk={chunk} must be >= 1 positions")
    lead = labels.shape
    dtype = head_compute_dtype(weight, hidden.device.type)
    fused = use_fused_passes(fused, hidden, multiplier, softcap)
    outs = _ChunkedHeadCE.apply(
        hidden.reshape(-1, hidden.shape[-1]),
        weight.detach(),
        None if bias is None else bias.detach(),
        labels.reshape(-1),
        int(chunk),
        int(top_k),
        float(multiplier),
        None if softcap is None else float(softcap),
        dtype,
        fused,
        # kept only for a backward to come (validation and no_grad calls hold nothing extra)
        bool(keep_logits) and torch.is_grad_enabled() and hidden.requires_grad,
        bool(topk_kernel),
    )
    ce, argmax, top_ids, top_raw, label_raw = outs
    return HeadOutputs(
        ce.view(lead), argmax.view(lead), top_ids.view(*lead, top_k), top_raw.view(*lead, top_k), label_raw.view(lead)
    )


def use_fused_passes(fused: bool, hidden: torch.Tensor, multiplier: float, softcap: float | None) -> bool:
    """Whether ``fused=True`` runs the Triton kernels: only without serving scales (multiplier 1, no softcap:
    every config in configs/, drafter/*.yaml and experiment/*.yaml alike; a drafter with z-lab's cap of 20
    keeps the torch passes) and where the kernels run (CUDA tensors, or CPU ones in
    ``dflash2.runtime.kernels.on_cpu()`` under Triton's interpreter; not with DFLASH2_TRITON=0). A fallback
    is logged once per process and reason."""
    if not fused:
        return False
    if multiplier != 1.0 or softcap is not None:
        _note_once(
            f"drafter.loss_kernels: the drafter has serving scales (output_multiplier={multiplier}, "
            f"final_logit_softcapping={softcap}); the chunked CE keeps its torch passes"
        )
        return False
    from dflash2.runtime.kernels import use_triton

    if not use_triton(hidden):
        _note_once(
            f"drafter.loss_kernels: the Triton kernels cannot run on {hidden.device.type} tensors here "
            "(CUDA, or the interpreter in tests); the chunked CE keeps its torch passes"
        )
        return False
    return True


def _note_once(message: str) -> None:
    if message not in _NOTED:
        _NOTED.add(message)
        log.info(message)


def logsumexp_of_float(raw: torch.Tensor) -> torch.Tensor:
    """``torch.logsumexp(raw.float(), dim=-1)`` without the fp32 copy of raw: raw (C, V) -> (C,)
    fp32. The steps of torch's logsumexp (row max, inf max to 0, exp of the difference, sum, log, add the
    max back), with the bf16 -> fp32 conversion done inside the subtraction (type promotion) instead of
    into a (C, V) fp32 tensor first; the max of a bf16 row converts exactly to the max of its fp32 one.
    Bit for bit on the CPU; on the H200 (torch 2.11) short rows (64) came out summed in another order
    than torch.logsumexp's (fp32 rounding), while the CE's vocabulary-long rows were bit for bit."""
    if raw.dtype == torch.float32:
        return torch.logsumexp(raw, dim=-1)
    maxes = torch.amax(raw, dim=-1, keepdim=True).float()  # (C, 1)
    maxes.masked_fill_(maxes.abs() == float("inf"), 0)
    out = (raw - maxes).exp_().sum(-1)  # raw - maxes: float(raw) - maxes, in fp32
    return out.log_().add_(maxes[:, 0])


def _served_logits(raw, multiplier, softcap):
    """``scale_logits(raw, multiplier, softcap)``, the same operations in the same order (so the same values),
    with fewer (C, V) temporaries. raw (C, V) -> (z (C, V) fp32, t): t = tanh(multiplier·raw / softcap)
    (z = t·softcap), kept for the derivative; None without a cap. z is raw itself when raw is fp32 and
    unscaled, else a new tensor."""
    x = raw.float()
    fresh = x is not raw  # a new tensor that may be written into
    if multiplier != 1.0:
        x, fresh = x * multiplier, True
    if softcap is None:
        return x, None
    t = (x.div_(softcap) if fresh else x / softcap).tanh_()
    return t * softcap, t


def _times(g: torch.Tensor, factors: list, dtype: torch.dtype) -> torch.Tensor:
    """g (C, V) fp32 times each factor in turn, in place, the last product rounded straight into ``dtype``
    (``rounded_ops.product_as``: the values of ``g.mul_(last).to(dtype)`` in one pass)."""
    for factor in factors[:-1]:
        g.mul_(factor)
    return product_as(g, factors[-1], dtype, in_place=True)


class _ChunkedHeadCE(torch.autograd.Function):
    """Inputs: hidden (M, d), weight (V, d), bias (V,) or None, labels (M,), chunk, top_k, multiplier,
    softcap, dtype, fused (the Triton passes: no serving scales, checked by the caller), keep (the chunks' raw
    logits kept for backward instead of recomputed there), topk_kernel (the candidates through topk_rows).
    Outputs: ce (M,) fp32, argmax (M,), top_ids (M, k), top_raw (M, k), label_raw (M,).
    Without keep, each chunk's tensors are dropped before the next chunk's logits exist: one chunk's worth at
    a time; with it, every chunk's raw logits stay until backward has used them."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk, top_k, multiplier, softcap, dtype, fused, keep, topk_kernel):
        m = hidden.shape[0]
        kept = [] if keep else None
        if fused:
            from dflash2.training.ce_kernels import ce_forward
        if topk_kernel:
            from dflash2.runtime.kernels.topk import topk_rows
        # Autocast off inside: every chunk (here and in backward) computes in the dtype fixed by the caller.
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)  # one (V, d) copy at most, as autocast's own weight cast
            b = None if bias is None else bias.to(dtype)
            ce = torch.empty(m, dtype=torch.float32, device=hidden.device)
            lse = torch.empty_like(ce)
            argmax = torch.empty(m, dtype=torch.long, device=hidden.device)
            top_ids = torch.empty(m, top_k, dtype=torch.long, device=hidden.device)
            top_raw = torch.empty(m, top_k, dtype=dtype, device=hidden.device)
            label_raw = torch.empty(m, dtype=dtype, device=hidden.device)
            for s in range(0, m, chunk):
                e = min(s + chunk, m)
                lab = labels[s:e, None]
                raw = F.linear(hidden[s:e].to(dtype), w, b)  # (C, V) as lm_head(h.to(W.dtype))
                if kept is not None:  # backward reads this chunk's logits here instead of recomputing them
                    kept.append(raw)
                if top_k:
                    pick = topk_rows if topk_kernel else (lambda x, k: torch.topk(x, k, dim=-1))
                    top_raw[s:e], top_ids[s:e] = pick(raw, top_k)
                if fused:  # lse, ce, argmax and the label's logit in one read of raw
                    ce_forward(raw, labels[s:e], out=(lse[s:e], ce[s:e], argmax[s:e], label_raw[s:e]))
                    del raw
                    continue
                argmax[s:e] = raw.argmax(-1)
                label_raw[s:e] = raw.gather(1, lab)[:, 0]
                if multiplier == 1.0 and softcap is None:  # z = float(raw): never stored (logsumexp_of_float)
                    lse[s:e] = logsumexp_of_float(raw)
                    ce[s:e] = lse[s:e] - label_raw[s:e].float()
                    del raw
                    continue
                z, t = _served_logits(raw, multiplier, softcap)
                del raw, t
                lse[s:e] = torch.logsumexp(z, dim=-1)
                ce[s:e] = lse[s:e] - z.gather(1, lab)[:, 0]
                del z
        ctx.save_for_backward(hidden, weight, bias, labels, lse)
        ctx.chunk, ctx.multiplier, ctx.softcap, ctx.dtype, ctx.fused = chunk, multiplier, softcap, dtype, fused
        ctx.kept, ctx.keep = kept, keep
        ctx.mark_non_differentiable(argmax, top_ids, top_raw, label_raw)
        return ce, argmax, top_ids, top_raw, label_raw

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_ce, *_):
        """d ce_m / d h_m = (softmax(z_m) - onehot(y_m)) · dz/dr · W, chunk by chunk; nothing for W, b, the rest."""
        hidden, weight, bias, labels, lse = ctx.saved_tensors
        dtype, mult, cap = ctx.dtype, ctx.multiplier, ctx.softcap
        grad_h = torch.empty_like(hidden)
        kept = ctx.kept
        if ctx.keep:
            if kept is None:
                raise RuntimeError(
                    "chunked_head_outputs(keep_logits=True): backward already consumed the kept logits "
                    "(a second backward through the same graph needs keep_logits=False)"
                )
            ctx.kept = None  # consumed below (the gradient is written over them): never reused
        if ctx.fused:
            from dflash2.training.ce_kernels import ce_backward

            grad_ce = grad_ce.float().contiguous()  # e.g. an expanded scalar's gradient: a real (M,) tensor
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            b = None if bias is None else bias.to(dtype)
            for i, s in enumerate(range(0, hidden.shape[0], ctx.chunk)):
                e = min(s + ctx.chunk, hidden.shape[0])
                if kept is not None:  # the forward's raw logits, kept; dropped from the list as they are used
                    raw, kept[i] = kept[i], None
                else:
                    raw = F.linear(hidden[s:e].to(dtype), w, b)  # the forward's raw logits (C, V), recomputed
                if ctx.fused:  # (softmax - onehot) · grad_ce, rounded to the head's dtype, written over raw
                    g = ce_backward(raw, lse[s:e], labels[s:e], grad_ce[s:e], in_place=True)
                    del raw
                    grad_h[s:e] = (g @ w).to(hidden.dtype)
                    del g
                    continue
                factors = [grad_ce[s:e, None]]  # what softmax(z) - onehot(y) is multiplied by, in order
                if mult == 1.0 and cap is None:  # z - lse as float(raw) - lse, one pass: no fp32 copy of raw
                    g = raw.sub_(lse[s:e, None]) if raw.dtype == torch.float32 else torch.sub(raw, lse[s:e, None])
                    del raw
                else:
                    z, t = _served_logits(raw, mult, cap)
                    del raw
                    g = z.sub_(lse[s:e, None])  # into z
                    if t is not None:  # z = cap·tanh(mult·r / cap): dz/dr = mult·(1 - tanh²)
                        factors.append(t.square_().neg_().add_(1.0))
                    if mult != 1.0:
                        factors.append(mult)
                    del z, t
                # softmax(z) - onehot(y), times the upstream gradient (and dz/dr), written into g
                g.exp_()
                g.scatter_add_(1, labels[s:e, None], g.new_full((e - s, 1), -1.0))
                # Through raw = linear(h.to(dtype)): the matmul in the head's dtype, as autograd's would be.
                grad_h[s:e] = (_times(g, factors, dtype) @ w).to(hidden.dtype)
                del g, factors
        return grad_h, None, None, None, None, None, None, None, None, None, None, None
