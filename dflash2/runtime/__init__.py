"""The speculative runtime (docs/ARCHITECTURE.md §6): the target's own forward over static caches.

Plain PyTorch, device-agnostic, no Lightning/Hydra. What exists now:

- :mod:`dflash2.runtime.models`: own forwards for Qwen3, Llama and Qwen3.5 hybrid targets,
  loaded from an HF folder (:func:`~dflash2.runtime.models.load_model`);
- :mod:`dflash2.runtime.cache`: the static KV cache, per-row lengths, the per-step metadata
  and :class:`~dflash2.runtime.cache.DecodeState` (verify, then ``commit(n)``);
- :mod:`dflash2.runtime.gdn_state`: Gated DeltaNet conv + recurrent states with
  verify (outputs from the untouched state, logs k/u/g) and commit (replay of n tokens).
"""

from dflash2.runtime.cache import DecodeState, KVCache, StepMeta
from dflash2.runtime.gdn_state import GDNState
from dflash2.runtime.models import load_model

__all__ = ["DecodeState", "GDNState", "KVCache", "StepMeta", "load_model"]
