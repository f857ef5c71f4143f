"""drafter.optimizer_impl: which AdamW implementation a run steps with (dflash2/training/optimizer_impl.py)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from dflash2.drafter.objective import anchor_generator
from dflash2.errors import DFlash2Error
from dflash2.training.optimizer_impl import (
    adamw_kwargs,
    check_optimizer_impl,
    optimizer_impl_name,
    resolve_optimizer_impl,
)

KW = dict(num_anchors=5, loss_gamma=4.0, selector_loss_weight=1.0, lr=1e-2, weight_decay=0.1)
KW.update(warmup_ratio=0.0, total_steps=10, seed=0)


def _fake(device: str, dtype=torch.float32):
    """What resolve_optimizer_impl reads of a parameter, on a device this machine may not have."""
    return SimpleNamespace(device=torch.device(device), dtype=dtype)


def test_auto_is_fused_on_cuda_and_torch_default_elsewhere():
    assert resolve_optimizer_impl("auto", [_fake("cuda"), _fake("cuda:1")]) == "fused"
    assert resolve_optimizer_impl("auto", [_fake("cpu")]) == "default"
    assert resolve_optimizer_impl("auto", [_fake("cuda"), _fake("cpu")]) == "default"  # mixed: torch decides
    assert resolve_optimizer_impl("auto", [_fake("cuda", torch.int64)]) == "default"
    assert resolve_optimizer_impl("auto", []) == "default"
    for impl in ("fused", "foreach", "for_loop"):
        assert resolve_optimizer_impl(impl, [_fake("cpu")]) == impl
    assert adamw_kwargs("default") == {}
    assert adamw_kwargs("fused") == {"fused": True}
    assert adamw_kwargs("foreach") == {"foreach": True}
    assert adamw_kwargs("for_loop") == {"foreach": False}
    assert check_optimizer_impl(None) == "auto"


def test_a_bad_value_is_a_one_line_error():
    with pytest.raises(DFlash2Error, match="optimizer_impl='adam8bit' must be one of auto, fused, foreach, for_loop"):
        check_optimizer_impl("adam8bit")


def _module(target, drafter, impl, **extra):
    from dflash2.training.drafter_module import DrafterTrainingModule

    return DrafterTrainingModule(copy.deepcopy(drafter), target, optimizer_impl=impl, **{**KW, **extra})


def _train(module, steps: int = 3) -> dict[str, torch.Tensor]:
    """``steps`` optimiser steps of block_outputs' loss, the order Lightning runs them; the final weights."""
    opt = module.configure_optimizers()["optimizer"]
    ids = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "loss_mask": (torch.arange(24) >= 8).long().expand(2, 24)}
    device = next(module.drafter.parameters()).device
    batch = {k: v.to(device) for k, v in batch.items()}  # as Lightning hands it over (the CUDA test's module)
    for step in range(steps):
        loss = module.block_outputs(batch, anchor_generator(0, step))["loss"]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return {n: p.detach().clone() for n, p in module.drafter.named_parameters()}


def test_auto_on_the_cpu_steps_bit_for_bit_as_torchs_default_adamw(make_spec_target, make_spec_drafter):
    """The reference is the optimiser the module built before the option existed: AdamW with torch's
    defaults (the per-parameter loop on the CPU), same groups, lr and betas."""
    target = make_spec_target("qwen3")
    drafter = make_spec_drafter(target, 4, v2=True).train()
    auto = _module(target, drafter, "auto")
    opt = auto.configure_optimizers()["optimizer"]
    assert opt.defaults["fused"] is None and opt.defaults["foreach"] is None
    assert optimizer_impl_name(opt) == "for_loop"

    class Reference(type(auto)):
        def configure_optimizers(self):  # the module's optimiser as it was built before optimizer_impl
            named = [(n, p) for n, p in self.drafter.named_parameters() if p.requires_grad]
            groups = [
                {"params": [p for n, p in named if n in self._decayed], "weight_decay": self.weight_decay},
                {"params": [p for n, p in named if n not in self._decayed], "weight_decay": 0.0},
            ]
            return {"optimizer": torch.optim.AdamW(groups, lr=self.lr, betas=(0.9, 0.95))}

    ref = Reference(copy.deepcopy(drafter), target, **KW)
    got, want = _train(_module(target, drafter, "auto")), _train(ref)
    for name in want:
        assert torch.equal(got[name], want[name]), name


@pytest.mark.parametrize("impl", ["fused", "foreach"])
def test_every_implementation_takes_the_same_steps_to_fp32_rounding(make_spec_target, make_spec_drafter, impl):
    target = make_spec_target("qwen3")
    drafter = make_spec_drafter(target, 4, v2=True).train()
    module = _module(target, drafter, impl)
    assert optimizer_impl_name(module.configure_optimizers()["optimizer"]) == impl
    got, want = _train(module), _train(_module(target, drafter, "for_loop"))
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)


def test_lightnings_mixed_precision_plugin_refuses_to_clip_for_a_fused_optimiser():
    """Why the training module clips a fused optimiser's gradients itself: Lightning's plugin refuses any
    fused optimiser, whether or not it scales the loss (bf16-mixed does not)."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 10.0)
    opt = torch.optim.AdamW([p], **adamw_kwargs("fused"))
    plugin = MixedPrecision("bf16-mixed", "cpu")
    assert plugin.scaler is None
    with pytest.raises(RuntimeError, match="does not allow for gradient clipping"):
        plugin.clip_gradients(opt, 1.0)


@pytest.mark.slow
def test_a_bf16_mixed_run_with_clipping_trains_with_a_fused_optimiser(tmp_path, micro_train_overrides, monkeypatch):
    """`python train.py` on the micro target under bf16-mixed (CPU autocast) with drafter.grad_clip on:
    Lightning's plugin would refuse to clip for a fused optimiser; the module clips it itself, and the run's
    losses follow the per-parameter loop's (bf16 forward: to 1e-2)."""
    from test_train_drafter import compose_run, train_losses

    import dflash2.training.drafter_module as drafter_module
    from dflash2.training.run import run_from_config

    used = []
    real = drafter_module.adamw_kwargs
    monkeypatch.setattr(drafter_module, "adamw_kwargs", lambda impl: used.append(impl) or real(impl))
    losses = {}
    for impl in ("fused", "for_loop"):
        overrides = [*micro_train_overrides, "trainer.precision=bf16-mixed", f"drafter.optimizer_impl={impl}"]
        run_from_config(compose_run(tmp_path, [*overrides, "drafter.grad_clip=0.5"], impl))
        losses[impl] = train_losses(tmp_path / impl)
    assert used == ["fused", "for_loop"]
    assert sorted(losses["fused"]) == list(range(6))
    for step in range(6):
        assert losses["fused"][step] == pytest.approx(losses["for_loop"][step], rel=1e-2), step


@pytest.mark.parametrize(
    "override,needle",
    [
        ("drafter.optimizer_impl=adam8bit", "optimizer_impl='adam8bit' must be one of auto, fused, foreach, for_loop"),
        ("data.pin_memory=yes", "data.pin_memory='yes' must be auto, true or false"),
    ],
)
def test_a_bad_setting_stops_the_run_in_one_line_before_any_data(tmp_path, micro_train_overrides, override, needle):
    from test_train_drafter import compose_run

    from dflash2.training.run import run_from_config

    with pytest.raises(DFlash2Error, match=needle) as err:
        run_from_config(compose_run(tmp_path, [*micro_train_overrides, override]))
    assert "\n" not in str(err.value)
    assert not (tmp_path / "run" / "drafter").exists()


@pytest.mark.cuda
def test_auto_builds_a_fused_adamw_on_cuda(make_spec_target, make_spec_drafter):
    target = make_spec_target("qwen3")
    target.model.cuda()
    drafter = make_spec_drafter(target, 4, v2=True).train()
    module = _module(target, drafter, "auto").cuda()
    opt = module.configure_optimizers()["optimizer"]
    assert opt.defaults["fused"] is True and optimizer_impl_name(opt) == "fused"
    got = _train(module)
    want = _train(_module(target, drafter, "foreach").cuda())
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5, msg=name)
