"""The dtype a target runs in: ``target.dtype`` (training), ``dtype`` (eval), resolved once (ARCHITECTURE.md §2.1).

``auto`` (the default everywhere) means bf16 on a GPU and fp32 on the CPU: bf16
halves the memory of a real target (an 8B model is ≈16 GB instead of ≈32 GB) and
is what serving engines run, while on the CPU bf16 matmuls are slow and fp32 makes
the lossless check exact (§4). The same resolved dtype is used to regenerate the
training data, compute the taps the drafter trains on, measure τ during training
and evaluate, so the drafter learns from the features it is served with. The
drafter's own (master) weights are fp32 regardless; it casts the taps to its dtype.
"""

from __future__ import annotations

from typing import Any

import torch

from dflash2.errors import DFlash2Error

DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
}


def resolve_target_dtype(dtype: Any, device: Any = None) -> torch.dtype:
    """``dtype`` ('auto' / None, a name from DTYPES or a torch.dtype) on ``device`` -> a torch.dtype.

    'auto' / None -> torch.bfloat16 when ``device`` is a CUDA device, else torch.float32.
    """
    if dtype is None or (isinstance(dtype, str) and dtype.lower() == "auto"):
        on_gpu = device is not None and torch.device(device).type == "cuda"
        return torch.bfloat16 if on_gpu else torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise DFlash2Error(f"target dtype {dtype} is not supported; use bfloat16, float16, float32 or auto")
        return dtype
    key = str(dtype).lower().removeprefix("torch.")
    if key not in DTYPES:
        raise DFlash2Error(f"target dtype {dtype!r} is not understood; use auto, bfloat16, float16 or float32")
    return DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> 'bfloat16' (for cache keys, reports and config files)."""
    return str(dtype).removeprefix("torch.")
