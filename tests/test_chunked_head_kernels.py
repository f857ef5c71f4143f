"""The chunked CE's passes as Triton kernels (dflash2/training/ce_kernels.py, drafter.loss_kernels): each kernel
against its plain-PyTorch twin, and ``chunked_head_outputs(fused=True)`` against the plain path and the torch
passes, on CPU tensors through Triton's interpreter (the ``interpret`` fixture); the ``cuda`` cases on a GPU.

Tolerances:
* argmax, the label's raw logit and (fp32 or bf16 alike) the top-k ids: exactly;
* lse and ce: torch's fp32 defaults (rtol 1.3e-6, atol 1e-5): the exp-sum is summed in another order (tiles,
  then splits, each rescaled once), and the kernel's exp is not torch's (numpy's in the interpreter,
  ex2.approx on NVIDIA GPUs, 2 ulp): a few fp32 ulps of the sum, i.e. ~1e-6 absolute in its log;
* the gradient before the matmul: the twin's to a few fp32 ulps (the same exponentials: 3 ulps measured under
  the interpreter); rounded to bf16, adjacent bf16 values at most (one unit in the last place where the
  rounding of the fp32 product flips);
* the gradient w.r.t. hidden, after the matmul: fp32 defaults for an fp32 head, one bf16 ulp (2^-7 relative)
  for a bf16 head under the interpreter, as tests/test_chunked_head.py's bf16 comparisons; a bf16 head on a
  GPU, where ex2.approx flips a few pre-matmul entries to the adjacent bf16 value (each moving a hidden
  gradient by ~2^-9·|W|, however small that gradient is): its error against the exact fp32 gradient no
  larger than the torch passes' (within 25%).
The interpreter is slow: small V (odd, not a multiple of the tile) and a few dozen positions.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from kernel_devices import kernel_devices

from dflash2.training.chunked_head import chunked_head_outputs, head_outputs_from_logits

ce_kernels = pytest.importorskip("dflash2.training.ce_kernels")

BF16_TOL = dict(rtol=2**-7, atol=1e-5)
# (C, V, block, tiles): one tile per program; several tiles in a program and several splits per row (the
# running max and the combine); a split with a short last tile; the default tile, one split
SHAPES = [(6, 1001, 256, 1), (7, 1531, 128, 3), (5, 2999, 512, 2), (4, 1999, ce_kernels.BLOCK, None)]


def _logits(C, V, dtype, device, seed=0):
    """Raw logits of std ~3 (a peaked softmax, as trained), with ties and extremes planted: row 0 has its
    max at two places in different splits, row 1 a huge logit, row 2 a row of one value, row 3 -inf entries."""
    g = torch.Generator().manual_seed(seed)
    raw = 3 * torch.randn(C, V, generator=g)
    raw[0, 3] = raw[0, V - 2] = raw[0].max() + 1  # argmax: the first of the two
    raw[1, V // 2] = 1e4
    raw[2] = 0.25  # every index ties: argmax 0
    raw[3, :: V // 7] = float("-inf")
    labels = torch.randint(0, V, (C,), generator=g)
    labels[3] = 1  # a finite label (index 0 is -inf)
    return raw.to(dtype).to(device), labels.to(device)


def _adjacent_or_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Every pair of 16-bit floats equal or one unit in the last place apart (same sign: bit patterns ±1)."""
    ia, ib = a.view(torch.int16).int(), b.view(torch.int16).int()
    return bool(((ia - ib).abs() <= 1).all())


# --------------------------------------------------------------------------------- kernels vs twins
@pytest.mark.parametrize("device", kernel_devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"C{s[0]}V{s[1]}b{s[2]}t{s[3]}")
def test_forward_kernel_equals_its_twin(device, dtype, shape, interpret):
    C, V, block, tiles = shape
    raw, labels = _logits(C, V, dtype, device)
    lse, ce, argmax, label_raw = ce_kernels.ce_forward(raw, labels, block=block, tiles=tiles)
    want_lse, want_ce, want_argmax, want_label = ce_kernels.ce_forward_ref(raw, labels)
    assert torch.equal(argmax, want_argmax) and argmax.dtype == torch.long
    assert argmax[0] == 3 and argmax[2] == 0  # the planted ties: the first index, as torch.argmax
    assert torch.equal(label_raw, want_label) and label_raw.dtype == dtype
    assert lse.dtype == ce.dtype == torch.float32
    torch.testing.assert_close(lse, want_lse)
    torch.testing.assert_close(ce, want_ce)
    assert torch.equal(ce, lse - label_raw.float())  # the label term exactly


@pytest.mark.parametrize("device", kernel_devices())
def test_forward_kernel_writes_into_given_outputs(device, interpret):
    """``out``: slices of the whole batch's outputs, as the chunked path passes them; the rest untouched."""
    raw, labels = _logits(5, 777, torch.bfloat16, device)
    outs = [
        torch.full((9,), -7.0, device=device),
        torch.full((9,), -7.0, device=device),
        torch.full((9,), -7, dtype=torch.long, device=device),
        torch.full((9,), -7.0, dtype=torch.bfloat16, device=device),
    ]
    ce_kernels.ce_forward(raw, labels, out=tuple(t[2:7] for t in outs), block=128, tiles=2)
    for got, want in zip(outs, ce_kernels.ce_forward_ref(raw, labels)):
        assert (got[:2] == -7).all() and (got[7:] == -7).all()
        torch.testing.assert_close(got[2:7], want, rtol=1.3e-6, atol=1e-5)


def test_forward_split_fills_the_programs_and_covers_the_row():
    assert ce_kernels.forward_split(1024, 151_936) == (8, 10)  # 75 tiles of 2048 in splits of 8
    assert ce_kernels.forward_split(1, 151_936) == (1, 75)
    assert ce_kernels.forward_split(7, 1531, block=128, tiles=3) == (3, 4)
    assert ce_kernels.forward_split(7, 100, block=128, tiles=5) == (1, 1)
    for rows, vocab in ((15, 151_936), (300, 151_936), (64, 3001)):
        tiles, splits = ce_kernels.forward_split(rows, vocab)
        assert (splits - 1) * tiles * ce_kernels.BLOCK < vocab <= splits * tiles * ce_kernels.BLOCK


@pytest.mark.parametrize("device", kernel_devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("in_place", [False, True])
def test_backward_kernel_equals_its_twin(device, dtype, in_place, interpret):
    C, V = 6, 1531
    raw, labels = _logits(C, V, dtype, device, seed=1)
    raw[1, V // 2] = 30.0  # a huge logit, but within fp16
    g = torch.Generator().manual_seed(2)
    grad_ce = (torch.rand(C, generator=g) * (torch.arange(C) != 4)).to(device)  # weights; position 4 masked
    lse = ce_kernels.ce_forward_ref(raw, labels)[0]
    want = ce_kernels.ce_backward_ref(raw, lse, labels, grad_ce)
    logits = raw.clone()
    got = ce_kernels.ce_backward(logits, lse, labels, grad_ce, in_place=in_place, block=256)
    assert got.dtype == dtype and (got.data_ptr() == logits.data_ptr()) == in_place
    if not in_place:
        assert torch.equal(logits, raw)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2**-20, atol=2**-21)  # a few ulps of values ≤ 1
    else:
        assert _adjacent_or_equal(got, want), (got.float() - want.float()).abs().max()
    assert (got[4] == 0).all()  # a masked position: no gradient


@pytest.mark.parametrize("device", kernel_devices())
def test_a_nan_gradient_stays_nan_in_bf16(device, interpret):
    """The bf16 rounding's integer add must not carry a NaN (any sign or payload) into ±0 or inf."""
    raw, labels = _logits(4, 777, torch.bfloat16, device, seed=5)
    lse = ce_kernels.ce_forward_ref(raw, labels)[0]
    nans = torch.tensor([0x7FFFFFFF, -1, 0x7F800001, 0x7FC00000], dtype=torch.int32).view(
        torch.float32
    )  # -1: 0xFFFFFFFF
    got = ce_kernels.ce_backward(raw.clone(), lse, labels, nans.to(device), block=256)
    assert torch.isnan(got.float()).all()
    assert torch.isnan(ce_kernels.ce_backward_ref(raw, lse, labels, nans.to(device)).float()).all()


@pytest.mark.parametrize("device", kernel_devices())
def test_backward_kernel_takes_an_expanded_upstream_gradient(device, interpret):
    """``ce.sum().backward()`` hands the Function a stride-0 gradient."""
    raw, labels = _logits(4, 999, torch.bfloat16, device, seed=3)
    lse = ce_kernels.ce_forward_ref(raw, labels)[0]
    ones = torch.ones((), device=device).expand(4)
    got = ce_kernels.ce_backward(raw, lse, labels, ones, block=512)
    assert _adjacent_or_equal(got, ce_kernels.ce_backward_ref(raw, lse, labels, torch.ones(4, device=device)))


# ------------------------------------------------------------------------- the chunked path, fused
M, D, K = 45, 16, 4  # 45 positions: chunks of 7 and 16 leave a short last chunk


def _case(dtype, device, V=1531, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(3, 15, D, generator=g)
    weight = torch.randn(V, D, generator=g) / D**0.5 * 3
    bias = torch.randn(V, generator=g)
    labels = torch.randint(0, V, (3, 15), generator=g)
    upstream = torch.rand(3, 15, generator=g) * (torch.rand(3, 15, generator=g) > 0.2)
    hidden, weight, bias = (t.to(dtype).to(device) for t in (hidden, weight, bias))
    return hidden, weight, bias, labels.to(device), upstream.to(device)


def _run(fn, hidden, upstream):
    h = hidden.clone().requires_grad_(True)
    out = fn(h)
    (out.ce * upstream).sum().backward()
    return out, h.grad


def _plain(weight, bias, labels):
    def fn(h):
        raw = F.linear(h.to(weight.dtype), weight, bias)
        return head_outputs_from_logits(raw, raw.float(), labels, K)

    return fn


def _chunked(weight, bias, labels, chunk, fused, **kw):
    return lambda h: chunked_head_outputs(h, weight, bias, labels, chunk=chunk, top_k=K, fused=fused, **kw)


def _exact_hidden_gradient(hidden, weight, bias, labels, upstream):
    """d(Σ upstream · ce)/d hidden of the bf16 (head dtype) forward, in fp64 from its rounded logits on:
    (softmax(raw) − onehot) · upstream @ W, with raw = linear(hidden, W, b) as the head computes it."""
    raw = F.linear(hidden.to(weight.dtype), weight, bias).double()  # (..., V): the logits every path rounds to
    g = torch.softmax(raw, -1) - F.one_hot(labels, raw.shape[-1]).double()
    return (g * upstream.double()[..., None]) @ weight.double()


@pytest.mark.parametrize("device", kernel_devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [7, 16])
def test_fused_path_equals_the_plain_path_and_the_torch_passes(device, dtype, chunk, monkeypatch, interpret):
    hidden, weight, bias, labels, upstream = _case(dtype, device)
    calls = []
    for name in ("ce_forward", "ce_backward"):
        real = getattr(ce_kernels, name)
        monkeypatch.setattr(ce_kernels, name, lambda *a, _r=real, _n=name, **kw: calls.append(_n) or _r(*a, **kw))
    ref, ref_grad = _run(_plain(weight, bias, labels), hidden, upstream)
    torch_passes, torch_grad = _run(_chunked(weight, bias, labels, chunk, False), hidden, upstream)
    assert calls == []
    out, grad = _run(_chunked(weight, bias, labels, chunk, True), hidden, upstream)
    chunks = -(-M // chunk)
    assert calls == ["ce_forward"] * chunks + ["ce_backward"] * chunks  # the kernels did run
    # bf16 on a GPU: the kernel's exp (ex2.approx) is not torch's, so a few (softmax - onehot)·g entries round
    # to the adjacent bf16 value, and one such flip moves a hidden gradient by ~2^-9·|W| however small that
    # gradient is. There the check is against the exact gradient of the same bf16 forward (its bf16 logits
    # carried on in fp64): no farther from it than the torch passes (within 25%), and no element farther from
    # the torch passes' than 2^-8·max|W| (a couple of such flips)
    strict_grad = dtype == torch.float32 or device == "cpu"
    if dtype == torch.bfloat16:
        exact = _exact_hidden_gradient(hidden, weight, bias, labels, upstream)
        error = {name: ((g.double() - exact).norm() / exact.norm()).item() for name, g in
                 (("kernels", grad), ("torch passes", torch_grad))}  # fmt: skip
        assert error["kernels"] <= 1.25 * error["torch passes"], error
        assert (grad.float() - torch_grad.float()).abs().max() <= 2**-8 * weight.float().abs().max()
    tol = {} if dtype == torch.float32 else BF16_TOL
    for want, want_grad in ((ref, ref_grad), (torch_passes, torch_grad)):
        torch.testing.assert_close(out.ce, want.ce)
        if strict_grad:
            torch.testing.assert_close(grad, want_grad, **tol)
        assert torch.equal(out.argmax, want.argmax) and torch.equal(out.top_ids, want.top_ids)
        torch.testing.assert_close(out.top_raw, want.top_raw)
        torch.testing.assert_close(out.label_raw, want.label_raw)
    # the same chunk logits as the torch passes: what is read off them, exactly
    assert torch.equal(out.label_raw, torch_passes.label_raw) and torch.equal(out.top_raw, torch_passes.top_raw)
    assert grad.dtype == hidden.dtype and out.ce.shape == (3, 15) and out.top_ids.shape == (3, 15, K)


@pytest.mark.parametrize("device", kernel_devices())
def test_fused_path_with_kept_logits_equals_it_recomputing(device, interpret):
    """keep_logits with the kernels: backward writes the gradient over the kept logits instead of over a
    recompute of them; every output and the hidden gradient bit for bit (bf16 head)."""
    hidden, weight, bias, labels, upstream = _case(torch.bfloat16, device, seed=6)
    runs = [
        _run(_chunked(weight, bias, labels, 16, True, keep_logits=keep), hidden, upstream) for keep in (False, True)
    ]
    (ref, ref_grad), (out, grad) = runs
    for name in ("ce", "argmax", "top_ids", "top_raw", "label_raw"):
        assert torch.equal(getattr(out, name), getattr(ref, name)), name
    assert torch.equal(grad, ref_grad)


@pytest.mark.parametrize("device", kernel_devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_topk_kernel_gives_the_same_candidates_as_torch(device, dtype, monkeypatch, interpret):
    """topk_kernel (drafter.loss_topk_kernel): the candidates through the runtime's two-stage Triton top-k. The
    same top-k values, in order, as torch.topk; ids naming logits of those values, listed as the twin
    (a stable descending sort: ties by the lower index); every other output and the gradient bit for bit.
    bf16 logits of a small vocabulary tie often, so the tie order is exercised."""
    from dflash2.runtime.kernels import topk as topk_module

    hidden, weight, bias, labels, upstream = _case(dtype, device, seed=7)
    calls = []
    real = topk_module.topk_rows
    monkeypatch.setattr(topk_module, "topk_rows", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    ref, ref_grad = _run(_chunked(weight, bias, labels, 16, True), hidden, upstream)
    out, grad = _run(_chunked(weight, bias, labels, 16, True, topk_kernel=True), hidden, upstream)
    assert len(calls) == -(-M // 16)  # once per chunk
    assert torch.equal(out.top_raw, ref.top_raw)
    raw = F.linear(hidden.to(weight.dtype), weight, bias)
    assert torch.equal(raw.gather(-1, out.top_ids), out.top_raw)  # each id holds its value
    _, twin_ids = topk_module.topk_rows_ref(raw, K)
    assert torch.equal(out.top_ids, twin_ids)
    for name in ("ce", "argmax", "label_raw"):
        assert torch.equal(getattr(out, name), getattr(ref, name)), name
    assert torch.equal(grad, ref_grad)


@pytest.mark.parametrize("device", kernel_devices())
def test_fused_path_under_autocast_and_with_a_scalar_loss(device, interpret):
    """An fp32 head under bf16 autocast (bf16-mixed): the chunks compute in bf16, also the recompute in
    backward; ``ce.sum()``'s expanded gradient. Against the torch passes."""
    hidden, weight, bias, labels, _ = _case(torch.float32, device, V=1001, seed=4)
    grads = {}
    for fused in (False, True):
        h = hidden.clone().requires_grad_(True)
        with torch.autocast(device, dtype=torch.bfloat16):
            out = chunked_head_outputs(h, weight, bias, labels, chunk=16, top_k=K, fused=fused)
        out.ce.sum().backward()
        grads[fused] = out, h.grad
    (want, want_grad), (out, grad) = grads[False], grads[True]
    assert out.label_raw.dtype == torch.bfloat16 and torch.equal(out.label_raw, want.label_raw)
    torch.testing.assert_close(out.ce, want.ce)
    torch.testing.assert_close(grad, want_grad, **BF16_TOL)


@pytest.mark.parametrize("scale", [(0.7, None), (1.0, 3.0)], ids=["multiplier", "softcap"])
def test_serving_scales_keep_the_torch_passes(scale, monkeypatch, caplog):
    """With serving scales fused=True is the torch passes, bit for bit, said once in the log."""
    import dflash2.training.chunked_head as chunked_head

    hidden, weight, bias, labels, upstream = _case(torch.float32, "cpu", V=501)
    monkeypatch.setattr(ce_kernels, "ce_forward", None)  # a call would fail
    monkeypatch.setattr(chunked_head, "_NOTED", set())
    mult, cap = scale
    with caplog.at_level(logging.INFO, logger="dflash2.training.chunked_head"):
        runs = [
            _run(_chunked(weight, bias, labels, 7, fused, multiplier=mult, softcap=cap), hidden, upstream)
            for fused in (False, True, True)
        ]
    (want, want_grad), (out, grad) = runs[0], runs[1]
    assert torch.equal(out.ce, want.ce) and torch.equal(grad, want_grad)
    assert [r.message for r in caplog.records].count(
        f"drafter.loss_kernels: the drafter has serving scales (output_multiplier={mult}, "
        f"final_logit_softcapping={cap}); the chunked CE keeps its torch passes"
    ) == 1


def test_where_the_kernels_cannot_run_fused_is_the_torch_passes(monkeypatch):
    """CPU tensors outside ``on_cpu()`` (a CPU training run) and, under the interpreter, DFLASH2_TRITON=0
    (``kernels(False)``): the torch passes, bit for bit."""
    import os

    from dflash2.runtime import kernels

    hidden, weight, bias, labels, upstream = _case(torch.float32, "cpu", V=501)
    monkeypatch.setattr(ce_kernels, "ce_forward", None)  # a call would fail
    want = _run(_chunked(weight, bias, labels, 7, False), hidden, upstream)
    runs = [_run(_chunked(weight, bias, labels, 7, True), hidden, upstream)]
    if os.environ.get("TRITON_INTERPRET") == "1":
        with kernels.on_cpu(), kernels.kernels(False):
            runs.append(_run(_chunked(weight, bias, labels, 7, True), hidden, upstream))
    for out, grad in runs:
        assert torch.equal(out.ce, want[0].ce) and torch.equal(grad, want[1])


# ---------------------------------------------------------------------------- the training switch
def test_the_switch_is_on_in_every_drafter_config_and_no_config_sets_serving_scales():
    """The key and the scales are set in drafter/dflash.yaml only, which every other drafter config extends
    (tests/test_configs.py composes them all): the kernels are on (since stop 19), and apply to every shipped drafter.
    The override composes into the settings the training module is built from."""
    import yaml

    from dflash2.training.cli import CONFIG_DIR
    from dflash2.training.throughput_setup import drafter_settings

    base = yaml.safe_load((Path(CONFIG_DIR) / "drafter" / "dflash.yaml").read_text())
    assert base["loss_kernels"] is True
    assert base["output_multiplier"] == 1.0 and base["final_logit_softcapping"] is None
    for path in sorted((Path(CONFIG_DIR) / "drafter").glob("*.yaml")):
        if path.name != "dflash.yaml":
            cfg = yaml.safe_load(path.read_text())
            assert cfg["defaults"][0] == "dflash", path.name
            assert not {"loss_kernels", "output_multiplier", "final_logit_softcapping"} & set(cfg), path.name
    assert drafter_settings("dflash2", {"loss_kernels": "false"})["loss_kernels"] is False


def _module_and_batch(make_spec_target, make_spec_drafter, loss_kernels):
    from conftest import nontrivial_dflash2

    from dflash2.training.train_drafter import training_module

    target = make_spec_target("qwen3")
    drafter = nontrivial_dflash2(make_spec_drafter(target, 4, v2=True))
    settings = dict(num_anchors=5, loss_gamma=4.0, selector_loss_weight=1.0, lr=1e-3, weight_decay=0.0)
    settings.update(warmup_ratio=0.0, selector_gold_injection=True, loss_kernels=loss_kernels)
    module = training_module(
        copy.deepcopy(drafter), target, settings, total_steps=1, seed=0, target_id="t", loss_chunk=7, attention="dense"
    )
    ids = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    return module, {"input_ids": ids, "loss_mask": (torch.arange(24) >= 8).long().expand(2, 24)}


@pytest.mark.parametrize("device", kernel_devices())
def test_a_training_step_with_the_kernels_equals_the_torch_passes(
    device, make_spec_target, make_spec_drafter, monkeypatch, interpret
):
    """One block_outputs + backward of the training module built from the drafter settings (DFlash2: the
    selector reads the top-k and the label's logit), drafter.loss_kernels on against off: losses,
    predictions, the selector's path, every parameter gradient; the kernels ran."""
    from dflash2.drafter.objective import anchor_generator
    from dflash2.training import drafter_module

    fused_flags, kernel_calls = [], []
    real = drafter_module.chunked_head_outputs
    monkeypatch.setattr(
        drafter_module, "chunked_head_outputs", lambda *a, **kw: fused_flags.append(kw["fused"]) or real(*a, **kw)
    )
    real_forward = ce_kernels.ce_forward
    monkeypatch.setattr(ce_kernels, "ce_forward", lambda *a, **kw: kernel_calls.append(1) or real_forward(*a, **kw))
    outs, grads = {}, {}
    for flag in (False, True):
        module, batch = _module_and_batch(make_spec_target, make_spec_drafter, flag)
        module.to(device)
        module._sync_target_device()
        batch = {k: v.to(device) for k, v in batch.items()}
        assert module.loss_kernels is flag and module.with_drafter(module.drafter).loss_kernels is flag
        out = module.block_outputs(batch, anchor_generator(0, 0))
        out["loss"].backward()
        outs[flag] = out
        grads[flag] = {n: p.grad for n, p in module.drafter.named_parameters() if p.grad is not None}
    assert fused_flags == [False, True] and kernel_calls  # the switch reached the chunks, which used the kernels
    for key in ("loss", "ce", "selector_loss"):
        torch.testing.assert_close(outs[True][key], outs[False][key])
    for key in ("predictions", "selector_predictions"):
        assert torch.equal(outs[True][key], outs[False][key]), key
    assert grads[True].keys() == grads[False].keys()
    for name in grads[False]:
        torch.testing.assert_close(grads[True][name], grads[False][name], msg=name)


def test_a_bad_switch_is_a_one_line_error():
    from dflash2.errors import DFlash2Error
    from dflash2.training.preflight import check_loss_kernels, check_loss_topk_kernel

    assert check_loss_kernels(None) is False and check_loss_kernels(True) is True
    with pytest.raises(DFlash2Error, match=r"drafter\.loss_kernels='yes' must be true or false"):
        check_loss_kernels("yes")
    assert check_loss_topk_kernel(None) is False and check_loss_topk_kernel(True) is True
    with pytest.raises(DFlash2Error, match=r"drafter\.loss_topk_kernel=1 must be true or false"):
        check_loss_topk_kernel(1)


@pytest.mark.parametrize("device", kernel_devices())
def test_drafter_loss_topk_kernel_reaches_the_chunks_and_changes_no_value(
    device, make_spec_target, make_spec_drafter, monkeypatch, interpret
):
    """drafter.loss_topk_kernel through training_module: the chunked head gets topk_kernel, the Triton top-k
    runs, and a training step's losses, predictions and gradients equal the torch.topk run's (fp32 logits of
    a random drafter: no ties among its candidates)."""
    from conftest import nontrivial_dflash2, training_step

    from dflash2.runtime.kernels import topk as topk_module
    from dflash2.training import drafter_module

    flags, calls = [], []
    real = drafter_module.chunked_head_outputs
    monkeypatch.setattr(
        drafter_module, "chunked_head_outputs", lambda *a, **kw: flags.append(kw["topk_kernel"]) or real(*a, **kw)
    )
    real_topk = topk_module.topk_rows
    monkeypatch.setattr(topk_module, "topk_rows", lambda *a, **kw: calls.append(1) or real_topk(*a, **kw))
    target = make_spec_target("qwen3")
    drafter = nontrivial_dflash2(make_spec_drafter(target, 4, v2=True))
    outs, grads = {}, {}
    for flag in (False, True):
        module, outs[flag], grads[flag] = training_step(
            target, drafter, device, loss_kernels=True, loss_topk_kernel=flag
        )
        assert module.loss_topk_kernel is flag and module.with_drafter(module.drafter).loss_topk_kernel is flag
    assert flags == [False, True] and calls
    for key in ("loss", "ce", "selector_loss", "predictions", "selector_predictions"):
        assert torch.equal(outs[True][key], outs[False][key]), key
    for name in grads[False]:
        assert torch.equal(grads[True][name], grads[False][name]), name


# ---------------------------------------------------------------------------------------------- GPU
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_on_cuda_the_kernels_equal_their_twins_at_a_vocabulary_of_qwen3(dtype):
    """C = 300 rows of V = 151,936 (the default split: 4 tiles per program); the compiled kernels."""
    C, V = 300, 151_936
    raw, labels = _logits(C, V, dtype, "cuda", seed=5)
    lse, ce, argmax, label_raw = ce_kernels.ce_forward(raw, labels)
    want_lse, want_ce, want_argmax, want_label = ce_kernels.ce_forward_ref(raw, labels)
    assert torch.equal(argmax, want_argmax) and torch.equal(label_raw, want_label)
    torch.testing.assert_close(lse, want_lse)
    torch.testing.assert_close(ce, want_ce)
    grad_ce = torch.rand(C, device="cuda")
    got = ce_kernels.ce_backward(raw.clone(), want_lse, labels, grad_ce, in_place=True)
    want = ce_kernels.ce_backward_ref(raw, want_lse, labels, grad_ce)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2**-20, atol=2**-21)
    else:
        assert _adjacent_or_equal(got, want), (got.float() - want.float()).abs().max()


@pytest.mark.cuda
def test_on_cuda_the_fused_path_equals_the_torch_passes():
    g = torch.Generator().manual_seed(6)
    m, d, v, chunk = 2048, 256, 151_936 // 8, 512
    hidden = torch.randn(m, d, generator=g).bfloat16().cuda()
    weight = (torch.randn(v, d, generator=g) / d**0.5 * 3).bfloat16().cuda()
    labels = torch.randint(0, v, (m,), generator=g).cuda()
    upstream = torch.rand(m, generator=g).cuda()
    runs = [_run(_chunked(weight, None, labels, chunk, fused), hidden, upstream) for fused in (False, True)]
    (want, want_grad), (out, grad) = runs
    torch.testing.assert_close(out.ce, want.ce)
    assert torch.equal(out.argmax, want.argmax) and torch.equal(out.label_raw, want.label_raw)
    assert torch.equal(out.top_ids, want.top_ids)
    torch.testing.assert_close(grad, want_grad, **BF16_TOL)
