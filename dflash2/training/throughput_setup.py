"""What every row of ``bench_throughput`` shares: the random target, the drafter its config group
describes, and the CPU batches of both feature modes. Shapes: N rows, L = seq tokens, K·d taps."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from dflash2.errors import DFlash2Error


@dataclass(frozen=True)
class Variant:
    attention: str  # flex | dense: drafter.attention
    ce: str  # chunked | plain: drafter.loss_chunk_positions = the chunk, or 0
    features: str  # offline | online: data.features

    @property
    def name(self) -> str:
        return f"{self.attention} / {self.ce} CE / {self.features}"

    @property
    def key(self) -> tuple[str, str, str]:
        return self.attention, self.ce, self.features


def drafter_settings(option: str, overrides: dict) -> dict:
    """The ``drafter`` config group as ``python train.py drafter=<option>`` composes it, plus ``overrides``
    (``drafter.<key>=<value>``), as a plain dict."""
    from dflash2.train_config import compose_train
    from dflash2.training.build_target import to_plain

    cfg = compose_train([f"drafter={option}", *(f"drafter.{k}={v}" for k, v in overrides.items())])
    return to_plain(cfg.drafter)


def drafter_overrides(pairs: list[str] | None) -> dict[str, str]:
    """``--set KEY=VALUE`` pairs (drafter config keys, e.g. ``optimizer_impl=foreach``) as a dict; values are
    parsed by Hydra as on the command line of train.py."""
    out = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise DFlash2Error(f"--set {pair!r}: write KEY=VALUE, a key of the drafter config group")
        out[key.strip().removeprefix("drafter.")] = value.strip()
    return out


def random_target(shape: str, device: torch.device, seed: int):
    """A frozen TargetModel of random weights at ``shape``, in the dtype ``target.dtype=auto`` picks
    (bf16 on CUDA, fp32 on the CPU), with the default taps."""
    from dflash2.eval.speedup_setup import random_model
    from dflash2.target import TargetModel
    from dflash2.target_dtype import resolve_target_dtype

    dtype = resolve_target_dtype("auto", device)
    return TargetModel(random_model(shape, dtype=dtype, device=device, seed=seed), name_or_path=f"random:{shape}")


def synthetic_rows(rows: int, seq: int, prompt_tokens: int, vocab: int, mask_id: int, seed: int) -> list[dict]:
    """Rows as a regenerated split holds them: input_ids (seq,) random ids (never ``mask_id``), loss_mask
    0 on the first ``prompt_tokens`` (the prompt) and 1 on the rest (the response)."""
    if not 1 <= prompt_tokens <= seq - 2:
        raise DFlash2Error(f"--prompt-tokens={prompt_tokens} must leave a response: 1 <= it <= --seq - 2 = {seq - 2}")
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab - 1, (rows, seq), generator=g)
    ids[ids >= mask_id] += 1  # skip the mask id, stay below vocab
    mask = [0] * prompt_tokens + [1] * (seq - prompt_tokens)
    return [{"input_ids": ids[i].tolist(), "loss_mask": list(mask)} for i in range(rows)]


def offline_batch(target, rows: list[dict]) -> dict[str, torch.Tensor]:
    """The CPU batch of ``data.features=offline``: the rows' taps from ``sequence_features`` (what
    ``python -m dflash2.data.features`` stores), collated as the training loader does."""
    from dflash2.data.features import sequence_features
    from dflash2.training.drafter_data import collate_sequences

    feats = sequence_features(target, [r["input_ids"] for r in rows], top_k=0, batch_size=len(rows))
    batch = collate_sequences([{**r, "target_taps": f["taps"]} for r, f in zip(rows, feats)], pad_id=0)
    if target.model.device.type == "cuda":
        torch.cuda.empty_cache()  # the job's logits are gone: give their blocks back before the rows
    return batch


@dataclass
class Bench:
    """What every row shares: the target, the drafter (its initial weights on the CPU), the settings and
    the CPU batches (``offline`` carries ``target_taps``)."""

    target: object
    drafter: torch.nn.Module
    initial_state: dict
    settings: dict
    batches: dict
    device: torch.device
    seed: int
    chunk: int
    pinned: bool = False  # the batches are in page-locked memory (data.pin_memory, a GPU run)

    @property
    def rows(self) -> int:
        return self.batches["online"]["input_ids"].shape[0]

    @property
    def seq(self) -> int:
        return self.batches["online"]["input_ids"].shape[1]


def build_bench(a: argparse.Namespace, device: torch.device) -> Bench:
    """The target, the drafter the settings describe, and the batches, for every row of the run."""
    from dflash2.drafter.from_target import drafter_config_for_target
    from dflash2.training.drafter_data import collate_sequences
    from dflash2.training.train_drafter import fresh_drafter

    target = random_target(a.shape, device, a.seed)
    text = target.text_config
    heads = int(text.num_attention_heads)
    overrides = {
        "num_hidden_layers": a.layers,
        "block_size": a.block,
        "num_anchors": a.anchors,
        # the published drafters use the target's attention shape (the group's 4 / 2 heads are the tiny one's)
        "num_attention_heads": heads,
        "num_key_value_heads": int(text.num_key_value_heads),
        "head_dim": int(getattr(text, "head_dim", None) or target.hidden_size // heads),
        "mask_token_id": target.vocab_size - 1,  # random target, no tokenizer: the last id, never in the data
    }
    settings = drafter_settings(a.drafter, {**overrides, **drafter_overrides(a.set)})
    config = drafter_config_for_target(settings, target)
    drafter = fresh_drafter(config, settings, a.seed)
    initial = {k: v.clone() for k, v in drafter.state_dict().items()}  # on the CPU: every row starts here
    drafter.to(device)
    rows = synthetic_rows(a.rows, a.seq, a.prompt_tokens, target.vocab_size, config.mask_token_id, a.seed)
    batches = {"online": collate_sequences(rows, pad_id=0), "offline": offline_batch(target, rows)}
    # data.pin_memory as a run has it (auto: on a GPU); pinned once here, where the loader pins every batch
    pinned = device.type == "cuda" and a.pin_memory != "false"
    if pinned:
        batches = {mode: {k: v.pin_memory() for k, v in batch.items()} for mode, batch in batches.items()}
    chunk = a.chunk if a.chunk is not None else int(settings.get("loss_chunk_positions") or 1024)
    return Bench(target, drafter, initial, settings, batches, device, a.seed, chunk, pinned)
