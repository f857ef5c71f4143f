"""Which AdamW implementation a drafter run steps with (``drafter.optimizer_impl``, issue 15; docs/TRAINING.md
"Training step overheads").

torch has three implementations of the same update: ``for_loop`` (one set of elementwise kernels per
parameter), ``foreach`` (the same operations batched over many parameters per kernel launch, with
temporaries as large as all the parameters together) and ``fused`` (one kernel reads a parameter, its
gradient and both moments once and writes them back). With fp32 master weights (1.17 B parameters at
the Qwen3-8B recipe) the update is memory-bound, so the number of passes over ~19 GB of weights, gradients
and moments is what it costs.

* ``auto`` (the default): ``fused`` when every parameter is a floating-point CUDA tensor and the gradients
  are not loss-scaled (bf16-mixed and 32-true have no gradient scaler), else torch's own default: on the
  CPU the per-parameter loop, so a CPU run steps exactly as before this option existed; under 16-mixed
  foreach, since a fused optimiser unscales inside its kernel, after the point where gradients are clipped.
* ``fused`` | ``foreach`` | ``for_loop``: that implementation wherever torch has it. The three agree to
  fp32 rounding, not bit for bit (the same formula, other operation orders).

Lightning's mixed-precision plugin refuses gradient clipping with any fused optimiser (it cannot know that
bf16-mixed scales nothing); ``DrafterTrainingModule.configure_gradient_clipping`` clips those itself, with
the plugin's own unscaled-gradient clipping.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from dflash2.errors import DFlash2Error

OPTIMIZER_IMPLS = ("auto", "fused", "foreach", "for_loop")


def check_optimizer_impl(value) -> str:
    """``drafter.optimizer_impl`` (null = auto) as one of ``OPTIMIZER_IMPLS``; anything else is a one-line error."""
    impl = "auto" if value is None else str(value)
    if impl not in OPTIMIZER_IMPLS:
        raise DFlash2Error(f"drafter.optimizer_impl={value!r} must be one of {', '.join(OPTIMIZER_IMPLS)}")
    return impl


def all_on_cuda(params: Iterable[torch.Tensor]) -> bool:
    """True when there is a parameter and every one is a floating-point tensor on a CUDA device."""
    params = list(params)
    return bool(params) and all(p.device.type == "cuda" and p.dtype.is_floating_point for p in params)


def resolve_optimizer_impl(impl: str, params: Iterable[torch.Tensor], loss_scaled: bool = False) -> str:
    """The implementation ``impl`` means for these parameters: ``auto`` -> ``fused`` on CUDA without loss
    scaling (``loss_scaled``: a gradient scaler, 16-mixed), else ``default`` (torch's own choice: the loop on
    the CPU, foreach on CUDA); any other value as it is."""
    impl = check_optimizer_impl(impl)
    if impl != "auto":
        return impl
    return "fused" if all_on_cuda(params) and not loss_scaled else "default"


def adamw_kwargs(resolved: str) -> dict:
    """The ``torch.optim.AdamW`` keywords of a resolved implementation (``default``: none, torch decides)."""
    return {"fused": {"fused": True}, "foreach": {"foreach": True}, "for_loop": {"foreach": False}}.get(resolved, {})


def optimizer_impl_name(optimizer: torch.optim.Optimizer) -> str:
    """What a built optimiser will run: fused, foreach or for_loop (torch's default resolved for its parameters)."""
    from torch.optim.optimizer import _default_to_fused_or_foreach

    if optimizer.defaults.get("fused"):
        return "fused"
    foreach = optimizer.defaults.get("foreach")
    if foreach is None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        _, foreach = _default_to_fused_or_foreach(params, differentiable=False, use_fused=False)
    return "foreach" if foreach else "for_loop"


def is_fused(optimizer) -> bool:
    """Whether ``optimizer`` (or the optimiser a LightningOptimizer wraps) is a fused torch optimiser."""
    optimizer = getattr(optimizer, "optimizer", optimizer)
    return bool(getattr(optimizer, "defaults", {}).get("fused"))
