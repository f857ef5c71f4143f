"""The chunked CE's fewer passes over (C, V) logits (dflash2/training/chunked_head.py, rounded_ops.py): the same
values and gradients, bit for bit, as the chunk arithmetic they replace (written out here as the reference)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflash2.drafter.rounded_ops import product_as, sum_as
from dflash2.training.chunked_head import _served_logits, chunked_head_outputs, logsumexp_of_float

SCALES = {"none": (1.0, None), "multiplier": (0.7, None), "softcap": (1.3, 2.0), "cap only": (1.0, 3.0)}


def _reference(hidden, weight, labels, grad_ce, chunk, multiplier, softcap, dtype):
    """ce (M,) and the gradient of sum(grad_ce · ce) w.r.t. hidden, chunk by chunk, as the chunked head
    computed them before: the served logits z as an fp32 tensor, torch.logsumexp over it, and in backward
    softmax(z) - onehot in z, each factor multiplied in place, then a cast to the head's dtype."""
    ces, grads = [], []
    w = weight.to(dtype)
    for s in range(0, hidden.shape[0], chunk):
        h, lab = hidden[s : s + chunk], labels[s : s + chunk, None]
        z, _ = _served_logits(F.linear(h.to(dtype), w), multiplier, softcap)
        lse = torch.logsumexp(z, dim=-1)
        ces.append(lse - z.gather(1, lab)[:, 0])
        z, t = _served_logits(F.linear(h.to(dtype), w), multiplier, softcap)
        g = z.sub_(lse[:, None]).exp_()
        g.scatter_add_(1, lab, g.new_full((h.shape[0], 1), -1.0))
        g.mul_(grad_ce[s : s + chunk, None])
        if t is not None:
            g.mul_(t.square_().neg_().add_(1.0))
        if multiplier != 1.0:
            g.mul_(multiplier)
        grads.append((g.to(dtype) @ w).to(hidden.dtype))
    return torch.cat(ces), torch.cat(grads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logsumexp_of_float_is_torchs_logsumexp_of_the_fp32_copy(dtype):
    g = torch.Generator().manual_seed(0)
    raw = (8 * torch.randn(33, 1000, generator=g)).to(dtype)
    raw[3] = raw[3, 0]  # a row of ties
    raw[5, 7] = 1e30 if dtype == torch.float32 else 3e38  # a huge logit
    assert torch.equal(logsumexp_of_float(raw), torch.logsumexp(raw.float(), dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rounded_products_and_sums_equal_compute_then_cast(dtype):
    g = torch.Generator().manual_seed(1)
    a, b = 5 * torch.randn(40, 300, generator=g), torch.randn(40, 1, generator=g)
    assert torch.equal(product_as(a.clone(), b, dtype), (a * b).to(dtype))
    assert torch.equal(product_as(a.clone(), 0.7, dtype), (a * 0.7).to(dtype))
    assert torch.equal(sum_as(a.clone(), a.flip(0), dtype), (a + a.flip(0)).to(dtype))
    assert product_as(a.clone(), b, dtype).dtype == dtype


@pytest.mark.parametrize("scale", sorted(SCALES))
@pytest.mark.parametrize("head_dtype", [torch.float32, torch.bfloat16])
def test_ce_and_hidden_gradient_equal_the_previous_chunk_arithmetic_bit_for_bit(scale, head_dtype):
    """A bf16 head with bf16 hidden states is the bf16-mixed training case (the chunk math then runs on bf16
    logits: the fp32 copies the change removes); fp32 is the CPU one."""
    mult, cap = SCALES[scale]
    g = torch.Generator().manual_seed(2)
    m, d, v, chunk = 45, 16, 301, 7
    hidden = torch.randn(m, d, generator=g).to(head_dtype)
    weight = (torch.randn(v, d, generator=g) / d**0.5 * 3).to(head_dtype)
    labels = torch.randint(0, v, (m,), generator=g)
    grad_ce = torch.rand(m, generator=g) * (torch.rand(m, generator=g) > 0.2)  # weights, some positions masked
    want_ce, want_grad = _reference(hidden, weight, labels, grad_ce, chunk, mult, cap, head_dtype)
    h = hidden.clone().requires_grad_()
    out = chunked_head_outputs(h, weight, None, labels, chunk=chunk, top_k=4, multiplier=mult, softcap=cap)
    (out.ce * grad_ce).sum().backward()
    assert torch.equal(out.ce.detach(), want_ce)
    assert h.grad.dtype == want_grad.dtype and torch.equal(h.grad, want_grad)


@pytest.mark.cuda
@pytest.mark.parametrize("scale", ["none", "softcap"])
def test_on_cuda_ce_and_gradient_equal_the_previous_chunk_arithmetic_bit_for_bit(scale):
    mult, cap = SCALES[scale]
    g = torch.Generator().manual_seed(3)
    m, d, v, chunk = 2048, 256, 151_936 // 8, 512
    hidden = torch.randn(m, d, generator=g).bfloat16().cuda()
    weight = (torch.randn(v, d, generator=g) / d**0.5 * 3).bfloat16().cuda()
    labels = torch.randint(0, v, (m,), generator=g).cuda()
    grad_ce = torch.rand(m, generator=g).cuda()
    want_ce, want_grad = _reference(hidden, weight, labels, grad_ce, chunk, mult, cap, torch.bfloat16)
    h = hidden.clone().requires_grad_()
    out = chunked_head_outputs(h, weight, None, labels, chunk=chunk, top_k=16, multiplier=mult, softcap=cap)
    (out.ce * grad_ce).sum().backward()
    assert torch.equal(out.ce.detach(), want_ce)
    assert torch.equal(h.grad, want_grad)
    # Rows of 64: on the CPU bit for bit (test above); on the H200 (torch 2.11) torch.logsumexp of the fp32
    # copy summed these short rows in another order than the promoted sum here: equal to fp32 rounding only.
    # The CE above, rows of 18,992, is bit for bit.
    lse, want = logsumexp_of_float(weight[:64].T.contiguous()), torch.logsumexp(weight[:64].T.float(), -1)
    torch.testing.assert_close(lse, want, rtol=4 * torch.finfo(torch.float32).eps, atol=0)
