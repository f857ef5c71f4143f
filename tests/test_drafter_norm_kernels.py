"""The drafter RMSNorm's training kernels (dflash2/drafter/norm_kernels.py, drafter.norm_kernels): forward and
backward against the twin ``rms_norm_reference`` and its autograd, on CPU tensors through Triton's interpreter
(the ``interpret`` fixture) and, on a GPU machine, on CUDA.

Tolerances: fp32 at torch's fp32 defaults (sums in another order); bf16 against the exact (fp64) values, no
farther from them than the torch code's own bf16 result (within 25%, or one bf16 ulp of the values' scale)."""

from __future__ import annotations

import copy

import pytest
import torch
from kernel_devices import kernel_devices

from dflash2.drafter.model import RMSNorm, set_norm_kernels
from dflash2.drafter.rms_norm import rms_norm_reference

norm_kernels = pytest.importorskip("dflash2.drafter.norm_kernels")

# (lead, d): rows of several widths (a tile holds 4096 / d rows, one row from d = 4096 on), d not a power of
# two (masked columns), rows not a multiple of the tile's, more row tiles than backward programs (the
# interpreter runs 4: (37, 512) has 5 tiles, (1000, 64) 16, four per program)
CASES = [((3, 5), 64), ((2, 7, 4), 128), ((11,), 96), ((4, 9), 40), ((37,), 512), ((1,), 5000), ((1000,), 64)]
EPS = 1e-6


def _inputs(lead, d, dtype, device, wdtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, d, generator=g) * 3
    w = 1 + 0.1 * torch.randn(d, generator=g)
    grad = torch.randn(*lead, d, generator=g)
    return x.to(dtype).to(device), w.to(wdtype).to(device), grad.to(dtype).to(device)


def _forward_backward(fn, x, w, grad):
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, w)]
    out = fn(*leaves)
    out.backward(grad)
    return out.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("device", kernel_devices())
@pytest.mark.parametrize("case", CASES)
def test_kernels_equal_the_reference_and_its_autograd_in_fp32(device, case, interpret):
    lead, d = case
    x, w, grad = _inputs(lead, d, torch.float32, device)
    assert norm_kernels.kernels_apply(x, w)
    want, want_grads = _forward_backward(lambda a, b: rms_norm_reference(a, b, EPS), x, w, grad)
    got, got_grads = _forward_backward(lambda a, b: norm_kernels.rms_norm_kernels(a, b, EPS), x, w, grad)
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_grads[0], want_grads[0])
    # the weight's gradient sums over every row (1000 here), in another order than torch's: judged against the
    # exact (fp64) sum, no farther from it than twice torch's own error (or 1e-6 of its norm)
    exact = _exact(x, w, grad)[1][1]

    def err(a):
        return ((a.double() - exact).norm() / exact.norm()).item()

    assert err(got_grads[1]) <= max(2 * err(want_grads[1]), 1e-6), (err(got_grads[1]), err(want_grads[1]))


def _exact(x, w, grad):
    """fp64 values and gradients of the same function (the truth the bf16 results are judged against)."""
    out, grads = _forward_backward(lambda a, b: rms_norm_reference(a, b, EPS), x.double(), w.double(), grad.double())
    return out, grads


@pytest.mark.parametrize("device", kernel_devices())
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_kernels_in_bf16_are_no_farther_from_the_exact_values_than_the_torch_code(device, wdtype, interpret):
    x, w, grad = _inputs((6, 8), 256, torch.bfloat16, device, wdtype=wdtype, seed=1)
    truth, truth_grads = _exact(x, w, grad)
    torch_out, torch_grads = _forward_backward(lambda a, b: rms_norm_reference(a, b, EPS), x, w, grad)
    got, got_grads = _forward_backward(lambda a, b: norm_kernels.rms_norm_kernels(a, b, EPS), x, w, grad)
    assert got.dtype == torch.bfloat16 and got_grads[0].dtype == torch.bfloat16 and got_grads[1].dtype == wdtype

    def err(a, b):
        return ((a.double() - b).abs().max()).item()

    for name, mine, theirs, exact in (
        ("out", got, torch_out, truth),
        ("x", got_grads[0], torch_grads[0], truth_grads[0]),
    ):
        ulp = exact.abs().max().item() * 2.0**-8
        assert err(mine, exact) <= max(1.25 * err(theirs, exact), ulp), name
    if wdtype == torch.float32:  # an fp32 sum of fp32 products, both ways: fp32's tolerances, no bf16 floor
        torch.testing.assert_close(got_grads[1], torch_grads[1])
    else:
        ulp = truth_grads[1].abs().max().item() * 2.0**-8
        assert err(got_grads[1], truth_grads[1]) <= max(1.25 * err(torch_grads[1], truth_grads[1]), ulp)


@pytest.mark.parametrize("device", kernel_devices())
def test_either_input_alone_gets_its_gradient(device, interpret):
    x, w, grad = _inputs((5, 3), 64, torch.float32, device)
    _, (want_x, want_w) = _forward_backward(lambda a, b: rms_norm_reference(a, b, EPS), x, w, grad)
    leaf = x.detach().clone().requires_grad_(True)
    norm_kernels.rms_norm_kernels(leaf, w, EPS).backward(grad)  # w: no requires_grad
    torch.testing.assert_close(leaf.grad, want_x)
    w_leaf = w.detach().clone().requires_grad_(True)
    norm_kernels.rms_norm_kernels(x, w_leaf, EPS).backward(grad)  # x: no requires_grad
    torch.testing.assert_close(w_leaf.grad, want_w)


@pytest.mark.parametrize("device", kernel_devices())
def test_fp16_strided_inputs_gradient_and_weight(device, interpret):
    """fp16 x; x and the incoming gradient as transposed views (the q/k norms' gradients arrive so); a weight
    that is a strided view. Both ways compute in fp32 and round once to fp16: every value within one fp16 ulp
    of the reference's (the sums run in another order)."""
    x, w, grad = _inputs((6, 4), 64, torch.float16, device)
    x_t = x.transpose(0, 1).contiguous().transpose(0, 1)  # the same values, strided
    grad_t = grad.transpose(0, 1).contiguous().transpose(0, 1)
    w_strided = torch.stack([w, w + 1], -1).reshape(-1)[::2]  # the same values, stride 2
    assert not x_t.is_contiguous() and not grad_t.is_contiguous() and w_strided.stride(0) == 2
    want, want_grads = _forward_backward(lambda a, b: rms_norm_reference(a, b, EPS), x, w, grad)
    x_leaf, w_leaf = x_t.detach().requires_grad_(True), w_strided.detach().requires_grad_(True)
    got = norm_kernels.rms_norm_kernels(x_leaf, w_leaf, EPS)
    got.backward(grad_t)

    def within_an_ulp(a, b):
        scale = torch.maximum(a.abs(), b.abs()).float()
        return bool(((a.float() - b.float()).abs() <= scale * 2.0**-10 + 1e-6).all())

    assert got.dtype == x_leaf.grad.dtype == torch.float16
    assert within_an_ulp(got, want) and within_an_ulp(x_leaf.grad, want_grads[0])
    torch.testing.assert_close(w_leaf.grad, want_grads[1])  # fp32 weight: an fp32 sum both ways


@pytest.mark.parametrize("device", kernel_devices())
def test_under_autocast_the_output_keeps_the_input_dtype(device, interpret):
    """Under bf16 autocast (training's bf16-mixed) the norm of an fp32 residual stream stays fp32, as the
    reference's does (a custom autograd function: autocast does not cast its inputs)."""
    x, w, grad = _inputs((4, 3), 64, torch.float32, device)
    with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16):
        want, want_grads = _forward_backward(lambda a, b: rms_norm_reference(a, b, EPS), x, w, grad)
        got, got_grads = _forward_backward(lambda a, b: norm_kernels.rms_norm_kernels(a, b, EPS), x, w, grad)
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want)
    for g, wg in zip(got_grads, want_grads):
        torch.testing.assert_close(g, wg)


@pytest.mark.parametrize("device", kernel_devices())
def test_a_drafter_with_the_kernels_equals_it_without(device, interpret):
    """set_norm_kernels reaches every RMSNorm of a drafter (sub-layer norms, q/k norms, the final norm); through
    a sub-layer norm, q_proj and the per-head q norm, the output and every parameter gradient equal the torch
    path's in fp32."""
    from conftest import nontrivial_dflash2, spec_drafter, spec_target

    drafter = nontrivial_dflash2(spec_drafter(spec_target("qwen3"), 4, v2=True)).to(device)
    fused = copy.deepcopy(drafter)
    set_norm_kernels(fused, True)
    norms = [m for m in fused.modules() if isinstance(m, RMSNorm)]
    assert len(norms) >= 3 and all(m.use_kernels for m in norms)
    assert not any(m.use_kernels for m in drafter.modules() if isinstance(m, RMSNorm))
    assert norm_kernels.norm_kernels_run(fused, torch.device(device))
    calls = []
    real = norm_kernels.rms_norm_kernels
    norm_kernels.rms_norm_kernels = lambda *a, **kw: calls.append(1) or real(*a, **kw)
    try:
        results = []
        for model in (drafter, fused):
            h = torch.randn(2, 6, model.config.hidden_size, generator=torch.Generator().manual_seed(0)).to(device)
            norm = model.layers[0].input_layernorm
            attn = model.layers[0].self_attn
            y = attn.q_norm(attn.q_proj(norm(h)).unflatten(-1, (attn.h, attn.hd)))
            # a random probe, not y², whose gradient through a norm nearly cancels (a norm is scale-free)
            (y * torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(device)).sum().backward()
            results.append((y.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    finally:
        norm_kernels.rms_norm_kernels = real
    assert len(calls) == 2, "the kernels did not run for both norms"
    (plain, plain_grads), (mine, mine_grads) = results
    torch.testing.assert_close(mine, plain)
    assert plain_grads.keys() == mine_grads.keys() and plain_grads
    for name in plain_grads:
        torch.testing.assert_close(mine_grads[name], plain_grads[name], msg=name)


def test_inputs_the_kernels_do_not_take_keep_the_torch_code(interpret):
    w = torch.ones(8)
    assert not norm_kernels.kernels_apply(torch.zeros(3, 8, dtype=torch.float64), w.double())  # fp64
    assert not norm_kernels.kernels_apply(torch.zeros(3, 6), w)  # d ≠ the weight's
    assert not norm_kernels.kernels_apply(torch.zeros(0, 8), w)  # no rows
    assert not norm_kernels.kernels_apply(torch.zeros(2, norm_kernels.MAX_D + 1), torch.ones(norm_kernels.MAX_D + 1))
    norm = RMSNorm(8)
    norm.use_kernels = True
    x = torch.randn(3, 8, dtype=torch.float64)
    torch.testing.assert_close(norm(x), rms_norm_reference(x, norm.weight, norm.eps))  # the torch code ran


@pytest.mark.parametrize("device", kernel_devices())
def test_drafter_norm_kernels_reaches_a_training_step_which_equals_the_torch_code(
    device, make_spec_target, make_spec_drafter, interpret
):
    """drafter.norm_kernels through training_module: every norm of the drafter switched, one block_outputs +
    backward of the module with it on against off: losses, predictions and every parameter gradient (fp32,
    torch's default tolerances)."""
    from conftest import nontrivial_dflash2, training_step

    target = make_spec_target("qwen3")
    drafter = nontrivial_dflash2(make_spec_drafter(target, 4, v2=True))
    outs, grads = {}, {}
    for flag in (False, True):
        module, outs[flag], grads[flag] = training_step(target, drafter, device, norm_kernels=flag)
        assert module.norm_kernels is flag
        assert all(m.use_kernels is flag for m in module.drafter.modules() if isinstance(m, RMSNorm))
    for key in ("loss", "ce", "selector_loss"):
        torch.testing.assert_close(outs[True][key], outs[False][key])
    assert torch.equal(outs[True]["predictions"], outs[False]["predictions"])
    assert grads[True].keys() == grads[False].keys() and grads[False]
    for name in grads[False]:
        torch.testing.assert_close(grads[True][name], grads[False][name], msg=name)


def test_a_bad_norm_switch_is_a_one_line_error():
    from dflash2.errors import DFlash2Error
    from dflash2.training.preflight import check_norm_kernels

    assert check_norm_kernels(None) is False and check_norm_kernels(True) is True
    with pytest.raises(DFlash2Error, match=r"drafter\.norm_kernels='yes' must be true or false"):
        check_norm_kernels("yes")
