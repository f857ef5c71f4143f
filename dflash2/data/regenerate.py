"""Regenerate responses with the frozen target and cache them (issue 3, ARCHITECTURE.md §2.6).

The drafter must learn the *target's* distribution, so training responses are
the target's own continuations of corpus prompts, or its own replies to chat
prompts (``data.chat``, ARCHITECTURE.md §2.8), greedy or sampled. The result is
a `datasets` Arrow dataset with columns

    input_ids  list[int]   prompt + response (+ EOS), right-padded per row
    loss_mask  list[int]   1 on response tokens (EOS included), 0 elsewhere: for chat data the
                           prompt (system / user turns, earlier assistant turns, template
                           markers) carries no loss, only the regenerated assistant turn does
    prompt_len int

saved under `cache_dir/data/<split>-<key>/`, where the key hashes the
target, the dtype it runs in, the corpus split and every generation setting: a rerun with the same
inputs reuses it, a changed input regenerates. The dataset is written to a
temporary folder renamed into place, so an interrupted run leaves no half
dataset behind.

The target generates through the backend `data.generation_backend` names
(`generation_backend`): `hf`, the target's HF model in this process (default), or
`vllm`, a vLLM engine on the target folder (`vllm_backend`); the key names a
backend other than hf, so their data never mix.

Regeneration on a real target takes hours, so a kill must not lose it: every
finished generation batch is also saved at once, atomically, to the partial
folder `cache_dir/data/.<split>-<key>.partial/` (see `shard_store`), together
with the backend's state (hf: the sampling generator's). A rerun with the same
inputs loads those shards, skips their batches (the prompt batches are a
function of the seed) and continues from the saved state, so its dataset is row
for row the one an uninterrupted run writes, greedy or sampled (vllm: per-request
seeds, see `vllm_backend`). The folder name depends only on the inputs (no pid)
so that the rerun finds it; it is removed once the final dataset is in place.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import torch
from tqdm.auto import tqdm

from dflash2.corpus import corpus_fingerprint, load_documents, split_kwargs
from dflash2.data.chat_format import RowCounts, resolve_template
from dflash2.data.chat_sources import chat_fingerprint, iter_conversations
from dflash2.data.generation_backend import GenerationBackend, GenerationSettings, backend_name, make_backend
from dflash2.data.hf_backend import generate_responses  # here on purpose: tests replace it to watch the batches
from dflash2.data.prompts import PromptBatch, chat_prompt_batches, code_prompt_batches
from dflash2.data.shard_store import Shard, ShardStore
from dflash2.errors import DFlash2Error
from dflash2.target_dtype import dtype_name
from dflash2.tokenizer import CHAT_TEMPLATE

log = logging.getLogger(__name__)
CHAT_ROWS = "chat_rows.json"  # beside a chat dataset: what was read and why rows were skipped


def target_fingerprint(name_or_path: str | Path) -> str:
    """Identity of a target: its config, tokenizer and weight *contents* (or the hub id).

    The regenerated data is the target's output, so two targets with the same
    architecture but other weights (a retrained recipe, a new checkpoint at the
    same path) must not share cached data: the weights themselves are hashed.
    """
    path = Path(str(name_or_path))
    if not path.is_dir():
        return f"hub:{name_or_path}"
    h = hashlib.sha256()
    for f in sorted(path.iterdir()):
        if f.name in ("config.json", "tokenizer.json", "tokenizer_config.json") or f.suffix in (".safetensors", ".bin"):
            h.update(f"{f.name}:{f.stat().st_size}:".encode())
            h.update(_content_digest(f))
    return h.hexdigest()[:16]


def _content_digest(path: Path, full_below: int = 256 << 20, samples: int = 256, sample_bytes: int = 64 << 10) -> bytes:
    """sha256 of a file's bytes; above `full_below` bytes, of its first MiB plus `samples` evenly spaced chunks.

    Hashing a 16 GB checkpoint in full would add minutes to every run; any
    training step changes essentially every weight, so sampled chunks (and the
    safetensors header in the first MiB, which has every shape and offset)
    already tell two sets of weights apart.
    """
    size = path.stat().st_size
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= full_below:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
            return h.digest()
        h.update(f.read(1 << 20))
        for i in range(samples):
            f.seek((size - sample_bytes) * i // (samples - 1))
            h.update(f.read(sample_bytes))
    return h.digest()


def generation_settings(data: dict, split: str, num_prompts: int | None, seed: int) -> dict:
    """The settings a regenerated dataset depends on (part of its cache key); num_prompts None: all (chat)."""
    return {
        "split": split,
        "num_prompts": None if num_prompts is None else int(num_prompts),
        "prompt_min_tokens": int(data["prompt_min_tokens"]),
        "prompt_max_tokens": int(data["prompt_max_tokens"]),
        "response_tokens": int(data["response_tokens"]),
        "sampling": str(data["sampling"]),
        "temperature": float(data["temperature"]),
        "seed": int(seed),
    }


def regeneration_cache_key(
    target, data: dict, *, split: str, num_prompts: int | None, seed: int, target_id: str
) -> str:
    """16 hex digits naming a regenerated split: target contents, the dtype it runs in, corpus split,
    settings and, for chat data, the conversations and template.

    The dtype is part of it because a bf16 target's greedy continuations differ from its
    fp32 ones (near-ties flip), so each precision gets its own data (ARCHITECTURE.md §2.1); the
    generation backend for the same reason (and vllm's sampling draws other random numbers).
    """
    inputs = {
        "target": target_fingerprint(target_id),
        "target_dtype": dtype_name(target.dtype),
        "corpus": corpus_fingerprint(data["sources"], split, **split_kwargs(data)),
        "settings": generation_settings(data, split, num_prompts, seed),
    }
    backend = backend_name(data)
    if backend != "hf":  # hf keys stay what they were before there were backends: existing caches stay valid
        inputs["generation_backend"] = backend
    template = chat_template_of(data, target.tokenizer)
    if template is not None:
        inputs["chat"] = {
            "conversations": chat_fingerprint(data["chat"]["conversations"]),
            "template": template,
            "plain_template": hashlib.sha256(CHAT_TEMPLATE.encode()).hexdigest()[:16] if template == "plain" else None,
        }
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]


def regenerate_split(
    target,
    data: dict,
    *,
    split: str,
    num_prompts: int | None,
    seed: int,
    cache_dir: Path,
    target_id: str,
    device: str = "cpu",
    missing_hint: str | None = None,
):
    """Build or load the regenerated dataset of one corpus split; returns a `datasets.Dataset`.

    `data` is the plain dict of the `data` config group; `target` a TargetModel. With
    `missing_hint`, a split that is not in the cache is an error (with that hint) instead of
    being generated: a process that must not generate (one of several started at once) says so.
    """
    import datasets

    if data["sampling"] not in ("greedy", "sample"):
        raise DFlash2Error(f"data.sampling={data['sampling']!r}: use 'greedy' or 'sample'")
    tokenizer = target.tokenizer
    if tokenizer is None:
        raise DFlash2Error(f"target {target_id} has no tokenizer files; regeneration needs one next to the weights")
    template = chat_template_of(data, tokenizer)
    key = regeneration_cache_key(target, data, split=split, num_prompts=num_prompts, seed=seed, target_id=target_id)
    final = Path(cache_dir) / "data" / f"{split}-{key}"
    if (final / "dataset_info.json").exists():
        if (final / CHAT_ROWS).exists():  # the summary of skipped rows, again for this run's log
            log.info(json.loads((final / CHAT_ROWS).read_text())["summary"])
        return datasets.load_from_disk(str(final))
    if missing_hint is not None:
        raise DFlash2Error(f"the regenerated {split} data is not in the cache ({final}); {missing_hint}")

    counts = RowCounts() if template is not None else None
    batches = prompt_batches(tokenizer, data, split=split, num_prompts=num_prompts, seed=seed, counts=counts)
    eos, pad = (
        tokenizer.eos_token_id,
        tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
    )
    settings = GenerationSettings(
        max_new_tokens=int(data["response_tokens"]),
        sample=data["sampling"] == "sample",
        temperature=float(data["temperature"]),
        eos_token_id=eos,
        pad_token_id=pad,
        seed=seed,
    )
    # generate_responses is passed from this module so that replacing regenerate.generate_responses reaches hf.
    backend = make_backend(data, target, settings, target_id=target_id, device=device, decode=generate_responses)
    prompts = [torch.from_numpy(b.input_ids) for b in batches]
    store = ShardStore(final.parent / f".{final.name}.partial")
    responses = _generate_resumable(backend, prompts, store, split=split, response_tokens=settings.max_new_tokens)
    rows = _dataset_rows(prompts, responses, eos, pad)
    if not any(any(m) for m in rows["loss_mask"]):
        raise DFlash2Error(
            f"regeneration of split '{split}' produced no response tokens "
            "(the target emits EOS at once?); check the target"
        )
    dataset = datasets.Dataset.from_dict(rows)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    dataset.save_to_disk(str(tmp))
    if counts is not None:
        summary = counts.summary(f"chat data, {split} split")
        (tmp / CHAT_ROWS).write_text(json.dumps({"summary": summary, **counts.to_dict()}, indent=2))
    if not final.exists():
        os.replace(tmp, final)
    else:
        shutil.rmtree(tmp)
    store.remove()  # only now: until the rename above, the shards are the only copy of the work
    return datasets.load_from_disk(str(final))


def chat_template_of(data: dict, tokenizer) -> str | None:
    """The chat template a data config uses with this tokenizer ("tokenizer" or "plain"); None for code data."""
    chat = data.get("chat")
    return resolve_template(str(chat.get("template", "auto")), tokenizer) if chat else None


def prompt_batches(
    tokenizer, data: dict, *, split: str, num_prompts: int | None, seed: int, counts: RowCounts | None = None
) -> list[PromptBatch]:
    """The generation prompts of one split: chat turns when ``data.chat`` is set (skipped rows go
    into ``counts`` and are logged in one line), else corpus file prefixes."""
    sources, batch_size = data["sources"], int(data["generation_batch_size"])
    template = chat_template_of(data, tokenizer)
    if template is not None:
        counts = counts if counts is not None else RowCounts()
        batches = chat_prompt_batches(
            iter_conversations(data, split, seed, counts),
            tokenizer,
            template=template,
            num_prompts=num_prompts,
            max_tokens=int(data["prompt_max_tokens"]),
            batch_size=batch_size,
            counts=counts,
        )
        summary = counts.summary(f"chat data, {split} split")
        log.info(summary)
        if not batches:
            raise DFlash2Error(f"no usable chat prompt in the {split} split ({summary}); check data.chat.conversations")
        return batches
    if num_prompts is None:
        raise DFlash2Error(f"data.num_*_prompts is null for the {split} split; code data needs a number")
    docs = load_documents(sources, split, **split_kwargs(data))
    if not docs:
        raise DFlash2Error(
            f"the corpus split '{split}' is empty for data.sources={sources}; add sources or change the split fractions"
        )
    return code_prompt_batches(
        docs,
        tokenizer,
        num_prompts=num_prompts,
        min_tokens=int(data["prompt_min_tokens"]),
        max_tokens=int(data["prompt_max_tokens"]),
        batch_size=batch_size,
        seed=seed,
    )


def _generate_resumable(
    backend: GenerationBackend, prompts: list[torch.Tensor], store: ShardStore, *, split: str, response_tokens: int
) -> list[torch.Tensor]:
    """Responses (n, R) int64 for every prompt batch (n, P) int64, in order.

    Batches that `store` already holds are loaded instead of generated; after every `generate`
    call of the backend (one batch for hf, up to data.vllm.requests_per_call rows for vllm) each
    of its batches is saved there, with the backend's state, before the next call starts.
    """
    done = store.load(prompts, response_tokens)
    # The state after the last saved batch: hf sampling continues as if never interrupted.
    backend.resume(done[-1].generator_state if done else None)
    if done:
        log.info(f"regeneration of {split}: resuming at batch {len(done)}/{len(prompts)} from {store.folder}")
    responses = [shard.response for shard in done]
    sizes = [int(p.shape[0]) for p in prompts]
    desc = f"regenerating {split} responses"
    with tqdm(initial=len(done), total=len(prompts), desc=desc, unit="batch") as progress:
        for call in backend.calls(sizes, len(done)):
            generated = backend.generate(call.start, [prompts[i] for i in call])
            state = backend.state()
            for i, response in zip(call, generated, strict=True):
                responses.append(response)
                store.save(Shard(i, prompts[i], response, state))
            progress.update(len(call))
    return responses


def _dataset_rows(prompts: list[torch.Tensor], responses: list[torch.Tensor], eos: int, pad: int) -> dict[str, list]:
    """The dataset columns (see the module docstring) from prompt (n, P) and response (n, R) batches."""
    rows: dict[str, list] = {"input_ids": [], "loss_mask": [], "prompt_len": []}
    for prompt, response in zip(prompts, responses):
        for p, r in zip(prompt.tolist(), response.tolist()):
            rows["input_ids"].append(p + r)
            rows["loss_mask"].append([0] * len(p) + _response_mask(r, eos, pad))
            rows["prompt_len"].append(len(p))
    return rows


def _response_mask(response: list[int], eos: int, pad: int) -> list[int]:
    """1 up to and including the first EOS, 0 for the padding after it."""
    mask, done = [], False
    for t in response:
        mask.append(0 if done else 1)
        done = done or t == eos
    return mask
