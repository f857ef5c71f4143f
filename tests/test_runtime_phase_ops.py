"""The phase op counter (dflash2.runtime.phase_ops): what it counts, and that every phase of both steps is seen."""

import torch

from dflash2.runtime.phase_ops import OpCounter, build_pair, count_phases, op_kind, report


def test_views_and_allocations_are_not_kernels():
    assert op_kind(torch.ops.aten.view.default) == "view"
    assert op_kind(torch.ops.aten.transpose.int) == "view"
    assert op_kind(torch.ops.aten.empty.memory_format) == "alloc"
    assert op_kind(torch.ops.aten._local_scalar_dense.default) == "sync"
    for op in (torch.ops.aten.mm.default, torch.ops.aten.add_.Tensor, torch.ops.aten.scatter_.src):
        assert op_kind(op) == "kernel"
    counter = OpCounter()
    with counter:
        x = torch.ones(4, 4)
        (x.t() @ x).view(16).add_(1)
    counter.done("phase")
    assert counter.phases["phase"].ops == {"ones": 1, "mm": 1, "add_": 1}


def test_every_phase_of_both_steps_is_counted():
    target, drafter = build_pair("tiny", torch.float32)
    ar = count_phases(target, drafter, spec=False, steps=2, batch=1, prompt=8)
    spec = count_phases(target, drafter, spec=True, steps=2, batch=2, prompt=8)
    assert ar.steps == 2 and 1 <= spec.steps <= 2  # a step emits ≥ 1 token: a budget of 3 is ≤ 2 steps
    assert {"verify", "accept", "commit"} <= set(ar.phases) and "draft" not in ar.phases
    assert {"draft", "verify", "accept", "commit"} <= set(spec.phases)
    for phase in ("draft", "verify", "accept", "commit"):
        assert spec.phases[phase].total > 0 and spec.phases[phase].syncs == 0  # no host read inside a phase
    scopes = spec.phases["draft"].scopes
    assert {s for s in scopes if s and s.startswith("drafter layer")} == {"drafter layer 0", "drafter layer 1"}
    assert any(s and s.startswith("target linear_attention") for s in spec.phases["verify"].scopes)
    # the drafter's context K/V are written inside the verify (engine._verify), the commit only advances lengths
    assert spec.phases["verify"].scopes["drafter context"] > 0 and "drafter context" not in spec.phases["commit"].scopes
    # the tiny drafter's 2 layers × 2 conv'd sublayers per draft: 4 pre-convs, 4 post-convs each in the launch of
    # the next norm (the last one the final norm's) and 1 plain norm, the first layer's (no residual yet): 9
    # launches where the post-convs on their own took 13
    ops, S = spec.phases["draft"].ops, spec.steps
    assert ops["cuda:local_conv_ref"] == 4 * S and ops["cuda:conv_add_rms_norm_fp32w_ref"] == 4 * S
    assert ops["cuda:add_rms_norm_fp32w_ref"] == S
    # twins of fused CUDA kernels count as their launches: fewer ops than counted one by one
    raw = count_phases(target, drafter, spec=True, steps=2, batch=2, prompt=8, raw=True)
    assert raw.phases["verify"].total > spec.phases["verify"].total
    assert raw.phases["draft"].total >= spec.phases["draft"].total
    assert "draft" in "\n".join(report("spec", spec, top=3))


def test_taps_cost_the_target_forward_no_op():
    """A target forward with taps runs exactly the ops of one without: each tapped layer's output is stored into
    its taps slice by the residual norm that adds it anyway (the next layer's first, or the final norm:
    models/base.py ``_tap``), not by an add of its own (5 ``add`` per speculative verify at the small shape's 5
    taps before). Taps not at the last layer, at it, and both; a block of 4 and a prefill with logits_index.
    Counted raw (the twins' own ops): the fused norm's residual add shows as an ``add`` in both forwards."""
    target, _ = build_pair("tiny", torch.float32)
    L = target.num_layers
    tokens = torch.randint(0, 200, (2, 4), generator=torch.Generator().manual_seed(0))
    for tap_ids in ([1], [L - 1], [0, 2, L - 1]):
        target.set_taps(tap_ids)
        for index in (None, torch.tensor([3, 1])):
            counts = []
            for taps in (True, False):
                state = target.new_state(2, 16)
                counter = OpCounter()
                with counter:
                    out = target(tokens, state, logits_index=index, taps=taps)
                counter.done("forward")
                assert (out.taps is not None) == taps
                counts.append(counter.phases["forward"].ops)
            if index is not None and L - 1 in tap_ids:
                # the final norm sees one position per row there, the last tap needs all T: a plain add writes
                # it (base._logits), the norm then gathers that sum alone, not h and delta: one gather fewer
                counts[1]["gather"] -= 1
            assert counts[0] == counts[1], (tap_ids, index)
