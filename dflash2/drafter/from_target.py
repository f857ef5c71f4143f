"""Derive a drafter's config from the target it drafts for (ARCHITECTURE.md §2.3)."""

from __future__ import annotations

from dflash2.drafter.config import DrafterConfig
from dflash2.drafter.parameter_count import dflash2_counterpart, widened_to_match
from dflash2.errors import DFlash2Error
from dflash2.text_model import config_field, rope_theta
from dflash2.tokenizer import tokenizer_fingerprint


def drafter_config_for_target(settings: dict, target) -> DrafterConfig:
    """A DrafterConfig from the `drafter` config group and a TargetModel.

    The drafter embeds blocks with the target's embedding and reads logits from
    the target's LM head, so its width and vocabulary are the target's; a
    different explicit value is a user error, reported before any training.

    Fields copied from the target come from its *text* config (``target.text_config``,
    ``dflash2.text_model``): rms_norm_eps, max_position_embeddings, and, unless the
    drafter settings give them, intermediate_size and rope_theta. There is no fallback
    value here: a field the target's config lacks is a one-line error naming it (the only
    defaults are the HF config class's own, applied by transformers when config.json omits a
    field, e.g. rope_theta = the class's default_theta).
    """
    text = target.text_config
    hidden = settings.get("hidden_size") or target.hidden_size
    if hidden != target.hidden_size:
        raise DFlash2Error(
            f"drafter.hidden_size={hidden} but the target's hidden size is {target.hidden_size}; "
            "the drafter shares the target's embedding and LM head, so set drafter.hidden_size=null"
        )
    mask_id = settings.get("mask_token_id")
    if mask_id is None and target.tokenizer is not None:
        mask_id = target.tokenizer.mask_token_id
    if mask_id is None:
        raise DFlash2Error(
            "the target's tokenizer has no mask token; "
            "set drafter.mask_token_id to an unused id inside the target vocab"
        )
    if not 0 <= int(mask_id) < target.vocab_size:
        raise DFlash2Error(
            f"mask_token_id={mask_id} is outside the target vocab [0, {target.vocab_size}); "
            f"pick an unused id below {target.vocab_size}"
        )
    heads = int(settings["num_attention_heads"])
    intermediate = settings.get("intermediate_size") or config_field(
        text, "intermediate_size", "set drafter.intermediate_size"
    )
    theta = settings.get("rope_theta") or rope_theta(text, "set drafter.rope_theta to the target's RoPE base")
    config = DrafterConfig(
        hidden_size=hidden,
        intermediate_size=int(intermediate),
        num_hidden_layers=int(settings["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(settings["num_key_value_heads"]),
        head_dim=settings.get("head_dim") or hidden // heads,
        rms_norm_eps=float(config_field(text, "rms_norm_eps")),
        rope_theta=float(theta),
        max_position_embeddings=int(config_field(text, "max_position_embeddings")),
        vocab_size=target.vocab_size,
        target_hidden_size=target.hidden_size,
        target_layer_ids=list(target.target_layer_ids),
        block_size=int(settings["block_size"]),
        mask_token_id=int(mask_id),
        use_local_conv=bool(settings["use_local_conv"]),
        conv_kernel_size=int(settings["conv_kernel_size"]),
        conv_group_size=int(settings["conv_group_size"]),
        use_selector=bool(settings["use_selector"]),
        selector_rank=int(settings["selector_rank"]),
        selector_top_k=int(settings["selector_top_k"]),
        # the published DFlash2 contract (ARCHITECTURE.md §3.4); absent or null = full attention, no scaling
        layer_types=list(settings["layer_types"]) if settings.get("layer_types") else None,
        sliding_window=int(settings["sliding_window"]) if settings.get("sliding_window") is not None else None,
        input_embedding_scale=float(settings.get("input_embedding_scale", 1.0)),
        output_multiplier=float(settings.get("output_multiplier", 1.0)),
        final_logit_softcapping=_optional_float(settings.get("final_logit_softcapping")),
        target_name_or_path=str(target.name_or_path),
        target_tokenizer_fingerprint=tokenizer_fingerprint(target.tokenizer) if target.tokenizer is not None else None,
    )
    config.validate()
    if settings.get("match_dflash2_parameters"):
        # the capacity control of the ablation: v1 as large as DFlash2 at these settings (parameter_count.py)
        config = widened_to_match(config, dflash2_counterpart(config))
    return config


def check_drafter_matches_target(config: DrafterConfig, target) -> None:
    """Refuse a drafter trained for another target (vocab, width, taps, tokenizer).

    The tokenizer is compared only when both sides know it: the drafter's config
    records a fingerprint (drafters from elsewhere may not) and the target has
    tokenizer files.
    """
    problems = []
    if config.vocab_size != target.vocab_size:
        problems.append(f"vocab {config.vocab_size} vs target {target.vocab_size}")
    if config.target_hidden_size != target.hidden_size or config.hidden_size != target.hidden_size:
        problems.append(f"hidden size {config.hidden_size}/{config.target_hidden_size} vs target {target.hidden_size}")
    if max(config.target_layer_ids) >= target.num_layers:
        problems.append(f"taps {config.target_layer_ids} but the target has {target.num_layers} layers")
    recorded = config.target_tokenizer_fingerprint
    if recorded and target.tokenizer is not None and tokenizer_fingerprint(target.tokenizer) != recorded:
        problems.append(
            f"tokenizer fingerprint {recorded} vs target {tokenizer_fingerprint(target.tokenizer)}: "
            "same ids mean other tokens"
        )
    if problems:
        raise DFlash2Error(
            f"drafter was trained for another target ({'; '.join(problems)}); "
            "use the target it was trained with or train a new drafter"
        )


def _optional_float(value) -> float | None:
    return float(value) if value is not None else None
