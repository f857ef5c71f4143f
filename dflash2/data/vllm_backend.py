"""The `vllm` generation backend: a vLLM engine on the target folder (issue 15; `pip install vllm`).

Selected with `data.generation_backend=vllm`; its knobs are `data.vllm` (`VLLM_OPTIONS`). `vllm`
is imported here, inside `import_vllm`, only when the backend is built: without vLLM installed
the rest of the project never notices it, and selecting it is a one-line error naming the fix.

* **One engine per process.** `vllm.LLM(model=<target folder>, dtype=<the target's dtype>,
  seed=<data seed>, ...)` takes minutes to start and claims most of the GPU's memory, so it is
  built once and shared by every split of the run (`shared_engine`); `close_shared_engine`
  gives the memory back before the drafter trains.
* **Requests.** Prompts go in as token ids (`TokensPrompt`, `skip_tokenizer_init`: no text
  either way). Whole prompt batches are grouped into calls of up to `requests_per_call` rows:
  vLLM schedules the requests itself (continuous batching), and the equal-length batches of
  chat data mostly hold a single prompt. After a call every batch's shard is saved, so a killed
  run resumes at the first batch of the call in flight, as with hf.
* **Sampling.** Greedy is `temperature=0`; sampling is plain temperature sampling (no top-p /
  top-k, as hf). vLLM cannot replay the hf backend's torch generator stream; instead every
  sampled request gets its own seed, a hash of (data seed, batch index, row), so a batch's
  rows are the same whether it was generated in one run, after a resume or in another call
  grouping (up to kernel numerics, which may depend on what else the engine batches).
* **EOS.** The only stop is the tokenizer's EOS (`stop_token_ids=[eos]` with `ignore_eos`):
  vLLM would otherwise also stop at every eos id listed in the target's generation_config.json,
  which the hf backend does not. The response keeps the EOS and is padded to R after it.
* **Cache.** The regeneration cache key names the backend (`regenerate.regeneration_cache_key`),
  so hf and vllm data never mix; greedy outputs of the two may differ where the target's top
  two logits nearly tie (other kernels, other rounding).
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import time
from collections.abc import Mapping

import torch

from dflash2.data.generation_backend import GenerationBackend, GenerationSettings
from dflash2.errors import DFlash2Error
from dflash2.target_dtype import dtype_name

log = logging.getLogger(__name__)

# data.vllm; configs/data/stdlib.yaml holds the same defaults (tests/test_generation_backends.py checks).
VLLM_OPTIONS = {
    "gpu_memory_utilization": 0.9,  # share of the GPU memory the engine claims (weights + KV cache)
    "tensor_parallel_size": 1,  # GPUs the target is split over
    "max_num_seqs": 256,  # requests decoded side by side
    "requests_per_call": 1024,  # prompt rows per generate call: the granularity of resume shards
    "enforce_eager": False,  # True skips CUDA-graph capture (faster start, slower decoding)
    "engine_args": None,  # other vllm.LLM keyword arguments (a dict), e.g. {"enable_prefix_caching": True}
}
# Set by the backend from the target and the data config: never from engine_args.
RESERVED_ENGINE_ARGS = ("model", "dtype", "seed", "skip_tokenizer_init", "max_model_len")

_shared: tuple[str, object] | None = None  # (engine_kwargs as JSON, vllm.LLM) of this process


def import_vllm():
    """The `vllm` module, or a DFlash2Error naming the fix when it is not installed or does not import."""
    try:
        import vllm
    except ModuleNotFoundError as e:
        if e.name != "vllm":
            raise DFlash2Error(f"vLLM is installed but does not import ({e}); reinstall it: pip install vllm") from e
        raise DFlash2Error(
            "data.generation_backend=vllm needs vLLM, which is not installed: pip install vllm "
            "(or use data.generation_backend=hf)"
        ) from e
    except ImportError as e:
        raise DFlash2Error(f"vLLM is installed but does not import ({e}); reinstall it: pip install vllm") from e
    return vllm


def vllm_options(options: Mapping | None) -> dict:
    """`data.vllm` with defaults for missing keys (data dicts that predate it have none); unknown keys are errors."""
    options = dict(options or {})
    unknown = sorted(set(options) - set(VLLM_OPTIONS))
    if unknown:
        raise DFlash2Error(f"data.vllm has unknown keys {unknown}; known: {sorted(VLLM_OPTIONS)}")
    merged = {**VLLM_OPTIONS, **{k: v for k, v in options.items() if v is not None}}
    if int(merged["requests_per_call"]) < 1:
        raise DFlash2Error(f"data.vllm.requests_per_call={merged['requests_per_call']}: need at least 1")
    return merged


def engine_kwargs(target_id: str, *, dtype: torch.dtype, seed: int, options: Mapping, max_model_len: int) -> dict:
    """Keyword arguments of `vllm.LLM` for the target folder `target_id` (options: `vllm_options`)."""
    extra = dict(options["engine_args"] or {})
    clash = sorted(set(extra) & set(RESERVED_ENGINE_ARGS))
    if clash:
        raise DFlash2Error(
            f"data.vllm.engine_args sets {clash}, which regeneration sets itself (target.path, target.dtype, "
            "data.seed, data.prompt_max_tokens + data.response_tokens); remove them"
        )
    return {
        "model": str(target_id),
        "dtype": dtype_name(dtype),  # the dtype the cache key names: the target's
        "seed": int(seed),
        "skip_tokenizer_init": True,  # token ids in and out
        # The longest sequence regeneration makes; vLLM would otherwise size for the model's context.
        "max_model_len": int(max_model_len),
        "gpu_memory_utilization": float(options["gpu_memory_utilization"]),
        "tensor_parallel_size": int(options["tensor_parallel_size"]),
        "max_num_seqs": int(options["max_num_seqs"]),
        "enforce_eager": bool(options["enforce_eager"]),
        **extra,
    }


def shared_engine(vllm, kwargs: dict):
    """This process's `vllm.LLM` for `kwargs`: built once, reused by every split with the same kwargs."""
    global _shared
    key = json.dumps(kwargs, sort_keys=True, default=str)
    if _shared is not None and _shared[0] == key:
        return _shared[1]
    close_shared_engine()  # one engine at a time: each claims most of the GPU
    log.info(f"regeneration: starting a vLLM engine on {kwargs['model']} ({kwargs['dtype']})")
    started = time.perf_counter()
    llm = vllm.LLM(**kwargs)
    log.info(f"regeneration: vLLM engine ready in {time.perf_counter() - started:.0f} s")
    _shared = (key, llm)
    return llm


def close_shared_engine() -> None:
    """Shut the shared engine down (if any) and give its GPU memory back."""
    global _shared
    if _shared is None:
        return
    llm, _shared = _shared[1], None
    # No public shutdown in vLLM 0.x's LLM: stop the engine core (its worker processes) when it has one.
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if callable(getattr(core, "shutdown", None)):
        core.shutdown()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def request_seed(seed: int, batch: int, row: int) -> int:
    """The vLLM seed of one sampled request: a 63-bit hash of (data seed, batch index, row in the batch)."""
    digest = hashlib.sha256(f"dflash2-regeneration/{seed}/{batch}/{row}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def sampling_params(vllm, settings: GenerationSettings, seed: int | None):
    """The `vllm.SamplingParams` of one request (seed None: greedy, which needs none)."""
    return vllm.SamplingParams(
        n=1,
        max_tokens=settings.max_new_tokens,
        temperature=float(settings.temperature) if settings.sample else 0.0,
        top_p=1.0,
        top_k=0,  # 0: no top-k (vLLM >= 0.10; -1 before)
        seed=seed,
        stop_token_ids=[settings.eos_token_id],
        ignore_eos=True,  # stop at stop_token_ids only, not at generation_config.json's other eos ids
        detokenize=False,
    )


def build_requests(vllm, first_index: int, prompts: list[torch.Tensor], settings: GenerationSettings):
    """The requests of prompt batches first_index, ... ((n_i, P_i) int64): (TokensPrompts, SamplingParams),
    one of each per row, batch by batch and row by row."""
    greedy = None if settings.sample else sampling_params(vllm, settings, None)
    requests, params = [], []
    for b, prompt in enumerate(prompts, start=first_index):
        for r, ids in enumerate(prompt.tolist()):
            requests.append(vllm.TokensPrompt(prompt_token_ids=ids))
            params.append(greedy or sampling_params(vllm, settings, request_seed(settings.seed, b, r)))
    return requests, params


def in_request_order(outputs: list, requests: list) -> list:
    """vLLM's `RequestOutput`s in the order of `requests`: sorted by request id (an increasing counter
    in `LLM`), then each checked to answer its own prompt."""
    if len(outputs) != len(requests):
        raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(requests)} requests")
    try:
        outputs = sorted(outputs, key=lambda o: int(o.request_id))
    except (AttributeError, TypeError, ValueError):
        outputs = list(outputs)  # ids that are not counters: the prompt check below decides
    for i, (out, request) in enumerate(zip(outputs, requests)):
        if list(out.prompt_token_ids) != list(request["prompt_token_ids"]):
            raise RuntimeError(f"vLLM output {i} answers another prompt than request {i}; outputs out of order")
    return outputs


def response_row(completion, settings: GenerationSettings) -> list[int]:
    """One completion's R tokens: up to and including the first EOS, then `pad_token_id` (as hf)."""
    ids = list(completion.token_ids)[: settings.max_new_tokens]
    eos = settings.eos_token_id
    if eos in ids:
        ids = ids[: ids.index(eos) + 1]
    elif getattr(completion, "finish_reason", None) == "stop" and len(ids) < settings.max_new_tokens:
        ids.append(eos)  # stopped by the EOS stop token but not returned with it (an engine that strips it)
    return ids + [settings.pad_token_id] * (settings.max_new_tokens - len(ids))


class VllmBackend(GenerationBackend):
    """Generates through `llm` (a `vllm.LLM`); `vllm` the module its request types come from."""

    name = "vllm"

    def __init__(self, llm, vllm, settings: GenerationSettings, *, requests_per_call: int):
        self.llm, self.vllm, self.settings = llm, vllm, settings
        self.requests_per_call = int(requests_per_call)

    @classmethod
    def for_target(
        cls,
        target_id: str,
        *,
        dtype: torch.dtype,
        settings: GenerationSettings,
        options: Mapping | None,
        max_model_len: int,
    ) -> VllmBackend:
        options = vllm_options(options)
        vllm = import_vllm()
        kwargs = engine_kwargs(target_id, dtype=dtype, seed=settings.seed, options=options, max_model_len=max_model_len)
        return cls(shared_engine(vllm, kwargs), vllm, settings, requests_per_call=options["requests_per_call"])

    @property
    def rows_per_call(self) -> int:
        return self.requests_per_call

    def resume(self, state: torch.Tensor | None) -> None:
        """Nothing carries over from batch to batch: every request's seed comes from its (batch, row)."""

    def generate(self, first_index: int, prompts: list[torch.Tensor]) -> list[torch.Tensor]:
        requests, params = build_requests(self.vllm, first_index, prompts, self.settings)
        outputs = in_request_order(self.llm.generate(requests, params, use_tqdm=False), requests)
        rows = [response_row(out.outputs[0], self.settings) for out in outputs]
        responses, start = [], 0
        for prompt in prompts:
            n = prompt.shape[0]
            responses.append(torch.tensor(rows[start : start + n], dtype=torch.int64))
            start += n
        return responses

    def state(self) -> torch.Tensor:
        return torch.zeros(0, dtype=torch.uint8)  # the shard format wants a generator state; there is none
