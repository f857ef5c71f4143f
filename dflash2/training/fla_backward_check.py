"""Refuse, before any work, a target build whose GDN backward flash-linear-attention would refuse.

transformers trains the hybrid target's Gated DeltaNet layers through flash-linear-attention (fla)
whenever fla is importable. fla 0.6 raises in its chunked backward on Hopper GPUs with triton
>= 3.4 and < 3.7.1, because that triton compiles one of its backward kernels to wrong gradients
(fla issue #640); it dispatches to tilelang instead when tilelang is installed. Without this check
the build reads the corpus, trains the tokenizer and compiles the model first, and then dies with
fla's traceback on the first backward step: minutes lost on every attempt (it happened on an H200
whose environment had fla for the runtime's reference kernels).

The decision uses fla's own flags (`fla.utils.IS_NVIDIA_HOPPER`, `TRITON_ABOVE_3_4_0`,
`TRITON_ABOVE_3_7_1`), not a copy of its version bounds: a fla release that drops those flags or
lifts the bound is trusted to run. Forward-only uses of fla (data regeneration, the drafter's
target taps under `no_grad`, the runtime's references) are not affected and not checked.
"""

from __future__ import annotations

import importlib
import importlib.util

import torch

_FLAGS = ("IS_NVIDIA_HOPPER", "TRITON_ABOVE_3_4_0", "TRITON_ABOVE_3_7_1")


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def fla_backward_refusal(accelerator: str | None) -> str | None:
    """Why a GDN target cannot be trained here with the installed fla, or None when it can.

    `accelerator` is the run's `trainer.accelerator`; only a CUDA build with fla importable and
    tilelang absent is looked at.
    """
    if str(accelerator) not in ("gpu", "cuda", "auto") or not torch.cuda.is_available():
        return None
    if not _importable("fla") or _importable("tilelang"):
        return None
    utils = importlib.import_module("fla.utils")
    if not all(hasattr(utils, flag) for flag in _FLAGS):
        return None
    hopper, above_3_4, above_3_7_1 = (bool(getattr(utils, flag)) for flag in _FLAGS)
    if not (hopper and above_3_4 and not above_3_7_1):
        return None
    import triton

    return (
        f"cannot train the embedded target's Gated DeltaNet layers on this Hopper GPU: transformers uses "
        f"flash-linear-attention (fla) when it is installed, and fla refuses its chunked backward with "
        f"triton {triton.__version__} (>= 3.4, < 3.7.1 compiles it to wrong gradients, fla issue #640). "
        "Either uninstall fla for the build (`pip uninstall -y flash-linear-attention fla-core`: transformers "
        "then trains those layers with its PyTorch path; a built target is cached and later runs may have fla "
        "again), upgrade triton to >= 3.7.1, or install tilelang (fla then uses it for this kernel)"
    )
