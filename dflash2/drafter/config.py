"""Drafter configuration (ARCHITECTURE.md §2, §3).

One dataclass covers DFlash v1 and DFlash2: v1 is simply ``use_local_conv=False,
use_selector=False``, so every DFlash2 ablation runs the same code with a flag
flipped. Serialised as a plain dict (``to_dict`` / ``from_dict``) inside the
exported ``config.json`` (see ``dflash2.drafter.io``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from dflash2.errors import DFlash2Error

LAYER_KINDS = ("full_attention", "sliding_attention")


@dataclass
class DrafterConfig:
    # --- Qwen3-style decoder stack at the target's width (ARCHITECTURE.md §2.4) ---
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float  # must equal the target's RoPE base (a mismatch fails silently, §7)
    max_position_embeddings: int
    # --- tied to the frozen target ---
    vocab_size: int  # the TARGET's vocab: the drafter has no embedding / LM head
    target_hidden_size: int  # width d_t of each tapped target feature
    # Decoder layer ids whose *outputs* are tapped (HF hidden_states[id + 1]).
    target_layer_ids: list[int]
    mask_token_id: int  # an unused id *inside* the target vocab
    rms_norm_eps: float = 1e-6  # Qwen3's value
    num_target_layers: int | None = None  # the target's depth, when known (export only)
    block_size: int = 8  # DFlash2 releases use 8 (the v1 paper used 16)
    # --- attention kind per layer (§2.4); None = every layer "full_attention" ---
    # "sliding_attention" layers see only keys with |query position - key position| < sliding_window
    # (context and block alike, vLLM's and z-lab's non-causal window); z-lab's DFlash2 drafters use them.
    layer_types: list[str] | None = None
    sliding_window: int | None = None  # W of the sliding_attention layers (None without any)
    # --- serving scales of the published DFlash2 contract (§3.4); defaults = no scaling ---
    input_embedding_scale: float = 1.0  # block embeddings are multiplied by it
    output_multiplier: float = 1.0  # drafter logits are multiplied by it, then
    final_logit_softcapping: float | None = None  # capped: cap * tanh(logits / cap); None = no cap
    # --- DFlash2 additions (§3); both off == DFlash v1 ---
    use_local_conv: bool = False
    conv_kernel_size: int = 2  # released setting: taps t = 0, 1
    conv_group_size: int = 16  # released setting: channels per dynamic-kernel group
    use_selector: bool = False
    selector_rank: int = 256  # released setting
    selector_top_k: int = 16  # the right token is in the top-16 99.5% of the time (§3)
    # --- provenance ---
    target_name_or_path: str | None = None
    # dflash2.tokenizer.tokenizer_fingerprint of the target's tokenizer at training time; a target
    # whose tokenizer hashes differently is refused (same vocab size, other ids). None: not recorded.
    target_tokenizer_fingerprint: str | None = None
    # The corpus split the drafter was trained on (dflash2.data.split_record): sources, split fractions,
    # near-duplicate threshold, split rule, seed. Evaluation draws held-out prompts from it and refuses
    # prompts of its train split. None: not recorded (older drafters; evaluation assumes the defaults).
    training_data: dict | None = None

    # ------------------------------------------------------------------ helpers
    @property
    def num_taps(self) -> int:
        """K, the number of tapped target layers (``fc`` maps K·d_t -> d)."""
        return len(self.target_layer_ids)

    @property
    def conv_groups(self) -> int:
        """Dynamic-kernel channel groups of the local conv (hidden // group size)."""
        return self.hidden_size // self.conv_group_size

    @property
    def layer_kinds(self) -> list[str]:
        """One attention kind per layer ("full_attention" unless ``layer_types`` says otherwise)."""
        return list(self.layer_types) if self.layer_types is not None else ["full_attention"] * self.num_hidden_layers

    @property
    def has_sliding_layers(self) -> bool:
        return "sliding_attention" in self.layer_kinds

    @property
    def serving_scales(self) -> dict[str, float]:
        """The serving scales (§3.4) that differ from their no-op defaults, name -> value (config.json order)."""
        defaults = {"input_embedding_scale": 1.0, "output_multiplier": 1.0, "final_logit_softcapping": None}
        return {k: getattr(self, k) for k, d in defaults.items() if getattr(self, k) != d}

    @property
    def is_v2(self) -> bool:
        return bool(self.use_local_conv or self.use_selector)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["target_layer_ids"] = list(d["target_layer_ids"])
        if d["layer_types"] is not None:
            d["layer_types"] = list(d["layer_types"])
        return d

    @classmethod
    def from_dict(cls, d: dict) -> DrafterConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise DFlash2Error(
                f"drafter config has unknown field(s) {unknown[:5]}; "
                f"remove them or fix the spelling (known: {sorted(known)})"
            )
        required = {
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        }
        missing = sorted(required - set(d))
        if missing:
            raise DFlash2Error(f"drafter config is missing required field(s) {missing}; add them")
        cfg = cls(**d)
        cfg.target_layer_ids = [int(i) for i in cfg.target_layer_ids]
        if cfg.layer_types is not None:
            cfg.layer_types = [str(k) for k in cfg.layer_types]
        cfg.validate()
        return cfg

    def validate(self) -> DrafterConfig:
        """Raise DFlash2Error naming the first inconsistent field and the fix."""

        def need(ok: bool, msg: str):
            if not ok:
                raise DFlash2Error(f"drafter config: {msg}")

        for name in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
            "vocab_size",
            "target_hidden_size",
        ):
            v = getattr(self, name)
            need(isinstance(v, int) and v > 0, f"{name}={v!r} must be a positive integer")
        need(
            self.num_attention_heads % self.num_key_value_heads == 0,
            f"num_attention_heads={self.num_attention_heads} must be a multiple of "
            f"num_key_value_heads={self.num_key_value_heads} (GQA)",
        )
        need(self.head_dim % 2 == 0, f"head_dim={self.head_dim} must be even (RoPE rotates pairs)")
        need(self.rms_norm_eps > 0, f"rms_norm_eps={self.rms_norm_eps} must be > 0")
        need(self.rope_theta > 0, f"rope_theta={self.rope_theta} must be > 0")
        need(len(self.target_layer_ids) > 0, "target_layer_ids is empty; list at least one target layer")
        need(all(i >= 0 for i in self.target_layer_ids), f"target_layer_ids={self.target_layer_ids} must be >= 0")
        if self.num_target_layers is not None:
            need(
                max(self.target_layer_ids) < self.num_target_layers,
                f"target_layer_ids={self.target_layer_ids} must be < num_target_layers={self.num_target_layers}",
            )
        need(
            isinstance(self.block_size, int) and self.block_size >= 2,
            f"block_size={self.block_size} must be >= 2 (anchor + at least one drafted token)",
        )
        need(
            0 <= self.mask_token_id < self.vocab_size,
            f"mask_token_id={self.mask_token_id} must lie in [0, vocab_size={self.vocab_size}); "
            f"pick an unused id of the target vocab",
        )
        self._validate_attention_and_scales(need)
        if self.use_local_conv:
            need(
                1 <= self.conv_kernel_size <= self.block_size,
                f"conv_kernel_size={self.conv_kernel_size} must be in [1, block_size={self.block_size}]",
            )
            need(
                self.conv_group_size > 0 and self.hidden_size % self.conv_group_size == 0,
                f"hidden_size={self.hidden_size} must be divisible by conv_group_size={self.conv_group_size}",
            )
        if self.use_selector:
            need(self.selector_rank > 0, f"selector_rank={self.selector_rank} must be > 0")
            need(
                1 <= self.selector_top_k <= self.vocab_size,
                f"selector_top_k={self.selector_top_k} must be in [1, vocab_size={self.vocab_size}]",
            )
        return self

    def _validate_attention_and_scales(self, need) -> None:
        kinds = self.layer_kinds
        need(
            len(kinds) == self.num_hidden_layers,
            f"layer_types has {len(kinds)} entries but num_hidden_layers={self.num_hidden_layers}; give one per layer",
        )
        unknown = sorted(set(kinds) - set(LAYER_KINDS))
        need(not unknown, f"layer_types has {unknown}; use {list(LAYER_KINDS)}")
        w = self.sliding_window
        if self.has_sliding_layers:
            need(
                isinstance(w, int) and not isinstance(w, bool) and w >= 1,
                f"sliding_window={w!r} must be a positive integer when a layer is sliding_attention",
            )
        else:  # a window no layer reads would be a silent no-op
            need(w is None, f"sliding_window={w} but no layer is sliding_attention; set layer_types or drop the window")
        for name in ("input_embedding_scale", "output_multiplier"):
            v = getattr(self, name)
            # > 0: a negative multiplier would reverse the candidate order that engines take before scaling
            ok = isinstance(v, (int, float)) and math.isfinite(v) and v > 0
            need(ok, f"{name}={v!r} must be a finite number > 0")
        cap = self.final_logit_softcapping
        need(
            cap is None or (isinstance(cap, (int, float)) and math.isfinite(cap) and cap > 0),
            f"final_logit_softcapping={cap!r} must be null (no cap) or a finite number > 0",
        )
