"""The speculative runtime (docs/ARCHITECTURE.md §6): the target's own forward over static caches.

Plain PyTorch, device-agnostic, no Lightning/Hydra. What exists now:

- :mod:`dflash2.runtime.models`: own forwards for Qwen3, Llama and Qwen3.5 hybrid targets,
  loaded from an HF folder (:func:`~dflash2.runtime.models.load_model`);
- :mod:`dflash2.runtime.cache`: the static KV cache, per-row lengths, the per-step metadata
  and :class:`~dflash2.runtime.cache.DecodeState` (verify, then ``commit(n)``);
- :mod:`dflash2.runtime.gdn_state`: Gated DeltaNet conv + recurrent states with
  verify (outputs from the untouched state, logs k/u/g) and commit (replay of n tokens),
  in plain PyTorch or through the Triton kernels of :mod:`dflash2.runtime.kernels`
  (ReplaySSM, or native rollback as the ablation; ``load_model(..., gdn_mode=...)``);
- :mod:`dflash2.runtime.drafter`: the DFlash / DFlash2 drafter over a static context cache;
- :mod:`dflash2.runtime.step`, :mod:`dflash2.runtime.sampling`: the pieces of one step
  (prefill, verify, acceptance at T=0 and T>0 with sparse proposals, commit, emit);
- :mod:`dflash2.runtime.kernels`: fused Triton kernels of the step (norm, RoPE + cache write, SwiGLU)
  with plain-PyTorch twins;
- :mod:`dflash2.runtime.engine`: :class:`~dflash2.runtime.engine.Decoder` (reusable per-bucket slots,
  phases captured as CUDA graphs, :mod:`dflash2.runtime.graphs`; short prompts' prefill optionally
  too, :mod:`dflash2.runtime.prefill`) and the one-off
  :func:`generate_ar` / :func:`generate_spec`, batched and ragged.
"""

from dflash2.runtime.cache import DecodeState, KVCache, StepMeta
from dflash2.runtime.drafter import DraftContext, RuntimeDrafter
from dflash2.runtime.engine import Decoder, generate_ar, generate_spec
from dflash2.runtime.gdn_state import GDNState
from dflash2.runtime.models import load_model
from dflash2.runtime.sampling import Proposal

__all__ = [
    "DecodeState",
    "Decoder",
    "DraftContext",
    "GDNState",
    "KVCache",
    "Proposal",
    "RuntimeDrafter",
    "StepMeta",
    "generate_ar",
    "generate_spec",
    "load_model",
]
