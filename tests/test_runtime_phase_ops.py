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
