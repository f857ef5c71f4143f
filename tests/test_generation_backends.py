"""Regeneration backends (issue 15): the hf backend is the regeneration of before, unchanged; the vllm
backend is tested against a fake `vllm` module in `sys.modules` (CPU, seconds, whether or not vLLM is
installed): the engine and requests it builds, output order, EOS, resume. The real vLLM run is
`make test-vllm-regeneration` (tests/vllm/check_vllm_regeneration.py), outside `make test`."""

from __future__ import annotations

import hashlib
import json
import sys
import types
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from dflash2.corpus import corpus_fingerprint, split_kwargs
from dflash2.data import regenerate, vllm_backend
from dflash2.data.generation_backend import GenerationSettings, backend_name, release_engines
from dflash2.data.hf_backend import generate_responses
from dflash2.data.vllm_backend import VLLM_OPTIONS, in_request_order, request_seed, response_row, vllm_options
from dflash2.errors import DFlash2Error
from dflash2.target import TargetModel
from dflash2.target_dtype import dtype_name
from dflash2.training.cli import CONFIG_DIR

DATA = {
    "sources": [{"kind": "stdlib"}],
    "validation_fraction": 0.02,
    "heldout_fraction": 0.02,
    "prompt_min_tokens": 8,
    "prompt_max_tokens": 16,
    "response_tokens": 12,
    "sampling": "greedy",
    "temperature": 0.7,
    "generation_batch_size": 4,
}
NUM_PROMPTS, SEED = 24, 3  # 6 batches of 4


@pytest.fixture(scope="module")
def target(micro_target_dir):
    return TargetModel.from_pretrained(str(micro_target_dir), target_layer_ids=[0, 1, 2], dtype="float32")


def regenerate_train(target, target_dir, cache: Path, data: dict, num_prompts: int = NUM_PROMPTS):
    return regenerate.regenerate_split(
        target, data, split="train", num_prompts=num_prompts, seed=SEED, cache_dir=cache, target_id=str(target_dir)
    )


# ---------------------------------------------------------------- the interface, vLLM absent
def test_selecting_vllm_without_vllm_is_one_line_naming_pip_install(target, micro_target_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` fails as when it is not installed
    with pytest.raises(DFlash2Error, match=r"needs vLLM, which is not installed: pip install vllm"):
        regenerate_train(target, micro_target_dir, tmp_path, {**DATA, "generation_backend": "vllm"})
    assert not (tmp_path / "data").exists() or not any((tmp_path / "data").iterdir())  # nothing written


def test_an_unknown_backend_or_vllm_option_is_a_user_error():
    with pytest.raises(DFlash2Error, match=r"data.generation_backend='tgi': use one of hf, vllm"):
        backend_name({"generation_backend": "tgi"})
    assert backend_name({}) == "hf"  # data dicts that predate the key
    with pytest.raises(DFlash2Error, match=r"data.vllm has unknown keys \['gpu_util'\]"):
        vllm_options({"gpu_util": 0.5})
    with pytest.raises(DFlash2Error, match=r"engine_args sets \['dtype'\]"):
        vllm_backend.engine_kwargs(
            "t", dtype=torch.float32, seed=0, options=vllm_options({"engine_args": {"dtype": "half"}}), max_model_len=8
        )


def test_the_data_config_holds_the_backend_defaults(tmp_path):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        for group in ("stdlib", "chat"):
            data = compose("train", overrides=[f"data={group}", f"paths.cache_dir={tmp_path}"]).data
            assert data.generation_backend == "hf"
            assert dict(data.vllm) == VLLM_OPTIONS  # the code's defaults (for data dicts without the key) agree
    GlobalHydra.instance().clear()


def test_hf_cache_key_is_the_key_from_before_backends_and_vllm_gets_its_own(target, micro_target_dir):
    """The hf key hashes exactly what it hashed before issue 15, so existing caches stay valid."""

    def key(data):
        return regenerate.regeneration_cache_key(
            target, data, split="train", num_prompts=8, seed=0, target_id=str(micro_target_dir)
        )

    before = {
        "target": regenerate.target_fingerprint(str(micro_target_dir)),
        "target_dtype": dtype_name(target.dtype),
        "corpus": corpus_fingerprint(DATA["sources"], "train", **split_kwargs(DATA)),
        "settings": regenerate.generation_settings(DATA, "train", 8, 0),
    }
    assert key(DATA) == hashlib.sha256(json.dumps(before, sort_keys=True).encode()).hexdigest()[:16]
    assert key({**DATA, "generation_backend": "hf", "vllm": {"max_num_seqs": 8}}) == key(DATA)
    assert key({**DATA, "generation_backend": "vllm"}) != key(DATA)
    # engine knobs do not change what is generated, only how fast
    assert key({**DATA, "generation_backend": "vllm", "vllm": {"max_num_seqs": 8}}) == key(
        {**DATA, "generation_backend": "vllm"}
    )


def test_hf_backend_writes_the_dataset_of_the_plain_decoding_loop(target, micro_target_dir, tmp_path):
    """Sampled, so the one generator carried from batch to batch (the regeneration of before) is checked."""
    data = {**DATA, "sampling": "sample", "generation_backend": "hf"}
    dataset = regenerate_train(target, micro_target_dir, tmp_path, data)
    tok = target.tokenizer
    generator = torch.Generator().manual_seed(SEED)
    rows = []
    for batch in regenerate.prompt_batches(tok, data, split="train", num_prompts=NUM_PROMPTS, seed=SEED):
        prompt = torch.from_numpy(batch.input_ids)
        response = generate_responses(
            target,
            prompt,
            max_new_tokens=DATA["response_tokens"],
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            sample=True,
            temperature=DATA["temperature"],
            generator=generator,
        )
        rows += [p + r for p, r in zip(prompt.tolist(), response.tolist())]
    assert dataset["input_ids"] == rows


# ---------------------------------------------------------------- the vllm backend against a fake vLLM
VOCAB = 300


class FakeLLM:
    """Stands in for `vllm.LLM`: a response token is a function of the prompt, the step and the request's
    seed; the request whose prompt sums to a multiple of 3 emits the stop token at step 4 and stops there.
    Outputs come back in reverse order (the backend must restore it) with counter request ids."""

    instances: ClassVar[list[FakeLLM]] = []

    def __init__(self, **kwargs):
        self.kwargs, self.calls, self.fail_at, self.shut_down = kwargs, [], None, False
        self.counter = 0
        self.llm_engine = types.SimpleNamespace(engine_core=types.SimpleNamespace(shutdown=self._shutdown))
        FakeLLM.instances.append(self)

    def _shutdown(self):
        self.shut_down = True

    def generate(self, prompts, sampling_params, use_tqdm=True):
        if len(self.calls) == self.fail_at:
            raise InterruptedError("simulated kill")
        assert isinstance(sampling_params, list) and len(sampling_params) == len(prompts)
        self.calls.append((prompts, sampling_params))
        outputs = []
        for prompt, params in zip(prompts, sampling_params):
            outputs.append(
                types.SimpleNamespace(
                    request_id=str(self.counter),
                    prompt_token_ids=list(prompt["prompt_token_ids"]),
                    outputs=[fake_completion(prompt["prompt_token_ids"], params)],
                )
            )
            self.counter += 1
        return outputs[::-1]


def fake_tokens(prompt: list[int], seed: int | None, n: int) -> list[int]:
    return [(sum(prompt) * 7 + 11 * k + (seed or 0)) % VOCAB for k in range(n)]


def fake_completion(prompt: list[int], params) -> types.SimpleNamespace:
    (stop,) = params.stop_token_ids
    tokens = [t if t != stop else t + 1 for t in fake_tokens(prompt, params.seed, params.max_tokens)]
    if sum(prompt) % 3 == 0:
        tokens = [*tokens[:4], stop]
    return types.SimpleNamespace(token_ids=tokens, finish_reason="stop" if stop in tokens else "length")


class FakeSamplingParams:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


@pytest.fixture
def fake_vllm(monkeypatch):
    module = types.ModuleType("vllm")
    module.LLM = FakeLLM
    module.SamplingParams = FakeSamplingParams
    module.TokensPrompt = lambda **kw: dict(**kw)  # a TypedDict: calling it makes a dict
    monkeypatch.setitem(sys.modules, "vllm", module)
    FakeLLM.instances = []
    yield module
    release_engines()


def expected_response(prompt: list[int], seed: int | None, tok, length: int) -> list[int]:
    """What the backend must make of the fake's completion: EOS kept, then padding."""
    eos, pad = tok.eos_token_id, tok.pad_token_id
    tokens = [t if t != eos else t + 1 for t in fake_tokens(prompt, seed, length)]
    if sum(prompt) % 3 == 0:
        return [*tokens[:4], eos] + [pad] * (length - 5)
    return tokens


def test_vllm_engine_and_requests(fake_vllm, target, micro_target_dir, tmp_path):
    vllm_cfg = {"max_num_seqs": 32, "requests_per_call": 10, "engine_args": {"enable_prefix_caching": True}}
    data = {**DATA, "sampling": "sample", "generation_backend": "vllm", "vllm": vllm_cfg}
    dataset = regenerate_train(target, micro_target_dir, tmp_path, data)

    (llm,) = FakeLLM.instances
    assert llm.kwargs == {
        "model": str(micro_target_dir),
        "dtype": "float32",
        "seed": SEED,
        "skip_tokenizer_init": True,
        "max_model_len": DATA["prompt_max_tokens"] + DATA["response_tokens"],
        "gpu_memory_utilization": 0.9,
        "tensor_parallel_size": 1,
        "max_num_seqs": 32,
        "enforce_eager": False,
        "enable_prefix_caching": True,
    }
    # 6 batches of 4 rows in calls of whole batches up to 10 rows: 2 + 2 + 2 batches
    assert [len(prompts) for prompts, _ in llm.calls] == [8, 8, 8]
    tok = target.tokenizer
    seeds = []
    for c, (_, params) in enumerate(llm.calls):
        for j, p in enumerate(params):
            batch, row = 2 * c + j // 4, j % 4
            assert p.seed == request_seed(SEED, batch, row)
            assert (p.n, p.max_tokens, p.temperature, p.top_p, p.top_k) == (1, 12, 0.7, 1.0, 0)
            assert p.stop_token_ids == [tok.eos_token_id] and p.ignore_eos and not p.detokenize
            seeds.append(p.seed)
    assert len(set(seeds)) == NUM_PROMPTS  # every row its own stream, also rows with equal prompts

    # Rows in prompt order although the fake answered in reverse; EOS kept and padded after.
    requests = [(p["prompt_token_ids"], s.seed) for prompts, params in llm.calls for p, s in zip(prompts, params)]
    assert len(dataset) == NUM_PROMPTS
    stopped = 0
    for row, (prompt, seed) in zip(dataset, requests):
        assert row["input_ids"][: row["prompt_len"]] == prompt
        response = row["input_ids"][row["prompt_len"] :]
        assert response == expected_response(prompt, seed, tok, DATA["response_tokens"])
        if tok.eos_token_id in response:
            stopped += 1
            assert row["loss_mask"][row["prompt_len"] :] == [1] * 5 + [0] * (DATA["response_tokens"] - 5)
    assert 0 < stopped < NUM_PROMPTS  # both kinds of rows were checked

    # The validation split reuses the engine (one per process); release_engines shuts it down.
    regenerate.regenerate_split(
        target, data, split="validation", num_prompts=4, seed=SEED, cache_dir=tmp_path, target_id=str(micro_target_dir)
    )
    assert len(FakeLLM.instances) == 1 and len(llm.calls) == 4
    release_engines()
    assert llm.shut_down and vllm_backend._shared is None


def test_vllm_greedy_requests_have_temperature_zero_and_no_seed(fake_vllm, target, micro_target_dir, tmp_path):
    regenerate_train(target, micro_target_dir, tmp_path, {**DATA, "generation_backend": "vllm"}, num_prompts=8)
    ((prompts, params),) = FakeLLM.instances[0].calls  # 8 rows: one call at the default 1024 per call
    assert len(prompts) == 8 and all(p.temperature == 0.0 and p.seed is None for p in params)


def test_vllm_regeneration_resumes_after_the_last_finished_call(fake_vllm, target, micro_target_dir, tmp_path):
    data = {**DATA, "sampling": "sample", "generation_backend": "vllm", "vllm": {"requests_per_call": 8}}
    expected = regenerate_train(target, micro_target_dir, tmp_path / "uninterrupted", data)

    cache = tmp_path / "killed"
    vllm_backend.close_shared_engine()
    original_init = FakeLLM.__init__

    def failing_init(self, **kwargs):
        original_init(self, **kwargs)
        self.fail_at = 2  # killed in the third call: calls 0 and 1 (batches 0-3) were saved

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(FakeLLM, "__init__", failing_init)
        with pytest.raises(InterruptedError):
            regenerate_train(target, micro_target_dir, cache, data)
    (partial,) = (cache / "data").glob(".train-*.partial")
    assert sorted(p.name for p in partial.iterdir()) == [f"batch-{i:06d}.pt" for i in range(4)]

    vllm_backend.close_shared_engine()  # a new process: a new engine
    dataset = regenerate_train(target, micro_target_dir, cache, data)
    (prompts, params), *more = FakeLLM.instances[-1].calls
    assert not more and len(prompts) == 8  # only batches 4 and 5 were generated again
    assert params[0].seed == request_seed(SEED, 4, 0)
    assert dataset.to_dict() == expected.to_dict()
    assert not partial.exists()
    # The hf and vllm data of the same inputs live under different keys.
    (folder,) = (cache / "data").iterdir()
    hf_key = regenerate.regeneration_cache_key(
        target, DATA, split="train", num_prompts=NUM_PROMPTS, seed=SEED, target_id=str(micro_target_dir)
    )
    assert folder.name.startswith("train-") and not folder.name.endswith(hf_key)


def test_task_data_makes_every_split_with_one_engine_then_shuts_it_down(fake_vllm, micro_train_overrides, tmp_path):
    """The config keys reach the backend through Hydra; the engine is built once and released at the end."""
    from dflash2.training.run import run_from_config

    GlobalHydra.instance().clear()
    overrides = [
        *micro_train_overrides,
        f"paths.cache_dir={tmp_path / 'cache'}",  # fake data must not reach the session's shared cache
        f"paths.output_dir={tmp_path / 'run'}",
        "task=data",
        "data.generation_backend=vllm",
        "data.vllm.max_num_seqs=16",
        "data.vllm.engine_args={enable_prefix_caching: false}",
    ]
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    GlobalHydra.instance().clear()
    run_from_config(cfg)
    (llm,) = FakeLLM.instances
    assert llm.kwargs["max_num_seqs"] == 16 and llm.kwargs["enable_prefix_caching"] is False
    assert len(llm.calls) == 3 and llm.shut_down  # train, validation, held-out: one call each
    assert len(list((tmp_path / "cache" / "data").glob("*-*"))) == 3


# ---------------------------------------------------------------- pieces
SETTINGS = GenerationSettings(max_new_tokens=6, sample=False, temperature=1.0, eos_token_id=0, pad_token_id=1, seed=0)


def test_response_rows_end_at_the_first_eos_and_are_padded_to_r():
    def row(tokens, finish="length"):
        return response_row(types.SimpleNamespace(token_ids=tokens, finish_reason=finish), SETTINGS)

    assert row([5, 6, 7, 8, 9, 10]) == [5, 6, 7, 8, 9, 10]
    assert row([5, 6, 0], "stop") == [5, 6, 0, 1, 1, 1]
    assert row([5, 0, 7, 0]) == [5, 0, 1, 1, 1, 1]  # nothing after the first EOS survives
    assert row([5, 6], "stop") == [5, 6, 0, 1, 1, 1]  # an engine that strips the stop token
    assert row([5, 6, 7, 8, 9, 10, 11, 12]) == [5, 6, 7, 8, 9, 10]


def test_outputs_are_matched_to_their_requests():
    requests = [{"prompt_token_ids": [i, i]} for i in range(3)]
    outputs = [types.SimpleNamespace(request_id=str(10 + i), prompt_token_ids=[i, i]) for i in range(3)]
    assert in_request_order(outputs[::-1], requests) == outputs
    with pytest.raises(RuntimeError, match="out of order"):
        in_request_order([outputs[1], outputs[0], outputs[2]], [requests[0], requests[0], requests[2]])
    with pytest.raises(RuntimeError, match="2 outputs for 3 requests"):
        in_request_order(outputs[:2], requests)


def test_calls_group_whole_batches():
    from dflash2.data.vllm_backend import VllmBackend

    backend = VllmBackend(None, None, SETTINGS, requests_per_call=10)
    assert backend.calls([4, 4, 4, 12, 1, 1], 0) == [range(0, 2), range(2, 3), range(3, 4), range(4, 6)]
    assert backend.calls([4, 4, 4, 12, 1, 1], 3) == [range(3, 4), range(4, 6)]
    hf_like = VllmBackend(None, None, SETTINGS, requests_per_call=1)
    assert hf_like.calls([4, 4], 0) == [range(0, 1), range(1, 2)]
