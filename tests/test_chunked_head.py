"""The chunked loss through the frozen LM head (issue 15, dflash2/training/chunked_head.py) against the
plain path from full logits: values, gradients, the selector's candidates, memory, and training.

Tolerances: fp32 comparisons use torch's fp32 defaults (rtol 1.3e-6, atol 1e-5), i.e. a few ulps of
the values compared. That much differs legitimately: BLAS picks its blocking by the row count, so a
row's logits from a (C, V) matmul can differ from the same row's in an (M, V) one by an ulp, and
logsumexp - z[y] sums in another order than log_softmax. A real mistake (a missing scale factor, a
wrong label, a chunk boundary off by one) is off by orders of magnitude more.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from dflash2.drafter.objective import anchor_generator, position_weights, weighted_position_loss
from dflash2.drafter.selector import scale_logits
from dflash2.training.chunked_head import chunked_head_outputs, head_outputs_from_logits

# Leading shape (N, A, P) = 3 x 5 x 3: M = 45 positions.
N, A, P, D, V, K = 3, 5, 3, 8, 97, 4
M = N * A * P
SCALES = {"none": (1.0, None), "multiplier": (0.7, None), "softcap": (1.3, 2.0)}


def _case(seed: int = 0, bias: bool = True):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, A, P, D, generator=g)
    weight = torch.randn(V, D, generator=g) / D**0.5 * 3  # logits of std ~3: a peaked softmax, as trained
    b = torch.randn(V, generator=g) if bias else None
    labels = torch.randint(0, V, (N, A, P), generator=g)
    mask = torch.rand(N, A, P, generator=g) > 0.2
    return hidden, weight, b, labels, mask


def _plain(hidden, weight, bias, labels, multiplier, softcap, top_k=K):
    raw = F.linear(hidden.to(weight.dtype), weight, bias)  # what TargetModel.head_logits computes
    return head_outputs_from_logits(raw, scale_logits(raw, multiplier, softcap), labels, top_k)


def _loss_and_grad(fn, hidden, labels_mask):
    """The training loss (weighted CE over the valid positions) and its gradient w.r.t. hidden."""
    h = hidden.detach().clone().requires_grad_(True)
    out = fn(h)
    loss = weighted_position_loss(out.ce, labels_mask, position_weights(P + 1, 4.0))
    loss.backward()
    return out, loss, h.grad


@pytest.mark.parametrize("scale", sorted(SCALES))
@pytest.mark.parametrize("chunk", [1, 7, M, M + 13])  # 7 does not divide 45; M + 13: one chunk, larger than M
def test_values_gradients_and_candidates_equal_the_plain_path(scale, chunk):
    hidden, weight, bias, labels, mask = _case()
    mult, cap = SCALES[scale]
    ref, ref_loss, ref_grad = _loss_and_grad(lambda h: _plain(h, weight, bias, labels, mult, cap), hidden, mask)
    out, loss, grad = _loss_and_grad(
        lambda h: chunked_head_outputs(h, weight, bias, labels, chunk=chunk, top_k=K, multiplier=mult, softcap=cap),
        hidden,
        mask,
    )
    torch.testing.assert_close(out.ce, ref.ce)
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(grad, ref_grad)
    # what the metrics and the selector read: ids exactly (no near-ties in these logits), values to fp32 rounding
    assert torch.equal(out.argmax, ref.argmax) and torch.equal(out.top_ids, ref.top_ids)
    torch.testing.assert_close(out.top_raw, ref.top_raw)
    torch.testing.assert_close(out.label_raw, ref.label_raw)
    assert out.ce.shape == (N, A, P) and out.top_ids.shape == (N, A, P, K)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", sorted(SCALES))
def test_kept_logits_give_the_recomputing_path_bit_for_bit(scale, dtype):
    """keep_logits (drafter.loss_keep_logits): the forward's chunk logits used in backward instead of a
    recompute of the same matmul: every output and the gradient bit for bit; backward consumes them (a second
    backward through the graph is refused); without a backward to come (no_grad) nothing is kept."""
    hidden, weight, bias, labels, mask = _case(seed=2)
    weight, bias = weight.to(dtype), bias.to(dtype)
    mult, cap = SCALES[scale]
    runs = {}
    for keep in (False, True):
        fn = lambda h, keep=keep: chunked_head_outputs(
            h, weight, bias, labels, chunk=7, top_k=K, multiplier=mult, softcap=cap, keep_logits=keep
        )
        runs[keep] = _loss_and_grad(fn, hidden, mask)
    (ref, ref_loss, ref_grad), (out, loss, grad) = runs[False], runs[True]
    for name in ("ce", "argmax", "top_ids", "top_raw", "label_raw"):
        assert torch.equal(getattr(out, name), getattr(ref, name)), name
    assert torch.equal(loss, ref_loss) and torch.equal(grad, ref_grad)
    h = hidden.detach().clone().requires_grad_(True)
    twice = chunked_head_outputs(
        h, weight, bias, labels, chunk=7, top_k=K, multiplier=mult, softcap=cap, keep_logits=True
    )
    twice.ce.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="already consumed the kept logits"):
        twice.ce.sum().backward()


def test_nothing_is_kept_without_a_backward_to_come(monkeypatch):
    from dflash2.training import chunked_head

    hidden, weight, bias, labels, _ = _case()
    seen = []
    real = chunked_head._ChunkedHeadCE.apply
    # the keep argument: second to last (the last is topk_kernel)
    monkeypatch.setattr(chunked_head._ChunkedHeadCE, "apply", lambda *a: seen.append(a[-2]) or real(*a))
    with torch.no_grad():
        chunked_head_outputs(hidden, weight, bias, labels, chunk=7, top_k=K, keep_logits=True)
    chunked_head_outputs(hidden, weight, bias, labels, chunk=7, top_k=K, keep_logits=True)  # no requires_grad
    chunked_head_outputs(hidden.requires_grad_(True), weight, bias, labels, chunk=7, top_k=K, keep_logits=True)
    assert seen == [False, False, True]


def test_the_gradient_of_each_position_is_its_own_upstream_gradient_times_the_ce_gradient():
    """Any upstream gradient (not only the loss's weights) and no bias: d(Σ g_m ce_m)/dh, chunks of 4."""
    hidden, weight, _, labels, _ = _case(seed=1, bias=False)
    upstream = torch.randn(N, A, P, generator=torch.Generator().manual_seed(5))
    grads = []
    for fn in (
        lambda h: _plain(h, weight, None, labels, 1.3, 2.0).ce,
        lambda h: chunked_head_outputs(h, weight, None, labels, chunk=4, multiplier=1.3, softcap=2.0).ce,
    ):
        h = hidden.clone().requires_grad_(True)
        (fn(h) * upstream).sum().backward()
        grads.append(h.grad)
    torch.testing.assert_close(grads[1], grads[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", sorted(SCALES))
def test_the_served_logits_are_scale_logits_bit_for_bit(dtype, scale):
    """The chunks' in-place version of the serving scales gives the plain path's values exactly, and never
    writes into the raw logits (the top-k and argmax are read from them)."""
    from dflash2.training.chunked_head import _served_logits

    raw = (3 * torch.randn(6, V, generator=torch.Generator().manual_seed(2))).to(dtype)
    before = raw.clone()
    z, t = _served_logits(raw, *SCALES[scale])
    assert torch.equal(z, scale_logits(raw, *SCALES[scale])) and z.dtype == torch.float32
    assert torch.equal(raw, before) and (t is None) == (SCALES[scale][1] is None)


def test_no_gradient_reaches_the_head_and_only_the_ce_is_differentiable():
    hidden, weight, bias, labels, _ = _case()
    weight.requires_grad_(True)
    bias.requires_grad_(True)
    h = hidden.clone().requires_grad_(True)
    out = chunked_head_outputs(h, weight, bias, labels, chunk=7, top_k=K)
    assert out.ce.requires_grad
    assert not any(t.requires_grad for t in (out.argmax, out.top_ids, out.top_raw, out.label_raw))
    out.ce.sum().backward()
    assert h.grad is not None and weight.grad is None and bias.grad is None


def test_no_top_k_and_bad_chunks():
    hidden, weight, bias, labels, _ = _case()
    out = chunked_head_outputs(hidden, weight, bias, labels, chunk=7)
    assert out.top_ids.shape == (N, A, P, 0) and out.top_raw.shape == (N, A, P, 0)
    with pytest.raises(ValueError, match="chunk=0"):
        chunked_head_outputs(hidden, weight, bias, labels, chunk=0)


class _Recorder(TorchDispatchMode):
    """Sees every aten op run inside it, forward and backward (autograd carries the mode into backward):
    records the largest number of elements of any tensor an op returns, and the dtypes matmuls return."""

    MATMULS = frozenset({torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default})

    def __init__(self):
        super().__init__()
        self.largest, self.matmul_dtypes = 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
                if func in self.MATMULS:
                    self.matmul_dtypes.add(t.dtype)
        return out


def _capped_head(weight, bias, labels, chunk):
    """hidden -> HeadOutputs with multiplier 1.3 and softcap 2: the plain path (chunk 0) or the chunked one."""
    if chunk == 0:
        return lambda h: _plain(h, weight, bias, labels, 1.3, 2.0)
    return lambda h: chunked_head_outputs(h, weight, bias, labels, chunk=chunk, top_k=K, multiplier=1.3, softcap=2.0)


def test_a_bf16_head_and_cpu_autocast_compute_in_bf16_as_the_plain_path():
    """The head in bf16 (a bf16 target), and an fp32 head under bf16 autocast (bf16-mixed): every head
    matmul of the chunked pass, also those recomputed in backward outside the caller's autocast, runs in
    bf16 as the plain path's do, and the results agree. Tolerance: one bf16 ulp (2^-7 relative), so that
    a rare rounding flip of a bf16 logit or gradient between blockings does not fail the test (measured
    here: equal gradients, CE within 5e-7); an fp32 recompute in backward is ~6e-3 relative off."""
    hidden, weight, bias, labels, mask = _case()
    tol = dict(rtol=2**-7, atol=1e-5)
    for name, w, b, autocast in (
        ("bf16 head", weight.bfloat16(), bias.bfloat16(), False),
        ("autocast", weight, bias, True),
    ):
        runs, matmuls = {}, {}
        for chunk in (0, 7):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), _Recorder() as probe:
                runs[chunk] = _loss_and_grad(_capped_head(w, b, labels, chunk), hidden, mask)
            matmuls[chunk] = probe.matmul_dtypes
        assert matmuls[7] == matmuls[0] == {torch.bfloat16}, (name, matmuls)
        (ref, ref_loss, ref_grad), (out, loss, grad) = runs[0], runs[7]
        assert out.top_raw.dtype == ref.top_raw.dtype == torch.bfloat16, name
        torch.testing.assert_close(out.ce, ref.ce, **tol)
        torch.testing.assert_close(loss, ref_loss, **tol)
        torch.testing.assert_close(grad, ref_grad, **tol)


# ------------------------------------------------------------------------------------------ memory
def _peak_cpu_bytes(fn) -> int:
    """Peak of live CPU-allocator bytes while fn() runs, above what was live before: the running sum of the
    profiler's allocation and free records ([memory] events, profile_memory=True), in time order."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    if not events:
        pytest.skip("this torch's profiler records no CPU allocations")
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


MEM_M, MEM_V, MEM_D, MEM_CHUNK = 600, 2000, 16, 50


def _memory_case():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(MEM_M, MEM_D, generator=g)
    weight = torch.randn(MEM_V, MEM_D, generator=g)
    labels = torch.randint(0, MEM_V, (MEM_M,), generator=g)
    return hidden, weight, labels


def _step(fn, hidden):
    h = hidden.clone().requires_grad_(True)
    out = fn(h)
    out.ce.mean().backward()
    return h.grad


def test_the_chunked_pass_never_makes_a_tensor_of_more_than_one_chunk_of_logits():
    hidden, weight, labels = _memory_case()
    seen = {}
    for name, fn in (
        ("plain", lambda h: _plain(h, weight, None, labels, 1.3, 2.0)),
        (
            "chunked",
            lambda h: chunked_head_outputs(
                h, weight, None, labels, chunk=MEM_CHUNK, top_k=K, multiplier=1.3, softcap=2.0
            ),
        ),
    ):
        with _Recorder() as probe:
            _step(fn, hidden)
        seen[name] = probe.largest
    assert seen["plain"] >= MEM_M * MEM_V  # the probe does see the full logits where they exist
    assert seen["chunked"] == MEM_CHUNK * MEM_V


@pytest.mark.parametrize("scale,chunks", [("none", 2), ("softcap", 3)])
def test_peak_memory_is_a_few_chunks_of_logits_not_all_positions(scale, chunks):
    """fp32 head: at most `chunks` (C, V) fp32 tensors live at once (unscaled: the logits and logsumexp's
    temporary; capped: the logits, tanh and the served logits), plus O(M·(d + k)) for the hidden states,
    their gradient, top-k, CE and log-sum-exp. The plain path holds (M, V) several times over."""
    hidden, weight, labels = _memory_case()
    mult, cap = SCALES[scale]
    plain = _peak_cpu_bytes(lambda: _step(lambda h: _plain(h, weight, None, labels, mult, cap), hidden))
    chunked = _peak_cpu_bytes(
        lambda: _step(
            lambda h: chunked_head_outputs(
                h, weight, None, labels, chunk=MEM_CHUNK, top_k=K, multiplier=mult, softcap=cap
            ),
            hidden,
        )
    )
    chunk_logits, all_logits = 4 * MEM_CHUNK * MEM_V, 4 * MEM_M * MEM_V
    per_position = 4 * MEM_M * (4 * MEM_D + 4 * K + 16)  # hidden, its grad and copies; top-k; ce, lse, ids
    assert plain >= 2 * all_logits
    assert chunked <= chunks * chunk_logits + per_position, (chunked, chunk_logits)
    assert chunked < plain / 8


# ------------------------------------------------------------------------------- training module
def _scaled_v2_drafter(make_spec_drafter, target, block_size: int):
    """A DFlash2 drafter off its init with the serving scales set (multiplier and softcap, §3.4)."""
    from conftest import nontrivial_dflash2

    from dflash2.drafter import DFlashDrafter

    base = make_spec_drafter(target, block_size, v2=True)
    config = dataclasses.replace(base.config, output_multiplier=0.8, final_logit_softcapping=3.0)
    torch.manual_seed(1)
    return nontrivial_dflash2(DFlashDrafter(config))


@pytest.mark.parametrize("inject_gold", [False, True])
def test_a_training_step_is_the_same_with_the_chunked_loss(make_spec_target, make_spec_drafter, inject_gold):
    """One block_outputs + backward of the training module, chunked (5 positions, not dividing N·A·P)
    against the plain path: losses, metrics' predictions, the selector's path and loss, and every
    parameter gradient of the drafter."""
    from dflash2.training.drafter_module import DrafterTrainingModule

    target = make_spec_target("qwen3")
    drafter = _scaled_v2_drafter(make_spec_drafter, target, 4)
    kw = dict(num_anchors=5, loss_gamma=4.0, selector_loss_weight=1.0, lr=1e-3, weight_decay=0.0)
    kw.update(warmup_ratio=0.0, total_steps=1, seed=0, selector_gold_injection=inject_gold)
    ids = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "loss_mask": (torch.arange(24) >= 8).long().expand(2, 24)}
    outs, grads = {}, {}
    for chunk in (0, 5):
        module = DrafterTrainingModule(copy.deepcopy(drafter), target, loss_chunk_positions=chunk, **kw)
        out = module.block_outputs(batch, anchor_generator(0, 0))
        out["loss"].backward()
        outs[chunk] = out
        grads[chunk] = {n: p.grad for n, p in module.drafter.named_parameters() if p.grad is not None}
    plain, chunked = outs[0], outs[5]
    for key in ("loss", "ce", "selector_loss"):
        torch.testing.assert_close(chunked[key], plain[key])
    for key in ("predictions", "selector_predictions"):
        assert torch.equal(chunked[key], plain[key]), key
    for name in plain["selector_stats"]:
        torch.testing.assert_close(chunked["selector_stats"][name], plain["selector_stats"][name])
    assert float(plain["selector_stats"]["coverage"]) < 1.0  # some labels outside the top-k: gold matters
    assert grads[5].keys() == grads[0].keys() and any(n.startswith("candidate_selector") for n in grads[0])
    for name in grads[0]:
        torch.testing.assert_close(grads[5][name], grads[0][name], msg=name)


def test_a_negative_chunk_is_refused(make_spec_target, make_spec_drafter):
    from dflash2.errors import DFlash2Error
    from dflash2.training.drafter_module import DrafterTrainingModule

    target = make_spec_target("qwen3")
    kw = dict(num_anchors=4, loss_gamma=4.0, selector_loss_weight=1.0, lr=1e-3, weight_decay=0.0)
    kw.update(warmup_ratio=0.0, total_steps=1, seed=0)
    with pytest.raises(DFlash2Error, match="loss_chunk_positions=-1 must be an integer >= 0"):
        DrafterTrainingModule(make_spec_drafter(target, 4), target, loss_chunk_positions=-1, **kw)


@pytest.mark.slow
def test_a_short_run_has_the_same_losses_with_the_option_on_and_off(tmp_path, micro_train_overrides, monkeypatch):
    """`python train.py` on the micro target, 6 steps, the default DFlash2 drafter, same seed: the chunked
    loss (7 positions a chunk, not dividing the 4 x 6 x 7 positions of a step) against the plain path.
    Measured: equal to 1e-7 relative after 6 AdamW steps; 1e-5 leaves room for other BLAS blockings."""
    from test_train_drafter import compose_run, train_losses

    import dflash2.training.drafter_module as drafter_module
    from dflash2.training.run import run_from_config

    calls = []
    real = drafter_module.chunked_head_outputs
    monkeypatch.setattr(
        drafter_module, "chunked_head_outputs", lambda *a, **kw: calls.append(kw["chunk"]) or real(*a, **kw)
    )
    losses, used = {}, {}
    for chunk in (0, 7):
        name = f"chunk{chunk}"
        calls.clear()
        run_from_config(compose_run(tmp_path, [*micro_train_overrides, f"drafter.loss_chunk_positions={chunk}"], name))
        losses[chunk], used[chunk] = train_losses(tmp_path / name), set(calls)
    assert used == {0: set(), 7: {7}}  # the option reaches the training module, and 0 is the plain path
    assert sorted(losses[0]) == list(range(6)) and sorted(losses[7]) == list(range(6))
    for step in range(6):
        assert losses[7][step] == pytest.approx(losses[0][step], rel=1e-5), step
