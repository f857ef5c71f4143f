"""Which GEMM the runtime target's projections run (docs/ARCHITECTURE.md §6): an opt-in switch.

    set_gemm_backend("skinny")          # q|k|v, o_proj, gate|up, down_proj, GDN in_proj / out_proj, lm_head
    y = linear(x, weight, bias)         # what every target projection calls

* 'cublas' (also None / 'default'; the runtime's default): ``F.linear``, PyTorch's GEMM (cuBLAS on CUDA,
  its CPU BLAS on the CPU) — exactly what the models ran before the switch existed.
* 'skinny': :func:`~dflash2.runtime.kernels.skinny_gemm.skinny_linear`, the Triton kernel built for
  decode-sized x (≤ ``MAX_M`` = 128 rows: AR steps, verify blocks up to batch 8 at block 16). Its own
  fallbacks keep ``F.linear``: more rows (prefill), dtypes it does not take, CPU tensors outside
  ``kernels.on_cpu()`` (Triton's interpreter: tests) and ``kernels.kernels(False)``.

Lossless speculative decoding needs the AR step and the verify step to round a row the same way: both
go through the same switch (one global setting), and the kernel's launch plan — hence a row's bits —
never depends on the row count. Only the target: the drafter's GEMMs are its own (draft_math.py).
CUDA graphs keep the GEMMs chosen when they were captured (set the backend before the first decode);
the kernel's default plan (split-K partials summed by a second kernel, no cached workspace) is safe to
capture: its buffers are ordinary allocations, taken from the graph's pool like ``F.linear``'s output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BACKENDS = ("default", "cublas", "skinny")  # the names set_gemm_backend takes
_SKINNY = False


def set_gemm_backend(name: str | None) -> None:
    """Which GEMM the target's projections use: None / 'default' = 'cublas' (``F.linear``) or 'skinny'
    (the Triton skinny GEMM for ≤ 128 rows, ``F.linear`` beyond and wherever the kernel does not apply)."""
    global _SKINNY
    canonical = {None: "cublas", "default": "cublas", "cublas": "cublas", "skinny": "skinny"}
    if name not in canonical:
        raise ValueError(f"GEMM backend {name!r} not known; use one of {', '.join(BACKENDS)}")
    _SKINNY = canonical[name] == "skinny"


def gemm_backend() -> str:
    """The backend set_gemm_backend last chose: 'cublas' or 'skinny'; ``set_gemm_backend(gemm_backend())``
    restores it."""
    return "skinny" if _SKINNY else "cublas"


def gemm_in_use(device: torch.device | str) -> str:
    """What decode-sized projections (≤ 128 rows) on ``device`` run now, fallbacks applied: 'skinny' or
    'cublas' (``F.linear``; on the CPU that is PyTorch's CPU BLAS). Prefill beyond 128 rows is always
    ``F.linear``. For records of what a measurement ran (eval.speedup), e.g. 'cublas' inside
    ``kernels(False)``."""
    from dflash2.runtime.kernels import use_triton

    return "skinny" if _SKINNY and use_triton(torch.empty(0, device=device)) else "cublas"


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through the chosen backend: x (..., K), weight (N, K) -> (..., N)."""
    if not _SKINNY:
        return F.linear(x, weight, bias)
    from dflash2.runtime.kernels.skinny_gemm import skinny_linear

    return skinny_linear(x, weight, bias)  # F.linear past MAX_M rows and wherever the kernel does not apply
