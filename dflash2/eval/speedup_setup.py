"""What ``eval.speedup`` measures: a target + drafter pair and prompts (docs/ARCHITECTURE.md §6).

Two sources:

* a trained pair: the target's HF folder and a drafter folder (``load_drafter``), prompts from
  ``dflash2.eval.prompts`` (held-out text, tokenized by the target's tokenizer);
* random weights at a named shape (:data:`SHAPES`): the HF model is built with its own random init
  on the device, the runtime target shares its weights, and a random DFlash2 drafter of the same
  width drafts for it; prompts are random token ids. Step times of a dense model do not depend on
  weight values, so these give honest step times; τ of random weights is ≈ 1 and means nothing, so
  speedups at these shapes are *predicted* from a given τ. A full-size shape gets the generic
  drafter of :func:`generic_drafter_config` (:data:`GENERIC_BLOCK_SIZE`, :data:`GENERIC_DRAFTER_LAYERS`
  unless given); a shape naming a training ``experiment`` is that experiment's target and drafter,
  read from configs/ (``dflash2.eval.speedup_recipe``).

Either way the result is a :class:`Pair`: the HF model (baseline (a)), the runtime target and
the runtime drafter (sharing the target's embedding and LM head).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from dflash2.errors import DFlash2Error

log = logging.getLogger(__name__)

# Qwen3-8B's config.json values (hidden, depth, heads, vocab, RoPE base), random weights
QWEN3_8B = dict(
    model_type="qwen3",
    hidden_size=4096,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=12288,
    vocab_size=151936,
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
# a CPU-sized Qwen3 for tests of the command itself
TINY = dict(
    model_type="qwen3",
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=256,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
    initializer_range=0.1,
)
# HF config values (model_type picks the class), or the pair a training experiment trains (speedup_recipe.py)
SHAPES = {
    "qwen3_8b": QWEN3_8B,
    "qwen3_5_9b": dict(model_type="qwen3_5_text"),
    # target=small (12-layer Qwen3.5 hybrid, hidden 768) and its DFlash2 drafter (3 layers, block 8)
    "small_hybrid": dict(experiment="drafter_small"),
    "tiny": TINY,
}
# the generic drafter's block size and depth when the command line leaves them null (experiment shapes: its own)
GENERIC_BLOCK_SIZE = 16
GENERIC_DRAFTER_LAYERS = 5


@dataclass
class Pair:
    """hf: the HF causal LM (or None when the baseline is skipped); target: runtime model; drafter:
    RuntimeDrafter; prompts: N id lists; label: what was measured; random: random weights (τ means nothing)."""

    hf: object
    target: object
    drafter: object
    prompts: list[list[int]]
    label: str
    random: bool
    eos_token_id: int | None = None


def shape_config(name: str):
    """The transformers config of a named shape (Qwen3.5-9B: ``Qwen3_5TextConfig()`` defaults; an experiment's:
    its target recipe's)."""
    import transformers

    values = dict(shape_values(name))
    if "experiment" in values:
        from dflash2.eval.speedup_recipe import experiment_config, recipe_target_config

        return recipe_target_config(experiment_config(values["experiment"]))
    kind = values.pop("model_type")
    if kind == "qwen3_5_text":
        return transformers.Qwen3_5TextConfig(**values)
    return transformers.Qwen3Config(**values)


def shape_values(name: str) -> dict:
    """:data:`SHAPES`' entry of ``name``; an unknown name is a one-line error listing the known ones."""
    if name not in SHAPES:
        raise DFlash2Error(f"shape={name!r} is not known; use one of {sorted(SHAPES)}")
    return SHAPES[name]


def spread_taps(num_layers: int, k: int) -> list[int]:
    """k tapped layers spread over the depth, from layer 1 to layer num_layers - 3 (DFlash's choice)."""
    if num_layers < 3 or k == 1:
        return [min(1, num_layers - 1)]
    hi = num_layers - 3
    return sorted({round(1 + i * (hi - 1) / (k - 1)) for i in range(k)})


def generic_drafter_config(target, *, block_size: int, num_layers: int):
    """A DFlash2 drafter's config (local conv + selector, released settings) at the runtime target's width,
    with its attention heads and k = 5 taps spread by :func:`spread_taps`."""
    from dflash2.drafter import DrafterConfig
    from dflash2.text_model import rope_theta

    cfg = target.config
    k = min(5, target.num_layers)
    return DrafterConfig(
        hidden_size=target.hidden_size,
        intermediate_size=int(cfg.intermediate_size),
        num_hidden_layers=num_layers,
        num_attention_heads=target.num_heads,
        num_key_value_heads=target.num_kv_heads,
        head_dim=target.head_dim,
        rope_theta=rope_theta(cfg),  # the target's base (dflash2.text_model): no default of our own
        max_position_embeddings=int(cfg.max_position_embeddings),
        vocab_size=target.vocab_size,
        target_hidden_size=target.hidden_size,
        target_layer_ids=spread_taps(target.num_layers, k),
        mask_token_id=target.vocab_size - 1,
        block_size=block_size,
        use_local_conv=True,
        conv_group_size=16 if target.hidden_size % 16 == 0 else 8,
        use_selector=True,
        selector_rank=min(256, target.hidden_size),
        selector_top_k=16,
    )


def random_drafter(config, weight: torch.Tensor, *, seed: int):
    """A DFlash2 drafter of ``config`` with random weights from ``seed``, on the device and in the dtype of
    ``weight`` (the target's embedding), in eval mode."""
    from dflash2.drafter import DFlashDrafter

    torch.manual_seed(seed)
    with torch.device(weight.device):
        drafter = DFlashDrafter(config)
    return drafter.to(weight.dtype).eval()


def shape_drafter_config(shape: str, hf, target, *, block_size: int | None, drafter_layers: int | None):
    """The drafter's config at ``shape`` for its HF model ``hf`` and runtime target ``target``; block size and
    depth None = the shape's own (an experiment's drafter group, else the generic defaults)."""
    experiment = shape_values(shape).get("experiment")
    if experiment:
        from dflash2.eval.speedup_recipe import experiment_config, recipe_drafter_config

        cfg = experiment_config(experiment, block_size=block_size, drafter_layers=drafter_layers)
        return recipe_drafter_config(cfg, hf)
    return generic_drafter_config(
        target,
        block_size=GENERIC_BLOCK_SIZE if block_size is None else block_size,
        num_layers=GENERIC_DRAFTER_LAYERS if drafter_layers is None else drafter_layers,
    )


def random_model(shape: str, *, dtype, device, seed: int):
    """The HF causal LM of a named shape with its own random init, built on ``device`` in ``dtype``,
    frozen (eval, no gradients). Also the target of the training throughput benchmark
    (``dflash2.training.bench_throughput``)."""
    from transformers import AutoModelForCausalLM

    config = shape_config(shape)
    torch.manual_seed(seed)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype).eval().requires_grad_(False)


def random_pair(
    shape: str,
    *,
    dtype,
    device,
    block_size: int | None = None,
    drafter_layers: int | None = None,
    batch: int,
    prompt_tokens: int,
    seed: int,
):
    """HF model with its own random init at ``shape``, the runtime target over its weights, a random drafter
    (block size and depth None = the shape's own: :func:`shape_drafter_config`)."""
    from dflash2.runtime import RuntimeDrafter
    from dflash2.runtime.models import from_hf_model

    hf = random_model(shape, dtype=dtype, device=device, seed=seed)
    probe = from_hf_model(hf)  # to size the drafter; the taps are set once its layers are known
    config = shape_drafter_config(shape, hf, probe, block_size=block_size, drafter_layers=drafter_layers)
    drafter = random_drafter(config, probe.embed.weight, seed=seed + 1)
    probe.set_taps(config.target_layer_ids)
    g = torch.Generator().manual_seed(seed + 2)
    c = drafter.config
    ids = torch.randint(0, hf.config.vocab_size - 1, (batch, prompt_tokens), generator=g)
    ids[ids >= c.mask_token_id] += 1  # never the mask id (the generic drafter's is the last id: nothing moves)
    prompts = ids.tolist()
    label = (
        f"random weights, shape={shape} (drafter: {c.num_hidden_layers} layers, block {c.block_size}, "
        f"taps {list(c.target_layer_ids)})"
    )
    return Pair(hf, probe, RuntimeDrafter(drafter, probe), prompts, label, True)


def trained_pair(
    target_dir: str,
    drafter_dir: str,
    *,
    dtype,
    device,
    prompts,
    num_prompts: int,
    prompt_tokens: int,
    prompts_per_document: int = 1,
):
    """A trained drafter and its target from folders; prompts through the target's tokenizer.

    prompts_per_document: held-out prefixes cut from each held-out document (a small held-out
    split has fewer documents than the prompts asked for).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash2.drafter.io import load_drafter
    from dflash2.eval.prompts import prompt_set
    from dflash2.runtime import RuntimeDrafter, load_model

    drafter = load_drafter(str(drafter_dir), device=device, dtype=dtype)
    target = load_model(
        str(target_dir), dtype=dtype, device=device, target_layer_ids=list(drafter.config.target_layer_ids)
    )
    hf = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=dtype).to(device).eval().requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    chosen = prompt_set(
        str(prompts),
        tokenizer,
        num_prompts=num_prompts,
        prompt_tokens=prompt_tokens,
        prompts_per_document=prompts_per_document,
    )
    if chosen.info.get("shortfall"):  # fewer prompts than asked (a small held-out split, a short file): say so
        sampled = chosen.info.get("set") in ("heldout", "ood")
        log.warning("prompts: %s%s", chosen.info["shortfall"], " (prompts_per_document=2 or more cuts more)" * sampled)
    ids = [list(map(int, p.ids)) for p in chosen.prompts]
    label = f"trained pair: target {target_dir}, drafter {drafter_dir}"
    return Pair(hf, target, RuntimeDrafter(drafter, target), ids, label, False, tokenizer.eos_token_id)
