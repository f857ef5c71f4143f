"""Where a Triton kernel can run: compiled on CUDA tensors, interpreted on CPU tensors.

Triton runs a kernel on CPU tensors only through its interpreter, and triton 3.9 decides
that once, when ``triton`` is first imported: ``TRITON_INTERPRET=1`` must be in the
environment by then (triton.language's own helpers, ``tl.zeros``, ``tl.sum``, ... are
``@triton.jit`` functions decorated at import time; setting the variable later turns our
kernels into interpreted functions that then fail calling the compiled helpers).
tests/conftest.py sets it before anything imports triton when no GPU is present.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction


def interpreting() -> bool:
    """True when Triton kernels run in the interpreter (TRITON_INTERPRET=1 at triton's import)."""
    return isinstance(tl.zeros, InterpretedFunction)


def check_device(*tensors: torch.Tensor) -> None:
    """Refuse CPU tensors unless the interpreter is on, with the fix in the message."""
    if any(t.device.type == "cpu" for t in tensors) and not interpreting():
        raise RuntimeError(
            "Triton kernels on CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1 in the "
            "environment before triton is first imported (or use mode='reference' on CPU)"
        )


def default_warps(tile_elements: int) -> int:
    """Warps per program so that its register tiles stay ≤ ~64 fp32 values per thread (no spills):
    a power of two in 1..8. A starting point; the benchmark (dflash2/runtime/bench_gdn.py) tunes."""
    warps = 1
    while warps < 8 and tile_elements > 64 * 32 * warps:
        warps *= 2
    return warps


@triton.jit
def rtne_bf16(x):
    """fp32 x rounded to the nearest bf16, ties to even (what torch's ``.to(torch.bfloat16)`` does), in integer
    ops: Triton's own cast rounds so on GPUs but truncates in the interpreter. A NaN stays a NaN (the integer
    add would carry it into ±0 or inf): it goes through the plain cast, which keeps NaN either way."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    rounded = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return tl.where(x != x, x.to(tl.bfloat16), rounded)


@triton.jit
def rounded_for(x, ptr, BF16: tl.constexpr):
    """fp32 x in ptr's element dtype, rounded to nearest: bf16 (BF16) through :func:`rtne_bf16` (the interpreter's
    own cast truncates), other dtypes through the cast."""
    if BF16:
        return rtne_bf16(x)
    return x.to(ptr.dtype.element_ty)
