"""fp32 products and sums stored straight into a lower-precision result (issue 15; docs/TRAINING.md "Training
step overheads").

``(a * b).to(torch.bfloat16)`` is two passes over memory: the fp32 product is written, then read and
rounded into a second tensor. ``torch.mul(a, b, out=<bf16 tensor>)`` computes the same fp32 product
(the inputs' common dtype) and rounds it as it is stored, round to nearest even as ``.to`` does, in one
pass on CUDA; on the CPU torch computes into an fp32 temporary and casts it. The values are the same
either way (``tests/test_rms_norm.py``, ``tests/test_chunked_head.py`` check with ``torch.equal``).
"""

from __future__ import annotations

import torch


def _shape(a: torch.Tensor, b) -> torch.Size:
    return torch.broadcast_shapes(a.shape, b.shape) if isinstance(b, torch.Tensor) else a.shape


def product_as(a: torch.Tensor, b, dtype: torch.dtype, in_place: bool = False) -> torch.Tensor:
    """``(a * b).to(dtype)`` for fp32 a (b: an fp32 tensor broadcastable to a, or a number), in one pass where
    torch can; with dtype fp32 the product itself, written into a when ``in_place``."""
    if dtype == a.dtype:
        return a.mul_(b) if in_place else a * b
    return torch.mul(a, b, out=torch.empty(_shape(a, b), dtype=dtype, device=a.device))


def sum_as(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, in_place: bool = False) -> torch.Tensor:
    """``(a + b).to(dtype)`` for fp32 a and b, in one pass where torch can; see ``product_as``."""
    if dtype == a.dtype:
        return a.add_(b) if in_place else a + b
    return torch.add(a, b, out=torch.empty(_shape(a, b), dtype=dtype, device=a.device))
