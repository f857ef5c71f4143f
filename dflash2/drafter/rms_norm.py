"""The drafter's RMSNorm, the same arithmetic as ``rms_norm_reference`` in fewer passes and less memory (issue 15;
docs/TRAINING.md "Training step overheads").

The drafter normalises in fp32 whatever its input dtype (bf16 under bf16-mixed autocast): x (..., d),
w (d,) ->

    x32 = float(x);  r = rsqrt(mean(x32², -1) + eps)  (..., 1);  y = x32 · r;  out = cast_to(x.dtype)(y · float(w))

Written as those tensor operations (``rms_norm_reference``, what ``RMSNorm.forward`` was), autograd keeps
x32 and y (two fp32 copies of the activation) for backward, and forward and backward make about 18 passes
over (..., d) fp32 tensors: casts, the products and, in backward, the full-size gradient of the mean and
of pow (pow(x, 1), times 2, times the gradient). At the Qwen3-8B recipe the drafter normalises ~1.2 G
activation elements per step, so those passes were most of the step's fp32 multiplies and fp32 -> bf16
casts in its profile.

``rms_norm`` computes bit for bit the same forward and the same gradients with fewer of them:

* the same operations on the same operands, in the same order, so every value rounds the same;
* a bf16 operand meets an fp32 one inside one operation (type promotion computes ``float(x) · r`` exactly
  as ``x32 · r``), so float copies of x and of the incoming gradient are never stored;
* the last product of the forward and the last sum of the backward write straight into the bf16 result
  (``rounded_ops``: on CUDA the fp32 value is rounded as it is stored, one pass instead of a product and
  a cast);
* the gradient of mean and pow, ``(g_m / d)`` broadcast times ``2·x32``, is taken as ``x32 · (2·(g_m / d))``
  with the division and the doubling on the (..., 1) tensor: doubling is exact in binary floating point,
  so the product is the same number and rounds the same;
* only x (the input, in its own dtype) and r are kept for backward; y is recomputed there.
* x's gradient has two parts (through y = x32·r and through the mean of x32²). For a bf16 x the
  reference sums them in fp32 before casting, and so does this. For an fp32 x the reference's x32 *is*
  x, and autograd adds both parts into x's gradient one after the other, after any gradient x got
  from elsewhere first (the residual stream); the sum of three fp32 numbers depends on that order, so
  here an fp32 x enters twice and each part is handed back on its own, to be added in the same order.

Passes over (..., d) per norm, forward + backward, counting bytes per element: ~144 -> ~96; kept for backward:
8 -> 2 bytes per element (bf16 input). ``tests/test_rms_norm.py`` checks values and both gradients with
``torch.equal`` against the reference, fp32 and bf16 inputs, fp32 and bf16 weights.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from dflash2.drafter.rounded_ops import product_as, sum_as


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The drafter's RMSNorm as plain tensor operations (the reference): x (..., d), weight (d,) -> (..., d) in
    x's dtype. fp32 statistics and product, one rounding back to the input dtype (bf16-safe)."""
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``rms_norm_reference(x, weight, eps)``, its value and its gradients bit for bit, in fewer passes (module doc)."""
    # fp32: x twice, its two gradient parts returned apart and summed by autograd as in the reference's graph
    return _RMSNorm.apply(x, x if x.dtype == torch.float32 else None, weight, float(eps))


class _RMSNorm(torch.autograd.Function):
    """Inputs: x (..., d) any float dtype, ``x_again``: x itself (its second gradient part goes there) or None
    (both parts summed into x's gradient), weight (d,), eps. Output (..., d) in x's dtype."""

    @staticmethod
    def forward(ctx, x, x_again, weight, eps):
        x32 = x.float()  # x itself when x is fp32: then never written into
        r = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)  # (..., 1)
        fresh = x32 is not x
        y = x32.mul_(r) if fresh else x32 * r
        out = product_as(y, weight.float(), x.dtype, in_place=True)
        ctx.save_for_backward(x, weight, r)
        ctx.split = x_again is not None
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        """The reference's autograd graph, node by node (the same products of the same operands):

        out = cast(z), z = y·w32:   g_z = float(grad);  g_y = g_z·w32;  g_w = sum over rows (g_z·y)
        y = x32·r:                  g_x32 = g_y·r + (pow / mean path);  g_r = sum over d (g_y·x32)
        r = rsqrt(m + eps):         g_m = (-0.5·g_r)·r³
        m = mean(x32²):             pow path = (g_m / d)·(2·x32), as x32·(2·(g_m / d)) (exact: module doc)
        """
        x, weight, r = ctx.saved_tensors
        w32 = weight.float()
        grad_weight = None
        if ctx.needs_input_grad[2]:
            y = torch.mul(x, r)  # (..., d) fp32: float(x)·r, the forward's y
            grad_weight = torch.mul(grad, y).sum_to_size(w32.shape)
            del y
            if weight.dtype != torch.float32:
                grad_weight = grad_weight.to(weight.dtype)
        if not (ctx.needs_input_grad[0] or ctx.needs_input_grad[1]):
            return None, None, grad_weight, None
        grad_y = torch.mul(grad, w32)  # (..., d) fp32: float(grad)·w32
        grad_r = torch.mul(grad_y, x).sum_to_size(r.shape)  # (..., 1)
        grad_m = (-0.5 * grad_r) * r.pow(3)
        twice_mean_grad = (grad_m / x.shape[-1]) * 2  # (..., 1): the mean's gradient, doubled (exact)
        direct = grad_y.mul_(r)  # g_y·r, into g_y (no longer needed)
        through_mean = torch.mul(x, twice_mean_grad)
        if ctx.split:  # fp32 x: autograd adds the parts, in the reference's order (y's part first)
            return direct, through_mean, grad_weight, None
        return sum_as(direct, through_mean, x.dtype, in_place=True), None, grad_weight, None
