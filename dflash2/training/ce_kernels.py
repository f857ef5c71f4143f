"""The chunked CE's per-chunk passes over the (C, V) logits as Triton kernels, each with its plain-PyTorch twin
(opt-in: ``drafter.loss_kernels``; docs/TRAINING.md "Chunked loss through the LM head").

What: ``chunked_head.py`` computes, per chunk of C drafted positions, the raw logits r = linear(h, W) (C, V) of
the frozen LM head in the head's dtype (bf16 under bf16-mixed, fp32 on the CPU) and reads off them, without
serving scales (output multiplier 1, no softcap: the served logits are float(r)):

    forward   lse (C,) fp32 = logsumexp(float(r)), ce (C,) fp32 = lse − float(r[y]),
              argmax (C,) int64 (the first index of the row's max, as torch.argmax), label_raw (C,) = r[y]
    backward  g (C, V) head dtype = ((exp(float(r) − lse) − onehot(y)) · grad_ce) rounded to the head's dtype,
              then g @ W (the matmul stays torch's)

The twins (``ce_forward_ref``, ``ce_backward_ref``) are the chunked path's torch arithmetic: the forward is
three passes over r (argmax, the row max and the promoted exp-sum of ``logsumexp_of_float``) and a gather,
the backward an fp32 (C, V) temporary for ``r − lse`` (exp'd and scattered in place) and one rounded product
into the head's dtype: three (C, V) passes and ~20 bytes moved per logit. The top-k (below) reads r once
more either way.

Why: at the Qwen3-8B shape a chunk is C · V = 1024 × 151,936 = 156 M logits (311 MB in bf16, 622 MB per fp32
temporary); those passes over it are the elementwise and reduce kernels that stand beside the head's matmuls
in a training step's profile. Here the forward reads r once (2 bytes per logit in bf16) and the backward
reads r once and writes g over it in place (4 bytes per logit), no fp32 (C, V) tensor at all.

How:

* forward, launch 1, one program per (row, split of ``tiles`` · ``block`` vocabulary entries): the split's
  max, the first index holding it and Σ exp(float(r) − max), walked in ``block``-wide tiles with a running
  max (the online softmax sum: the running sum is rescaled by exp(old max − new max) when the max grows),
  to (C, S) fp32 / fp32 / int32 partials. The vocabulary is split so that there are enough programs to fill
  a GPU: C · S ≥ ``MIN_PROGRAMS`` where the row allows (at C = 1024 and V = 151,936: S = 10 splits of 8 tiles
  of 2048; a chunk of a few positions gets one tile per program, 75 per row);
* forward, launch 2, one program per row: the partials combined the same way (max of maxima, the lowest
  index holding it, Σ sum_s · exp(max_s − max)), lse = log(Σ) + max, the label's raw logit (one gather)
  and ce = lse − float(r[y]);
* backward, one program per (row, tile of ``block``): g written into r's own storage (same dtype, each
  element read, then written, by one program), the whole pass elementwise.

Shifts follow torch's logsumexp: a ±inf max is replaced by 0 before the exponentials (a row of -inf gives
lse = -inf, a +inf entry lse = +inf). NaN logits are not supported (argmax would not report them as
torch.argmax does). The top-k (the selector's candidates) stays ``torch.topk``: the runtime's two-stage
kernel (``dflash2/runtime/kernels/topk.py``) orders equal values by index where ``torch.topk`` leaves the
order unspecified, so candidate lists could differ from the plain path's on ties, and it is built for a
few rows, not C = 1024.

Numerics (tests/test_chunked_head_kernels.py): argmax, label_raw and ce's label term exactly; lse (and ce)
to fp32 rounding, not bit for bit: the exp-sum is summed in another order (tiles, then splits, each
rescaled once) and the exponentials are not torch's: numpy's in the interpreter and, on NVIDIA GPUs, Triton
lowers the fp32 exp to the approximate ex2 instruction (~2 ulp) where torch uses an accurate expf. The same
exponentials make g differ from the twin's by a few fp32 ulps before the rounding, so a bf16 (fp16) g can
differ by one unit in the last place where that rounding flips; an fp32 g by a few fp32 ulps. The bf16
rounding is done in integer ops (``_rtne_bf16``): the interpreter's own cast truncates.

Shapes: C rows (positions of a chunk), V vocabulary (any, not a multiple of ``block``), r (C, V) contiguous,
labels (C,) int64 in [0, V) (not checked: a label outside gives a NaN label_raw and ce, and no -1 in g),
grad_ce (C,) fp32 (any stride: made contiguous), lse (C,) fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dflash2.drafter.rounded_ops import product_as
from dflash2.runtime.kernels import jit
from dflash2.runtime.kernels.norm import triton_next_pow2
from dflash2.runtime.kernels.triton_util import rtne_bf16 as _rtne_bf16

BLOCK = 2048  # vocabulary entries per tile (8 bf16 per thread at 8 warps); not tuned on a GPU yet
MAX_TILES = 8  # tiles per forward program at most: a program walks ≤ 16,384 entries of its row
MIN_PROGRAMS = 1024  # forward launch 1: fewer tiles per program until this many programs (an H200: 132 SMs)
_NO_INDEX = tl.constexpr(2**31 - 1)  # larger than any vocabulary index: "none" in the min-index reductions


# -------------------------------------------------------------------------------------------- twins
def ce_forward_ref(raw: torch.Tensor, labels: torch.Tensor):
    """The twin: (lse, ce, argmax, label_raw) of raw (C, V) and labels (C,), the chunked path's arithmetic."""
    from dflash2.training.chunked_head import logsumexp_of_float

    label_raw = raw.gather(1, labels[:, None])[:, 0]
    lse = logsumexp_of_float(raw)
    return lse, lse - label_raw.float(), raw.argmax(-1), label_raw


def ce_backward_ref(raw: torch.Tensor, lse: torch.Tensor, labels: torch.Tensor, grad_ce: torch.Tensor):
    """The twin: ((softmax(float(raw)) − onehot(labels)) · grad_ce) in raw's dtype (C, V), the chunked path's
    arithmetic (softmax as exp(float(raw) − lse) with the forward's lse); raw is left as it is."""
    g = raw.float() - lse[:, None] if raw.dtype != torch.float32 else raw - lse[:, None]
    g.exp_()
    g.scatter_add_(1, labels[:, None], g.new_full((raw.shape[0], 1), -1.0))
    return product_as(g, grad_ce[:, None], raw.dtype, in_place=True)


# ------------------------------------------------------------------------------------------ kernels
@triton.jit
def _shift(m):
    """torch.logsumexp's shift: the max, or 0 where it is ±inf (so that exp(x − shift) is never NaN)."""
    return tl.where(tl.abs(m) == float("inf"), 0.0, m)


def _ce_partials_kernel(raw_ptr, pmax_ptr, psum_ptr, parg_ptr, V, S, TILES, BLOCK: tl.constexpr):
    """Program (row, split): over vocabulary [split · TILES · BLOCK, (split + 1) · TILES · BLOCK) ∩ [0, V) of
    the row, its max, the first index holding it and Σ exp(x − shift(max)), to [row · S + split]."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    base = raw_ptr + row * V
    cols = tl.arange(0, BLOCK)
    start = split * TILES * BLOCK
    m = tl.full([], float("-inf"), tl.float32)
    total = tl.full([], 0.0, tl.float32)
    arg = tl.full([], 0, tl.int32)
    for t in range(TILES):
        offs = start + t * BLOCK + cols
        inside = offs < V
        x = tl.load(base + offs, mask=inside, other=float("-inf")).to(tl.float32)
        tile_max = tl.max(x, axis=0)
        tile_arg = tl.min(tl.where(inside & (x == tile_max), offs, _NO_INDEX), axis=0)
        # a later tile's indices are larger: it takes the argmax only with a strictly larger max
        arg = tl.where((tile_max > m) | (t == 0), tile_arg, arg)
        new = tl.maximum(m, tile_max)
        # the running sum, relative to shift(m), moved to shift(new); min(·, 0): an old max of -inf (shift 0,
        # a zero sum) must not make exp overflow into 0 · inf
        rescale = tl.exp(tl.minimum(_shift(m) - _shift(new), 0.0))
        total = total * rescale + tl.sum(tl.exp(x - _shift(new)), axis=0)
        m = new
    out = row * S + split
    tl.store(pmax_ptr + out, m)
    tl.store(psum_ptr + out, total)
    tl.store(parg_ptr + out, arg)


def _ce_combine_kernel(
    raw_ptr,
    labels_ptr,
    pmax_ptr,
    psum_ptr,
    parg_ptr,
    lse_ptr,
    ce_ptr,
    argmax_ptr,
    label_raw_ptr,
    V,
    S,
    BLOCK_S: tl.constexpr,
):
    """Program row: the row's S partials combined into lse, argmax; the label's raw logit and ce."""
    row = tl.program_id(0).to(tl.int64)
    ss = tl.arange(0, BLOCK_S)
    inside = ss < S
    pm = tl.load(pmax_ptr + row * S + ss, mask=inside, other=float("-inf"))
    ps = tl.load(psum_ptr + row * S + ss, mask=inside, other=0.0)
    pa = tl.load(parg_ptr + row * S + ss, mask=inside, other=_NO_INDEX)
    m = tl.max(pm, axis=0)
    # splits ascend: the lowest index among the splits holding the max is the row's first argmax
    arg = tl.min(tl.where(inside & (pm == m), pa, _NO_INDEX), axis=0)
    scale = tl.exp(tl.minimum(_shift(pm) - _shift(m), 0.0))
    total = tl.sum(tl.where(inside, ps * scale, 0.0), axis=0)
    lse = tl.log(total) + _shift(m)
    y = tl.load(labels_ptr + row)
    # a label outside [0, V) reads nothing: NaN (the torch passes' gather raises there)
    label = tl.load(raw_ptr + row * V + y, mask=(y >= 0) & (y < V), other=float("nan"))
    tl.store(lse_ptr + row, lse)
    tl.store(ce_ptr + row, lse - label.to(tl.float32))
    tl.store(argmax_ptr + row, arg.to(tl.int64))
    tl.store(label_raw_ptr + row, label)


def _ce_backward_kernel(
    raw_ptr, out_ptr, lse_ptr, labels_ptr, grad_ptr, V, BLOCK: tl.constexpr, OUT_BF16: tl.constexpr
):
    """Program (row, tile): out = ((exp(float(raw) − lse) − onehot(y)) · grad_ce) in out's dtype, one tile."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < V
    x = tl.load(raw_ptr + row * V + offs, mask=inside, other=0.0).to(tl.float32)
    lse = tl.load(lse_ptr + row)
    y = tl.load(labels_ptr + row)
    gc = tl.load(grad_ptr + row)
    p = tl.exp(x - lse)
    p = tl.where(offs == y, p - 1.0, p)  # the twin's scatter_add of -1.0: the same IEEE sum
    g = p * gc
    if OUT_BF16:
        g = _rtne_bf16(g)
    tl.store(out_ptr + row * V + offs, g.to(out_ptr.dtype.element_ty), mask=inside)


# ---------------------------------------------------------------------------------------- launchers
def _rows(raw: torch.Tensor) -> torch.Tensor:
    if raw.dim() != 2:
        raise ValueError(f"raw logits must be (C, V), got shape {tuple(raw.shape)}")
    return raw if raw.stride() == (raw.shape[1], 1) else raw.contiguous()


def forward_split(rows: int, vocab: int, block: int = BLOCK, tiles: int | None = None) -> tuple[int, int]:
    """(tiles per program, splits per row) of forward launch 1: as many tiles (≤ ``MAX_TILES``) as keep
    rows × splits ≥ ``MIN_PROGRAMS``, or ``tiles`` when given."""
    blocks = -(-vocab // block)
    if tiles is None:
        tiles = max(1, min(MAX_TILES, rows * blocks // MIN_PROGRAMS))
    tiles = max(1, min(int(tiles), blocks))
    return tiles, -(-blocks // tiles)


def ce_forward(
    raw: torch.Tensor,
    labels: torch.Tensor,
    *,
    out: tuple[torch.Tensor, ...] | None = None,
    block: int = BLOCK,
    tiles: int | None = None,
    warps: int = 8,
):
    """(lse (C,) fp32, ce (C,) fp32, argmax (C,) int64, label_raw (C,) raw's dtype) of raw (C, V) and labels
    (C,): ``ce_forward_ref`` in two launches reading raw once. ``out``: those four tensors to write into
    (contiguous, e.g. slices of the whole batch's outputs); ``block`` / ``tiles``: the tile width (a power of
    two) and tiles per program (None: ``forward_split``'s choice). Runs on CUDA tensors, and on CPU ones
    under Triton's interpreter (TRITON_INTERPRET=1; callers check ``dflash2.runtime.kernels.use_triton``)."""
    raw = _rows(raw)
    C, V = raw.shape
    labels = labels.contiguous()
    if out is None:
        f32 = dict(dtype=torch.float32, device=raw.device)
        out = (
            torch.empty(C, **f32),
            torch.empty(C, **f32),
            torch.empty(C, dtype=torch.long, device=raw.device),
            torch.empty(C, dtype=raw.dtype, device=raw.device),
        )
    lse, ce, argmax, label_raw = out
    if C == 0:
        return out
    tiles, S = forward_split(C, V, block, tiles)
    pmax = torch.empty(C, S, dtype=torch.float32, device=raw.device)
    psum = torch.empty_like(pmax)
    parg = torch.empty(C, S, dtype=torch.int32, device=raw.device)
    jit(_ce_partials_kernel, ("S", "TILES"))[(C, S)](raw, pmax, psum, parg, V, S, tiles, BLOCK=block, num_warps=warps)
    block_s = triton_next_pow2(S)
    jit(_ce_combine_kernel, ("S",))[(C,)](
        raw,
        labels,
        pmax,
        psum,
        parg,
        lse,
        ce,
        argmax,
        label_raw,
        V,
        S,
        BLOCK_S=block_s,
        num_warps=max(1, min(4, block_s // 64)),
    )
    return out


def ce_backward(
    raw: torch.Tensor,
    lse: torch.Tensor,
    labels: torch.Tensor,
    grad_ce: torch.Tensor,
    *,
    in_place: bool = False,
    block: int = BLOCK,
    warps: int = 8,
) -> torch.Tensor:
    """``ce_backward_ref`` in one elementwise launch: g (C, V) in raw's dtype, written over raw when
    ``in_place`` (raw must then be contiguous), else into a new tensor. lse (C,) fp32 from the forward;
    grad_ce (C,) any float dtype and stride (used as fp32, as the twin's promotion does)."""
    if in_place and raw.stride() != (raw.shape[1], 1):
        raise ValueError("ce_backward(in_place=True) needs contiguous (C, V) logits")
    raw = _rows(raw)
    C, V = raw.shape
    out = raw if in_place else torch.empty_like(raw)
    if C == 0:
        return out
    grad = grad_ce.float().contiguous()
    jit(_ce_backward_kernel)[(C, -(-V // block))](
        raw,
        out,
        lse.contiguous(),
        labels.contiguous(),
        grad,
        V,
        BLOCK=block,
        OUT_BF16=out.dtype == torch.bfloat16,
        num_warps=warps,
    )
    return out
