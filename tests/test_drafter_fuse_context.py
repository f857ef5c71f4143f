"""The drafter fuses the target's taps without an fp32 copy of them under autocast (DFlashDrafter.fuse_context):
the same context states and fc gradient as casting them to the drafter's dtype first."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode


class _Casts(TorchDispatchMode):
    """Records the (source dtype, destination dtype, elements) of every dtype conversion."""

    def __init__(self):
        super().__init__()
        self.casts = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and "dtype" in kwargs:
            self.casts.append((args[0].dtype, kwargs["dtype"], args[0].numel()))
        return func(*args, **kwargs)


def _reference(drafter, taps):
    return drafter.hidden_norm(drafter.fc(taps.to(drafter.fc.weight.dtype)))


@pytest.mark.parametrize("taps_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("autocast", [False, True])
def test_context_and_fc_gradient_equal_a_cast_to_the_drafters_dtype(
    make_spec_target, make_spec_drafter, taps_dtype, autocast
):
    target = make_spec_target("qwen3")
    drafter = make_spec_drafter(target, 4).train()
    taps = torch.randn(2, 9, drafter.fc.in_features, generator=torch.Generator().manual_seed(0)).to(taps_dtype)
    results = []
    for fn in (drafter.fuse_context, lambda t: _reference(drafter, t)):
        drafter.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16) if autocast else nullcontext():
            c = fn(taps)
        c.float().square().sum().backward()
        results.append((c.detach(), drafter.fc.weight.grad.clone()))
    (c, grad), (want_c, want_grad) = results
    assert c.dtype == want_c.dtype and torch.equal(c, want_c)
    assert torch.equal(grad, want_grad)


def test_under_autocast_no_fp32_copy_of_bf16_taps_is_made(make_spec_target, make_spec_drafter):
    target = make_spec_target("qwen3")
    drafter = make_spec_drafter(target, 4)
    taps = torch.randn(2, 9, drafter.fc.in_features).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16), _Casts() as probe:
        drafter.fuse_context(taps)
    assert (torch.bfloat16, torch.float32, taps.numel()) not in probe.casts
    with _Casts() as probe:  # no autocast (an fp32 CPU run): cast to the weights' dtype, as before
        drafter.fuse_context(taps)
    assert (torch.bfloat16, torch.float32, taps.numel()) in probe.casts
