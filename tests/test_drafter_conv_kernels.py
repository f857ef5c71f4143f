"""The block-local conv's training kernels (dflash2/drafter/conv_kernels.py, drafter.conv_kernels): each side's
forward and backward against the module's torch code (their twin) and its autograd, on CPU tensors through
Triton's interpreter (the ``interpret`` fixture) and, on a GPU machine, on CUDA.

Tolerances: fp32 to a few fp32 ulps (torch's fp32 defaults: the products are summed in another order);
bf16 against the exact (fp64) values, no farther from them than the torch code's own bf16 result (which
rounds at every op, the kernels once; within 25%)."""

from __future__ import annotations

import pytest
import torch
from kernel_devices import kernel_devices

from dflash2.drafter.local_conv import BlockLocalConv, block_conv_side_torch, set_conv_kernels

conv_kernels = pytest.importorskip("dflash2.drafter.conv_kernels")

# (lead, T, hidden, K, gs, B): blocks of 4 in a sequence of 3 blocks; one partial block (T < B); three taps;
# hidden not a multiple of the channel tile (masked channels); a group as wide as the tile
CASES = [((2,), 12, 64, 2, 16, 4), ((3,), 3, 32, 2, 8, 4), ((2, 2), 16, 48, 3, 16, 8), ((1,), 10, 160, 2, 16, 5),
         ((2,), 8, 256, 2, 128, 4)]  # fmt: skip


def _inputs(lead, T, C, K, gs, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, T, C, generator=g)
    delta = torch.randn(*lead, T, 2, K, C // gs, generator=g) * 0.5
    base = torch.randn(2, K, C, generator=g)
    grad = torch.randn(*lead, T, C, generator=g)
    return x.to(dtype).to(device), delta.to(dtype).to(device), base.to(device), grad.to(dtype).to(device)


def _forward_backward(fn, x, delta, base, grad):
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, delta, base)]
    out = fn(*leaves)
    out.backward(grad)
    return out.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("device", kernel_devices())
@pytest.mark.parametrize("side", [0, 1])
@pytest.mark.parametrize("case", CASES)
def test_kernels_equal_the_torch_code_and_its_autograd_in_fp32(device, side, case, interpret):
    lead, T, C, K, gs, B = case
    x, delta, base, grad = _inputs(lead, T, C, K, gs, torch.float32, device, seed=side)
    assert conv_kernels.kernels_apply(x, delta, gs)
    want, want_grads = _forward_backward(lambda *a: block_conv_side_torch(*a, side, B, gs), x, delta, base, grad)
    got, got_grads = _forward_backward(lambda *a: conv_kernels.conv_side(*a, side, B, gs), x, delta, base, grad)
    torch.testing.assert_close(got, want)
    for name, g, w in zip(("x", "delta", "base"), got_grads, want_grads):
        torch.testing.assert_close(g, w, msg=name)
    other = 1 - side  # the other side's δ and base rows get no gradient from this side
    assert torch.equal(got_grads[1][..., other, :, :], torch.zeros_like(got_grads[1][..., other, :, :]))
    assert torch.equal(got_grads[2][other], torch.zeros_like(got_grads[2][other]))


@pytest.mark.parametrize("device", kernel_devices())
def test_kernels_in_bf16_are_no_farther_from_the_exact_values_than_the_torch_code(device, interpret):
    lead, T, C, K, gs, B = (2,), 16, 128, 2, 16, 4
    x, delta, base, grad = _inputs(lead, T, C, K, gs, torch.bfloat16, device, seed=3)
    exact, exact_grads = _forward_backward(
        lambda *a: block_conv_side_torch(*a, 1, B, gs), x.double(), delta.double(), base.double(), grad.double()
    )
    torch_out, torch_grads = _forward_backward(lambda *a: block_conv_side_torch(*a, 1, B, gs), x, delta, base, grad)
    got, got_grads = _forward_backward(lambda *a: conv_kernels.conv_side(*a, 1, B, gs), x, delta, base, grad)
    assert got.dtype == torch.bfloat16 and got_grads[0].dtype == got_grads[1].dtype == torch.bfloat16

    def err(a, b):
        return ((a.double() - b).norm() / b.norm()).item()

    for name, mine, theirs, truth in zip(
        ("out", "x", "delta", "base"), [got, *got_grads], [torch_out, *torch_grads], [exact, *exact_grads]
    ):
        assert err(mine, truth) <= 1.25 * err(theirs, truth) + 1e-12, name


def _drafter_pair():
    from conftest import nontrivial_dflash2, spec_drafter, spec_target

    target = spec_target("qwen3")
    return target, nontrivial_dflash2(spec_drafter(target, 4, v2=True))


@pytest.mark.parametrize("device", kernel_devices())
def test_a_dflash2_drafter_with_the_kernels_equals_it_without(device, interpret):
    """set_conv_kernels reaches every conv of a drafter; through both sides of a conv'd sub-layer and the
    kernel projection, the output and every parameter gradient equal the torch path's in fp32. The parameter
    gradients sum products of gradients that each took a different summation order, so they are compared
    with the exact (fp64 torch) values: the kernels' error within 2× the torch path's, or 1e-6 (norm-wise)."""
    import copy

    _, drafter = _drafter_pair()
    convs = [m for m in drafter.modules() if isinstance(m, BlockLocalConv)]
    assert convs and not any(m.use_kernels for m in convs)
    fused = copy.deepcopy(drafter)
    set_conv_kernels(fused, True)
    assert all(m.use_kernels for m in fused.modules() if isinstance(m, BlockLocalConv))
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 8, drafter.config.hidden_size, generator=g)
    probe = torch.randn(2, 8, drafter.config.hidden_size, generator=g)
    calls = []
    real = conv_kernels.conv_side
    conv_kernels.conv_side = lambda *a, **kw: calls.append(1) or real(*a, **kw)
    try:
        outs, grads = [], []
        for model, dtype in (
            (copy.deepcopy(drafter).double(), torch.float64),
            (drafter, torch.float32),
            (fused, torch.float32),
        ):
            model = model.to(device)
            conv = model.layers[0].mlp_conv
            x = h.to(dtype).to(device)
            delta = conv.deltas(x)
            y = conv(conv(x, 0, delta, 4), 1, delta, 4)
            (y * probe.to(dtype).to(device)).sum().backward()
            outs.append(y.detach())
            grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    finally:
        conv_kernels.conv_side = real
    assert len(calls) == 2, "the kernels did not run for both sides"
    # the report's flag says so too (it once probed with shapes the kernels refuse, and said False)
    assert conv_kernels.conv_kernels_run(fused, torch.device(device))
    _, plain, mine = outs  # (the fp64 output: the gradients' reference below)
    torch.testing.assert_close(mine, plain)
    assert grads[0].keys() == grads[1].keys() == grads[2].keys() and grads[0]

    def err(a, b):
        return ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item()

    for name, truth in grads[0].items():
        assert err(grads[2][name], truth) <= max(2 * err(grads[1][name], truth), 1e-6), name


def test_a_group_size_the_kernels_cannot_tile_keeps_the_torch_code():
    x, delta = torch.zeros(1, 4, 36), torch.zeros(1, 4, 2, 2, 3)
    assert not conv_kernels.kernels_apply(x, delta, 12)  # not a power of two (and CPU tensors outside the fixture)
    assert not conv_kernels.conv_kernels_run(BlockLocalConv(36, 2, 12), torch.device("cpu"))


@pytest.mark.parametrize("device", kernel_devices())
def test_drafter_conv_kernels_reaches_a_training_step_which_equals_the_torch_code(
    device, make_spec_target, make_spec_drafter, interpret
):
    """drafter.conv_kernels through training_module: every conv of the drafter switched, one block_outputs +
    backward of the module with it on against off: losses, predictions and every parameter gradient (fp32,
    torch's default tolerances)."""
    from conftest import nontrivial_dflash2, training_step

    target = make_spec_target("qwen3")
    drafter = nontrivial_dflash2(make_spec_drafter(target, 4, v2=True))
    outs, grads = {}, {}
    for flag in (False, True):
        module, outs[flag], grads[flag] = training_step(target, drafter, device, conv_kernels=flag)
        assert module.conv_kernels is flag
        assert all(m.use_kernels is flag for m in module.drafter.modules() if isinstance(m, BlockLocalConv))
    for key in ("loss", "ce", "selector_loss"):
        torch.testing.assert_close(outs[True][key], outs[False][key])
    assert torch.equal(outs[True]["predictions"], outs[False]["predictions"])
    assert grads[True].keys() == grads[False].keys() and grads[False]
    for name in grads[False]:
        torch.testing.assert_close(grads[True][name], grads[False][name], msg=name)


def test_a_bad_conv_switch_is_a_one_line_error():
    from dflash2.errors import DFlash2Error
    from dflash2.training.preflight import check_conv_kernels

    assert check_conv_kernels(None) is False and check_conv_kernels(True) is True
    with pytest.raises(DFlash2Error, match=r"drafter\.conv_kernels='yes' must be true or false"):
        check_conv_kernels("yes")


def test_inputs_the_kernels_do_not_index_keep_the_torch_code(interpret):
    """A broadcast δ (one row for all positions), a δ whose groups do not cover x, fp64: the torch code."""
    x = torch.zeros(2, 4, 32)
    if "cpu" in kernel_devices():  # under the interpreter the well-formed call runs the kernels on CPU tensors
        assert conv_kernels.kernels_apply(x, torch.zeros(2, 4, 2, 2, 2), 16)
    assert not conv_kernels.kernels_apply(x, torch.zeros(1, 4, 2, 2, 2), 16)  # broadcast rows
    assert not conv_kernels.kernels_apply(x, torch.zeros(2, 4, 2, 2, 3), 16)  # 3 groups of 16 != 32 channels
    assert not conv_kernels.kernels_apply(x.double(), torch.zeros(2, 4, 2, 2, 2, dtype=torch.float64), 16)
