"""The drafter's RMSNorm in fewer passes (dflash2/drafter/rms_norm.py): the reference's values and gradients
bit for bit, and less kept for backward."""

from __future__ import annotations

import copy
from contextlib import nullcontext

import pytest
import torch

import dflash2.drafter.model as model
from dflash2.drafter.objective import anchor_generator
from dflash2.drafter.rms_norm import rms_norm, rms_norm_reference

DTYPES = [torch.float32, torch.bfloat16]


def _values_and_grads(fn, x0, w0, grad, eps=1e-6):
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    out = fn(x, w, eps)
    out.backward(grad)
    return out.detach(), x.grad, w.grad


@pytest.mark.parametrize("x_dtype", DTYPES)
@pytest.mark.parametrize("w_dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 7, 64), (3, 5, 4, 16), (1, 4096)])
def test_values_and_both_gradients_equal_the_reference_bit_for_bit(x_dtype, w_dtype, shape):
    g = torch.Generator().manual_seed(sum(shape))
    x = (3 * torch.randn(shape, generator=g)).to(x_dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(w_dtype)
    grad = torch.randn(shape, generator=g).to(x_dtype)
    got, want = _values_and_grads(rms_norm, x, w, grad), _values_and_grads(rms_norm_reference, x, w, grad)
    for name, a, b in zip(("out", "grad x", "grad w"), got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a, b), name


def test_a_frozen_weight_or_input_gets_no_gradient_and_no_grad_mode_just_normalises():
    x, w = torch.randn(3, 8, dtype=torch.bfloat16), torch.rand(8) + 0.5
    xg = x.clone().requires_grad_()
    rms_norm(xg, w, 1e-6).sum().backward()
    assert xg.grad is not None and w.grad is None
    wg = w.clone().requires_grad_()
    rms_norm(x, wg, 1e-6).sum().backward()
    assert wg.grad is not None
    with torch.no_grad():
        assert torch.equal(rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6))


def _saved_bytes(fn, x, w) -> int:
    """Bytes autograd keeps for backward of one call (parameters and inputs counted like any tensor)."""
    sizes = []

    def pack(t):
        sizes.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x, w, 1e-6)
    return sum(sizes)


def test_backward_keeps_the_input_and_the_row_scales_not_two_fp32_copies():
    x = torch.randn(4, 32, 256, dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(256, requires_grad=True)
    activation = x.numel()
    ours, ref = _saved_bytes(rms_norm, x, w), _saved_bytes(rms_norm_reference, x, w)
    assert ours == 2 * activation + 4 * 4 * 32 + 4 * 256  # x (bf16), r (fp32 per row), the weight
    assert ref >= 8 * activation  # x32 and y, fp32


@pytest.mark.parametrize("autocast", [False, True])
def test_a_drafter_training_step_is_bit_for_bit_the_reference_one(
    make_spec_target, make_spec_drafter, monkeypatch, autocast
):
    """Loss and every parameter gradient of one training step of a DFlash2 drafter (norms everywhere: input,
    q/k, post-attention, fused context, final), fp32 and under CPU bf16 autocast, with the drafter's RMSNorm
    and with the reference put back in its place."""
    from dflash2.training.drafter_module import DrafterTrainingModule

    target = make_spec_target("qwen3")
    drafter = make_spec_drafter(target, 4, v2=True).train()
    kw = dict(num_anchors=5, loss_gamma=4.0, selector_loss_weight=1.0, lr=1e-3, weight_decay=0.0)
    kw.update(warmup_ratio=0.0, total_steps=1, seed=0, loss_chunk_positions=7)
    ids = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "loss_mask": (torch.arange(24) >= 8).long().expand(2, 24)}
    results = {}
    for name, fn in (("ours", rms_norm), ("reference", rms_norm_reference)):
        monkeypatch.setattr(model, "rms_norm", fn)
        module = DrafterTrainingModule(copy.deepcopy(drafter), target, **kw)
        with torch.autocast("cpu", dtype=torch.bfloat16) if autocast else nullcontext():
            out = module.block_outputs(batch, anchor_generator(0, 0))
        out["loss"].backward()
        grads = {n: p.grad for n, p in module.drafter.named_parameters() if p.grad is not None}
        results[name] = out["loss"].detach(), grads
    (loss, grads), (ref_loss, ref_grads) = results["ours"], results["reference"]
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys() and any("norm" in n for n in grads)
    for n in ref_grads:
        assert torch.equal(grads[n], ref_grads[n]), n


@pytest.mark.cuda
@pytest.mark.parametrize("x_dtype", DTYPES)
def test_on_cuda_values_and_gradients_equal_the_reference_bit_for_bit(x_dtype):
    g = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(4, 512, 4096, generator=g)).to(x_dtype).cuda()
    w = (1 + 0.1 * torch.randn(4096, generator=g)).cuda()
    grad = torch.randn(4, 512, 4096, generator=g).to(x_dtype).cuda()
    got, want = _values_and_grads(rms_norm, x, w, grad), _values_and_grads(rms_norm_reference, x, w, grad)
    for name, a, b in zip(("out", "grad x", "grad w"), got, want):
        assert torch.equal(a, b), name
