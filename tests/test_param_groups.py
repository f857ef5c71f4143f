"""The drafter's optimizer groups in module order, and older two-group checkpoints (param_groups.py).

Lightning's FSDP strategy resumes a one-device or DDP checkpoint by labelling its optimizer states
with torch's ``FSDP.rekey_optim_state_dict(..., PARAM_NAME, model)``, which numbers parameters in the
module's order. That function runs on the CPU, so the pairing it makes is checked here against the
real module; the GPU end of it (an FSDP run resuming such a checkpoint) is tests/test_gpu_strategies.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import OptimStateKeyType

from dflash2.errors import DFlash2Error
from dflash2.training.param_groups import PARAM_ORDER, check_param_order, decay_runs
from dflash2.training.schedule import cosine_with_warmup


@pytest.fixture
def module(make_spec_target, make_spec_drafter):
    from dflash2.training.drafter_module import DrafterTrainingModule

    target = make_spec_target("qwen3")
    return DrafterTrainingModule(
        make_spec_drafter(target, 4, v2=True), target, num_anchors=2, loss_gamma=4.0, selector_loss_weight=1.0,
        lr=1e-3, weight_decay=0.1, warmup_ratio=0.5, total_steps=8, seed=0,
    )  # fmt: skip


def take_steps(optimizer, scheduler, params, steps=2, seed=0):
    """AdamW steps with a distinct, reproducible gradient for every parameter."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        optimizer.step()
        scheduler.step()


def test_decay_runs_are_maximal_and_keep_the_order():
    names = ["a", "b", "c", "d", "e"]
    assert decay_runs(names, {"a", "b", "d"}) == [(True, ["a", "b"]), (False, ["c"]), (True, ["d"]), (False, ["e"])]
    assert decay_runs(names, set()) == [(False, names)]


def test_the_optimizer_lists_the_parameters_in_module_order_with_decay_on_matrices(module):
    groups = module.configure_optimizers()["optimizer"].param_groups
    listed = [p for g in groups for p in g["params"]]
    assert [id(p) for p in listed] == [id(p) for p in module.drafter.parameters()]
    for g in groups:
        assert {p.ndim >= 2 for p in g["params"]} == {g["weight_decay"] == 0.1}
    assert len(groups) > 2  # the drafter interleaves matrices and norm weights: several runs


def test_fsdps_relabelling_of_a_one_device_optimizer_state_pairs_each_parameter_with_its_own_moments(module):
    setup = module.configure_optimizers()
    optimizer, scheduler = setup["optimizer"], setup["lr_scheduler"]["scheduler"]
    take_steps(optimizer, scheduler, list(module.drafter.parameters()))
    relabelled = FSDP.rekey_optim_state_dict(optimizer.state_dict(), OptimStateKeyType.PARAM_NAME, module)
    states = relabelled["state"]
    assert sorted(states) == sorted(f"drafter.{n}" for n, _ in module.drafter.named_parameters())
    for name, p in module.drafter.named_parameters():
        assert torch.equal(states[f"drafter.{name}"]["exp_avg"], optimizer.state[p]["exp_avg"]), name


def legacy_optimizer(module):
    """The layout before param_groups.py: the matrices, then the rest, each in module order."""
    named = list(module.drafter.named_parameters())
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for n, p in named if n in module._decayed], "weight_decay": 0.1},
            {"params": [p for n, p in named if n not in module._decayed], "weight_decay": 0.0},
        ],
        lr=1e-3,
        betas=(0.9, 0.95),
    )
    return optimizer, cosine_with_warmup(optimizer, 4, 8)


def test_a_two_group_checkpoint_resumes_into_the_module_order_with_the_same_moments_and_rates(module):
    params = list(module.drafter.parameters())
    old_opt, old_sched = legacy_optimizer(module)
    take_steps(old_opt, old_sched, params, steps=3)
    checkpoint = copy.deepcopy(  # as read from a file: not the live optimizer's tensors
        {
            "optimizer_states": [old_opt.state_dict()],
            "lr_schedulers": [old_sched.state_dict()],
            "dflash2": {"drafter_config": module.drafter.config.to_dict(), "target_id": None},  # no param_order
        }
    )
    module.on_load_checkpoint(checkpoint)
    setup = module.configure_optimizers()
    new_opt, new_sched = setup["optimizer"], setup["lr_scheduler"]["scheduler"]
    new_opt.load_state_dict(checkpoint["optimizer_states"][0])
    new_sched.load_state_dict(checkpoint["lr_schedulers"][0])
    for p in params:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(new_opt.state[p][key], old_opt.state[p][key])
    rates = {id(p): (g["lr"], g["weight_decay"]) for g in old_opt.param_groups for p in g["params"]}
    assert all(rates[id(p)] == (g["lr"], g["weight_decay"]) for g in new_opt.param_groups for p in g["params"])
    # and both go on alike: the same weights after two more steps from the same start
    start = [p.detach().clone() for p in params]
    take_steps(old_opt, old_sched, params, seed=1)
    after_old = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p, s in zip(params, start):
            p.copy_(s)
    take_steps(new_opt, new_sched, params, seed=1)
    for p, expected in zip(params, after_old):
        assert torch.equal(p.detach(), expected)


def test_a_checkpoint_in_module_order_is_loaded_as_it_is(module):
    setup = module.configure_optimizers()
    take_steps(setup["optimizer"], setup["lr_scheduler"]["scheduler"], list(module.drafter.parameters()))
    checkpoint = {"optimizer_states": [setup["optimizer"].state_dict()], "dflash2": {}}
    module.on_save_checkpoint(checkpoint)
    assert checkpoint["dflash2"]["param_order"] == PARAM_ORDER
    before = checkpoint["optimizer_states"][0]["param_groups"]
    module.on_load_checkpoint(checkpoint)
    assert checkpoint["optimizer_states"][0]["param_groups"] is before


def test_a_two_group_checkpoint_is_refused_under_fsdp_only():
    check_param_order(None, fsdp=False)
    check_param_order(PARAM_ORDER, fsdp=True)
    with pytest.raises(DFlash2Error, match="resume it on one device or with trainer=ddp"):
        check_param_order(None, fsdp=True)


def test_an_optimizer_state_of_another_layout_is_refused(module):
    old_opt, _ = legacy_optimizer(module)
    state = old_opt.state_dict()
    state["param_groups"] = state["param_groups"][:1]
    checkpoint = {"optimizer_states": [state], "dflash2": {"drafter_config": module.drafter.config.to_dict()}}
    with pytest.raises(DFlash2Error, match="neither this drafter's parameter order nor its older two-group layout"):
        module.on_load_checkpoint(checkpoint)


def test_the_learning_rate_log_refuses_groups_on_different_rates():
    from types import SimpleNamespace

    from dflash2.training.lr_log import LearningRateLog

    one, two = torch.zeros(1, requires_grad=True), torch.zeros(1, requires_grad=True)
    optimizer = torch.optim.SGD([{"params": [one], "lr": 1.0}, {"params": [two], "lr": 2.0}])
    with pytest.raises(DFlash2Error, match=r"2 learning rates \(\[1.0, 2.0\]\)"):
        LearningRateLog().on_train_batch_start(SimpleNamespace(optimizers=[optimizer]), None, None, 0)
