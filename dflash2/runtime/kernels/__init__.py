"""Fused Triton kernels of the runtime's decode step, each with a plain-PyTorch twin (docs/ARCHITECTURE.md §6).

Why: a batch-1 decode step reads every weight once in a handful of large GEMVs, and
everything between them (norms, RoPE, cache writes, activations, residual adds) is
dozens of tiny element-wise launches per layer. Inside a CUDA graph each still costs
a few microseconds, which for an 8B model adds milliseconds to a ~4 ms weight read.
These kernels fold each such group into one launch:

* :func:`~dflash2.runtime.kernels.norm.add_rms_norm`: residual add + RMSNorm;
* :func:`~dflash2.runtime.kernels.rope.qk_norm_rope_write`: per-head q/k RMSNorm, RoPE,
  and the K/V cache write of one attention layer;
* :func:`~dflash2.runtime.kernels.norm.add_rms_norm_fp32w` and
  :func:`~dflash2.runtime.kernels.draft_rope.draft_qk_rope_write`: the same two for the runtime
  drafter, in its rounding (fp32 norm weights, one rounding; its RoPE tables), the latter also
  writing the context K/V of every drafter layer in one launch (no q);
* :func:`~dflash2.runtime.kernels.local_conv.local_conv`: one side of the drafter's DFlash2 local conv (kernel
  add, padded shifted products, their sum), one program per token and channel tile (twin: draft_math's ops);
* :func:`~dflash2.runtime.kernels.conv_norm.conv_add_rms_norm_fp32w`: a conv'd sublayer's post side, the
  residual add after it and the next drafter norm, one program per token row, the same code as that pair of
  launches (bit for bit with them; twin: their twins' ops);
* :func:`~dflash2.runtime.kernels.selector.selector_walk`: the DFlash2 selector's greedy walk over a
  block in two launches: the pair terms of every position and predecessor candidate (one program per row and
  position), then the walk, one program per row, over them in registers (twin: the walk's eager ops);
* :func:`~dflash2.runtime.kernels.selector_sample.selector_sample_walk`: the selector's T>0 walk, softmax over the
  k candidates and an exponential race per position, over the same pair terms (two launches), after the races
  are drawn in torch (twin: the sampled walk's eager ops; its q is the law of its own draws);
* :func:`~dflash2.runtime.kernels.topk.topk_rows`: the selector's k candidates per drafted position,
  the top-k of a few vocabulary-long rows in two launches, chunks first (twin: a stable sort);
* :func:`~dflash2.runtime.kernels.accept.greedy_accept`: the T=0 accept phase's bookkeeping after the
  verify's argmax (accepted prefix, bonus, EOS / budget cut, output write, counters), one program per
  row, in place on the decode slot's buffers (twin: the same in a dozen-odd tensor ops; integer, exact);
* :func:`~dflash2.runtime.kernels.sampled_accept.sampled_accept`: the T>0 accept phase: rejection sampling
  (accepted prefix, the residual's exponential race over the vocabulary) and the same bookkeeping in two
  launches, one program per (row, vocabulary chunk), then one per row merging the chunks' maxima, after the
  step's draws made in torch (twin: the same elementwise fp32 ops; exact);
* :func:`~dflash2.runtime.kernels.act.silu_mul`: the SwiGLU activation;
* :func:`~dflash2.runtime.kernels.output_gate.output_gate`: gated attention's y · sigmoid(gate) with the
  head transpose, straight from the attention output and the fused projection's gate slice;
* :func:`~dflash2.runtime.kernels.gated_norm.gated_rms_norm`: the Gated DeltaNet output norm,
  RMSNorm(o) · w · silu(z) (Qwen3.5 / Qwen3-Next RMSNormGated), one program per token and head;
* :func:`~dflash2.runtime.kernels.attention.decode_attention`: split-K decode attention over
  the static KV cache (the default attention on CUDA, ``set_attention_backend`` in cache.py; its twin
  is a naive fp32 softmax).
* :func:`~dflash2.runtime.kernels.skinny_gemm.skinny_linear`: y = x @ Wᵀ for decode-sized x
  (M ≤ 128 rows), streaming W once, batch invariant (a row's bits do not depend on M); its
  fallback is ``F.linear``, its test twin an fp32 matmul. The models call it only when
  ``gemm.set_gemm_backend("skinny")`` opts in (dflash2/runtime/gemm.py).

The Gated DeltaNet ops live in a folder each (docs/ARCHITECTURE.md §5.5): ``reference.py``
(the plain-PyTorch twin, also ``GDNState``'s ``mode="reference"``), ``kernel.py`` (the
Triton kernel + launcher), ``__init__`` (the public function with its shapes):

* :mod:`.gdn_verify`: the outputs of a block of T tokens from the untouched state (conv +
  SiLU, q/k L2 norm, gates, recurrence fused), logging what a commit needs; with ReplaySSM's
  deferred commit it first folds the previous commit into the state in place;
* :mod:`.gdn_replay`: the commit: fold n[r] logged tokens into row r's state ("exact fold")
  or, for the native-rollback ablation, copy the state verify stored at n[r]; roll the conv
  window (ReplaySSM with reserved logs runs it only to flush a deferred commit).
  ``GDNState(mode="replay" | "native")`` chooses them explicitly, so they do not go through
  ``use_triton``: on CPU tensors they run in the interpreter or refuse with the fix
  (:mod:`.triton_util`).

Each public function takes the same tensors on any device and dispatches: CUDA
tensors (and Triton importable, kernels not switched off) run the Triton kernel,
anything else the twin. The twins round exactly where the eager HF code rounds
(they *are* the eager code), and the kernels round at the same points, so bf16
results agree to the last bit except for reduction order.

Tests run the kernels on CPU tensors through Triton's interpreter: ``TRITON_INTERPRET=1``
must be set before triton is first imported (its standard library is jitted then; the
test suite's conftest does it on machines without a GPU), and CPU tensors go to the
kernels only inside ``with on_cpu():`` — elsewhere the CPU runs the twins.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch

_ENABLED = os.environ.get("DFLASH2_TRITON", "1") != "0"
_ON_CPU = False
_CACHE: dict = {}


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def available() -> bool:
    """Whether Triton can be imported at all."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(t: torch.Tensor) -> bool:
    """Run the Triton kernel for tensor t: CUDA tensors, or CPU ones inside ``on_cpu()`` under the interpreter."""
    return _ENABLED and (t.is_cuda or (_ON_CPU and _interpret())) and available()


def enabled() -> bool:
    return _ENABLED


def set_enabled(flag: bool) -> bool:
    """Switch the kernels on / off globally (for ablations); returns the previous setting."""
    global _ENABLED
    old, _ENABLED = _ENABLED, bool(flag)
    return old


@contextmanager
def kernels(flag: bool):
    """``with kernels(False):`` runs the twins everywhere (an ablation, or a reference run)."""
    old = set_enabled(flag)
    try:
        yield
    finally:
        set_enabled(old)


@contextmanager
def on_cpu():
    """Send CPU tensors to the kernels (Triton's interpreter; tests only)."""
    global _ON_CPU
    if not _interpret():
        raise RuntimeError("set TRITON_INTERPRET=1 before triton is imported to run the kernels on the CPU")
    old, _ON_CPU = _ON_CPU, True
    try:
        yield
    finally:
        _ON_CPU = old


def jit(fn, do_not_specialize: tuple[str, ...] = ()):
    """``triton.jit(fn)``, made on first use and cached per interpreter mode (see the module docstring).

    do_not_specialize: integer arguments Triton must not specialise on (by default it compiles a
    variant for a value of 1 and one for multiples of 16), e.g. a row count whose value must not
    change the compiled code."""
    key = (fn, _interpret(), tuple(do_not_specialize))
    if key not in _CACHE:
        import triton

        _CACHE[key] = triton.jit(fn, do_not_specialize=list(do_not_specialize)) if do_not_specialize else triton.jit(fn)
    return _CACHE[key]
