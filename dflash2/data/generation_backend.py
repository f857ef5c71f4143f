"""What regeneration generates through: prompt batches in, response token ids out (issue 15).

`regenerate_split` (ARCHITECTURE.md §2.6 / §1) owns the prompts, the resumable shards, the cache
key and the dataset; a backend only turns prompt batches into responses, every batch of a split
with the same `GenerationSettings`. `data.generation_backend` picks one:

    hf    the target's HF model in this process, plain KV-cached decoding (`hf_backend`); default
    vllm  a vLLM engine on the target folder (`vllm_backend`; needs `pip install vllm`)

`make_backend` imports only the backend it returns, so `vllm` is never imported unless selected.

Contract of `GenerationBackend.generate`: prompt batch i is (n_i, P_i) int64, every row of a batch
the same length (prompts.py: no padding); its response is (n_i, R) int64 with R = max_new_tokens,
a row's tokens up to and including its first EOS and `pad_token_id` after it (a row without EOS
is cut at R). Batches are generated in index order, each index once per run; after every
`generate` call the caller saves one shard per batch with `state()` (see `shard_store`), and a
resumed run calls `resume(state of the last stored shard)` before generating the rest. So a
backend whose calls hold several batches (`rows_per_call`) must carry no state from batch to
batch: vllm seeds every request from its (batch, row) instead; hf takes one batch per call.
"""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

from dflash2.errors import DFlash2Error

BACKENDS = ("hf", "vllm")


@dataclass(frozen=True)
class GenerationSettings:
    """The generation settings of one split (all from the `data` config, `seed` its data seed)."""

    max_new_tokens: int  # R, data.response_tokens
    sample: bool  # data.sampling == "sample"; else greedy
    temperature: float  # data.temperature, used when sampling (plain softmax sampling: no top-p / top-k)
    eos_token_id: int
    pad_token_id: int
    seed: int


class GenerationBackend(ABC):
    """Turns prompt batches into responses; see the module docstring for the contract."""

    name: ClassVar[str]

    @property
    def rows_per_call(self) -> int | None:
        """Prompt rows one `generate` call may hold (whole batches, at least one); None: one batch per call."""
        return None

    def calls(self, sizes: list[int], start: int) -> list[range]:
        """Batch indices start..len(sizes)-1 grouped into `generate` calls; sizes[i]: rows of batch i."""
        groups: list[range] = []
        limit, i = self.rows_per_call, start
        while i < len(sizes):
            end, rows = i + 1, sizes[i]
            while limit is not None and end < len(sizes) and rows + sizes[end] <= limit:
                rows += sizes[end]
                end += 1
            groups.append(range(i, end))
            i = end
        return groups

    @abstractmethod
    def resume(self, state: torch.Tensor | None) -> None:
        """Continue after the batches already stored: `state` is the `state()` saved with the last one
        (None: nothing stored, start afresh)."""

    @abstractmethod
    def generate(self, first_index: int, prompts: list[torch.Tensor]) -> list[torch.Tensor]:
        """Responses (n_i, R) int64 of the prompt batches first_index, first_index + 1, ... ((n_i, P_i) int64)."""

    @abstractmethod
    def state(self) -> torch.Tensor:
        """A uint8 tensor saved with the shard of the last batch generated: what `resume` continues from."""


def backend_name(data: Mapping) -> str:
    """`data.generation_backend`, checked; data dicts that predate it (no key) mean "hf"."""
    name = str(data.get("generation_backend") or "hf")
    if name not in BACKENDS:
        raise DFlash2Error(f"data.generation_backend={name!r}: use one of {', '.join(BACKENDS)}")
    return name


def make_backend(
    data: Mapping,
    target,
    settings: GenerationSettings,
    *,
    target_id: str,
    device: str,
    decode: Callable | None = None,
) -> GenerationBackend:
    """The backend `data.generation_backend` names, ready for the split that `settings` describes.

    `target` is the TargetModel (the hf backend runs it on `device`; the vllm backend loads the
    folder `target_id` itself, in the target's dtype). `decode` replaces the hf backend's decoding
    loop (`hf_backend.generate_responses`): regeneration passes its own module attribute, which
    tests patch to watch or interrupt the batches.
    """
    name = backend_name(data)
    if name == "vllm":
        from dflash2.data.vllm_backend import VllmBackend  # `vllm` itself is imported there, only now

        max_model_len = int(data["prompt_max_tokens"]) + settings.max_new_tokens
        return VllmBackend.for_target(
            target_id, dtype=target.dtype, settings=settings, options=data.get("vllm"), max_model_len=max_model_len
        )
    from dflash2.data.hf_backend import HfBackend

    return HfBackend(target, settings, device=device, decode=decode)


def release_engines() -> None:
    """Shut down what a backend keeps for every split of the process (vllm's engine, which holds most of
    the GPU's memory), before the drafter takes the GPU; a later regeneration starts a new one."""
    vllm_backend = sys.modules.get("dflash2.data.vllm_backend")  # never imported: nothing to release
    if vllm_backend is not None:
        vllm_backend.close_shared_engine()
