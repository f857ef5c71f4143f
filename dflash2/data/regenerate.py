"""Regenerate responses with the frozen target and cache them (issue 3, DESIGN §2).

The drafter must learn the *target's* distribution, so training responses are
the target's own continuations of corpus prompts (greedy or sampled). The
result is a `datasets` Arrow dataset with columns

    input_ids  list[int]   prompt + response (+ EOS), right-padded per row
    loss_mask  list[int]   1 on response tokens (EOS included), 0 elsewhere
    prompt_len int

saved under `cache_dir/data/<fingerprint>/`, where the fingerprint hashes the
target, the corpus split and every generation setting: a rerun with the same
inputs reuses it, a changed input regenerates. Writes go to a temporary folder
renamed into place, so an interrupted run leaves no half dataset behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
import numpy as np
import torch
from tqdm.auto import tqdm

from dflash2.corpus import corpus_fingerprint, load_documents
from dflash2.data.prompts import code_prompt_batches
from dflash2.errors import DFlash2Error


def target_fingerprint(name_or_path: str | Path) -> str:
    """Identity of a target: its config and weight file names/sizes (or the hub id)."""
    path = Path(str(name_or_path))
    if not path.is_dir():
        return f"hub:{name_or_path}"
    h = hashlib.sha256((path / "config.json").read_bytes() if (path / "config.json").exists() else b"")
    for f in sorted(path.iterdir()):
        if f.suffix in (".safetensors", ".bin"):
            h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()[:16]


def generation_settings(data: dict, split: str, num_prompts: int, seed: int) -> dict:
    """The settings a regenerated dataset depends on (part of its cache key)."""
    return {
        "split": split,
        "num_prompts": int(num_prompts),
        "prompt_min_tokens": int(data["prompt_min_tokens"]),
        "prompt_max_tokens": int(data["prompt_max_tokens"]),
        "response_tokens": int(data["response_tokens"]),
        "sampling": str(data["sampling"]),
        "temperature": float(data["temperature"]),
        "seed": int(seed),
    }


@torch.no_grad()
def generate_responses(target, prompt_ids: torch.Tensor, *, max_new_tokens: int, eos_token_id: int, pad_token_id: int, sample: bool, temperature: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """Plain KV-cached decoding of a batch of equal-length prompts.

    `target` is a TargetModel; prompt_ids: (n, P) int64. Returns (n, max_new_tokens) int64 where tokens
    after a row's first EOS are `pad_token_id`. Greedy when `sample` is False.
    Written out (rather than `generate`) so the sampling RNG is an explicit
    generator and the loop is identical across transformers versions.
    """
    device = next(target.model.parameters()).device
    ids = prompt_ids.to(device)
    out = target(ids, use_cache=True)  # TargetModel hides the cache-kwarg rename across transformers versions
    cache, logits = out.past_key_values, out.logits[:, -1]
    finished = torch.zeros(ids.shape[0], dtype=torch.bool, device=device)
    tokens = []
    for _ in range(max_new_tokens):
        if sample:
            probs = torch.softmax(logits.float() / max(temperature, 1e-5), dim=-1)
            nxt = torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(1).to(device)
        else:
            nxt = logits.argmax(dim=-1)
        nxt = torch.where(finished, torch.full_like(nxt, pad_token_id), nxt)
        tokens.append(nxt)
        finished |= nxt == eos_token_id
        if bool(finished.all()):
            break
        out = target(nxt[:, None], past_key_values=cache)
        cache, logits = out.past_key_values, out.logits[:, -1]
    result = torch.stack(tokens, dim=1)
    if result.shape[1] < max_new_tokens:
        pad = torch.full((result.shape[0], max_new_tokens - result.shape[1]), pad_token_id, dtype=result.dtype, device=device)
        result = torch.cat([result, pad], dim=1)
    return result.cpu()


def regenerate_split(target, data: dict, *, split: str, num_prompts: int, seed: int, cache_dir: Path, target_id: str, device: str = "cpu"):
    """Build or load the regenerated dataset of one corpus split; returns a `datasets.Dataset`.

    `data` is the plain dict of the `data` config group; `target` a TargetModel.
    """
    import datasets

    if data["sampling"] not in ("greedy", "sample"):
        raise DFlash2Error(f"data.sampling={data['sampling']!r}: use 'greedy' or 'sample'")
    sources = data["sources"]
    split_kw = {"validation_fraction": float(data["validation_fraction"]), "heldout_fraction": float(data["heldout_fraction"])}
    settings = generation_settings(data, split, num_prompts, seed)
    key = hashlib.sha256(
        json.dumps({"target": target_fingerprint(target_id), "corpus": corpus_fingerprint(sources, split, **split_kw), "settings": settings}, sort_keys=True).encode()
    ).hexdigest()[:16]
    final = Path(cache_dir) / "data" / f"{split}-{key}"
    if (final / "dataset_info.json").exists():
        return datasets.load_from_disk(str(final))

    tokenizer = target.tokenizer
    if tokenizer is None:
        raise DFlash2Error(f"target {target_id} has no tokenizer files; regeneration needs one next to the weights")
    docs = load_documents(sources, split, **split_kw)
    if not docs:
        raise DFlash2Error(f"the corpus split '{split}' is empty for data.sources={sources}; add sources or change the split fractions")
    batches = code_prompt_batches(
        docs, tokenizer, num_prompts=num_prompts, min_tokens=int(data["prompt_min_tokens"]), max_tokens=int(data["prompt_max_tokens"]),
        batch_size=int(data["generation_batch_size"]), seed=seed,
    )
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    generator = torch.Generator().manual_seed(seed)
    target.model.to(device)
    rows: dict[str, list] = {"input_ids": [], "loss_mask": [], "prompt_len": []}
    response_len = int(data["response_tokens"])
    for batch in tqdm(batches, desc=f"regenerating {split} responses", unit="batch"):
        prompt = torch.from_numpy(batch.input_ids)
        response = generate_responses(
            target, prompt, max_new_tokens=response_len, eos_token_id=eos, pad_token_id=pad,
            sample=data["sampling"] == "sample", temperature=float(data["temperature"]), generator=generator,
        )
        for p, r in zip(prompt.tolist(), response.tolist()):
            mask = _response_mask(r, eos, pad)
            rows["input_ids"].append(p + r)
            rows["loss_mask"].append([0] * len(p) + mask)
            rows["prompt_len"].append(len(p))
    if not any(any(m) for m in rows["loss_mask"]):
        raise DFlash2Error(f"regeneration of split '{split}' produced no response tokens (the target emits EOS at once?); check the target")
    dataset = datasets.Dataset.from_dict(rows)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    dataset.save_to_disk(str(tmp))
    if not final.exists():
        os.replace(tmp, final)
    else:
        shutil.rmtree(tmp)
    return datasets.load_from_disk(str(final))


def _response_mask(response: list[int], eos: int, pad: int) -> list[int]:
    """1 up to and including the first EOS, 0 for the padding after it."""
    mask, done = [], False
    for t in response:
        mask.append(0 if done else 1)
        done = done or t == eos
    return mask

