"""The frozen target LLM and its feature taps (ARCHITECTURE.md §2.1).

A drafter never owns an embedding, an LM head or its own view of the text: it
reads the target's frozen ``embed_tokens`` / ``lm_head`` and the *outputs* of K
target decoder layers (``hidden_states[id + 1]`` in HF terms, because HF's
``hidden_states[0]`` is the embedding output). :class:`TargetModel` wraps any HF
causal LM (Qwen3, Qwen3.5 / Qwen3-Next hybrids, Llama, ...) loaded from a local
folder or a hub id and exposes exactly that.

Shapes: N = batch, L = sequence length, V = vocabulary rows, d = hidden size,
K = number of taps.
"""

from __future__ import annotations

import glob
import inspect
import json
import numbers
import os
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dflash2.errors import DFlash2Error
from dflash2.target_dtype import resolve_target_dtype
from dflash2.text_model import language_model, text_config

# Layer-type names found in HF configs -> the two kinds dflash2 cares about.
# Softmax attention of any window is rolled back by cropping its KV cache, so
# sliding/chunked attention count as "full_attention"; "linear_attention" is the
# name Qwen3-Next and Qwen3.5 use for their Gated DeltaNet layers, which carry a
# recurrent + conv state that needs ReplaySSM rollback (§5).
_LAYER_KINDS = {
    "full_attention": "full_attention",
    "attention": "full_attention",
    "sliding_attention": "full_attention",
    "chunked_attention": "full_attention",
    "linear_attention": "linear_attention",
    "gated_deltanet": "linear_attention",
    "gated_delta_net": "linear_attention",
}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def default_target_layer_ids(num_layers: int, num_taps: int = 5) -> list[int]:
    """Tap layers by the §2 rule ``round(linspace(1, L-3, K))``; 36 layers, K=5 -> [1, 9, 17, 25, 33].

    Layer 0 is skipped (its output is barely more than the embedding) and so are
    the last two layers (they specialise in the next-token logits). Rounding is
    Python's ``round`` (half to even), as in the reference implementation.

    Small targets: duplicates are dropped keeping order, so fewer than K ids may
    come back (L=4 -> [1]; L=5, K=5 -> [1, 2]). When L-3 < 1 (L <= 3) the range
    1..L-3 is empty, so the ids spread over ``range(max(L-1, 1))`` instead
    (L=3 -> [0, 1]; L=1 or 2 -> [0]). K=1 gives [1] (linspace of one point).
    """
    if not isinstance(num_layers, numbers.Integral) or num_layers < 1:
        raise DFlash2Error(f"target num_layers must be a positive integer, got {num_layers!r}")
    if not isinstance(num_taps, numbers.Integral) or num_taps < 1:
        raise DFlash2Error(f"num_taps must be a positive integer, got {num_taps!r}; use 5 (the §2 default)")
    start, end = (1, num_layers - 3) if num_layers - 3 >= 1 else (0, max(num_layers - 2, 0))
    points = [float(start)] if num_taps == 1 else [start + (end - start) * i / (num_taps - 1) for i in range(num_taps)]
    return list(dict.fromkeys(round(p) for p in points))  # dedupe, keep order


def tap_settings(group: Any) -> dict:
    """The tap arguments of :class:`TargetModel` from a ``target`` config group (a mapping):
    ``target_layer_ids`` (None = the §2 rule) and ``num_taps`` (default 5)."""
    ids = group.get("target_layer_ids")
    return {"target_layer_ids": list(ids) if ids is not None else None, "num_taps": int(group.get("num_taps", 5))}


def validate_target_layer_ids(ids: Any, num_layers: int) -> list[int]:
    """Check user-given tap ids: a non-empty list of distinct ints in [0, num_layers-1]; returns them as ``list[int]``.

    The order is kept: it is the order the features are concatenated in.
    """
    valid = f"valid layer ids are 0..{num_layers - 1} for this {num_layers}-layer target"
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise DFlash2Error(f"target_layer_ids must be a list of ints, got {ids!r}; {valid}")
    ids = list(ids)
    if not ids:
        raise DFlash2Error(f"target_layer_ids is empty; give at least one layer id ({valid})")
    bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, numbers.Integral)]
    if bad:
        raise DFlash2Error(f"target_layer_ids must be ints, got {bad!r}; {valid}")
    out = [int(i) for i in ids]
    outside = [i for i in out if not 0 <= i < num_layers]
    if outside:
        raise DFlash2Error(f"target_layer_ids {outside} out of range; {valid}")
    dupes = sorted(i for i, n in Counter(out).items() if n > 1)
    if dupes:
        raise DFlash2Error(f"target_layer_ids has duplicates {dupes}; list each layer once ({valid})")
    return out


@dataclass
class TargetOutput:
    """One target forward.

    logits:          (N, L, V) next-token logits.
    taps:            (N, L, K*d) outputs of the tapped decoder layers, concatenated in target_layer_ids order.
    past_key_values: the HF cache object when ``use_cache`` (a ``DynamicCache``; for hybrids its
                     linear-attention layers hold conv/recurrent states), else None.
    """

    logits: torch.Tensor
    taps: torch.Tensor
    past_key_values: Any = None


class TargetModel(nn.Module):
    """A frozen HF causal LM plus the feature taps of §2.

    Attributes:
        model: the HF ``PreTrainedModel``, in eval mode with ``requires_grad=False`` everywhere.
        config: ``model.config`` (composite for a conditional-generation model).
        text_config: the text decoder's config (``dflash2.text_model.text_config``); every field
            the drafter copies from the target is read from it.
        language_model: the text decoder module (``dflash2.text_model.language_model``):
            ``model.model`` for causal LMs, ``model.model.language_model`` for composite models.
        tokenizer: the HF tokenizer saved beside the weights, or None when there is none.
        target_layer_ids: list[int], the tapped layers (K = len).
        num_layers, hidden_size: of the text decoder.
        vocab_size: rows of the input embedding (== ``config.vocab_size`` for all supported models).
        layer_types: list[str], each 'full_attention' or 'linear_attention'.
        has_linear_attention: True for hybrids (Qwen3-Next, Qwen3.5), whose GDN state needs §5 rollback.
        name_or_path: where the model came from (folder or hub id).

    Everything runs under ``torch.no_grad()``: the target is frozen and its
    activations are inputs to the drafter, never something to backpropagate into
    (``no_grad`` rather than ``inference_mode`` so that the returned tensors can
    still enter the drafter's autograd graph).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        tokenizer=None,
        target_layer_ids=None,
        num_taps: int = 5,
        name_or_path: str | None = None,
    ):
        super().__init__()
        self.model = model
        model.eval()
        model.requires_grad_(False)
        self.config = model.config
        self.tokenizer = tokenizer
        self.name_or_path = name_or_path or getattr(self.config, "_name_or_path", "") or type(model).__name__
        self.text_config = text = text_config(self.config)
        self.num_layers = int(text.num_hidden_layers)
        self.hidden_size = int(text.hidden_size)
        self.vocab_size = int(model.get_input_embeddings().weight.shape[0])
        self.layer_types = _layer_kinds(getattr(text, "layer_types", None), self.num_layers)
        self.has_linear_attention = "linear_attention" in self.layer_types
        if target_layer_ids is None:
            self.target_layer_ids = default_target_layer_ids(self.num_layers, num_taps)
        else:
            self.target_layer_ids = validate_target_layer_ids(target_layer_ids, self.num_layers)
        # A plain attribute, not a submodule: it is part of `model` already (no duplicate state_dict keys).
        object.__setattr__(self, "language_model", language_model(model, self.num_layers))
        layers = self.language_model.layers
        # A plain dict, not an nn.ModuleList attribute: registering the layers a second
        # time would duplicate their weights in state_dict().
        self._tapped = {i: layers[i] for i in self.target_layer_ids}
        # The HF cache keyword was renamed past_key_values -> cache in transformers 5.2x; ask the signature.
        self._cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    # ----------------------------------------------------------------- loading
    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str,
        *,
        target_layer_ids=None,
        num_taps: int = 5,
        dtype=None,
        device=None,
        trust_remote_code: bool = False,
    ) -> TargetModel:
        """Load a frozen target from a local HF folder or a hub id.

        dtype: a ``torch.dtype``, 'bfloat16'/'float16'/'float32' (or bf16/fp16/fp32), or 'auto'/None:
        bf16 when ``device`` is a GPU, else fp32 (``dflash2.target_dtype``). device: where to move
        the model afterwards.
        Every user-fixable failure (missing path, folder without weights, corrupted safetensors,
        unreachable hub) is a one-line :class:`DFlash2Error`.
        """
        from transformers import AutoModelForCausalLM

        source, is_local = _resolve_source(str(name_or_path))
        kwargs = {"dtype": resolve_target_dtype(dtype, device), "trust_remote_code": trust_remote_code}
        try:
            model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
        except OSError as e:
            if is_local:
                raise DFlash2Error(f"could not load target folder {source}: {_first_line(e)}") from e
            raise _hub_error(source, e) from e
        except Exception as e:
            if _is_corrupt_weights_error(e):
                raise DFlash2Error(
                    f"weights of target {source} are corrupted or truncated ({_first_line(e)}); "
                    "re-save or re-download them"
                ) from e
            raise
        if device is not None:
            model.to(device)
        tokenizer = _load_tokenizer(source, is_local, trust_remote_code)
        return cls(
            model, tokenizer=tokenizer, target_layer_ids=target_layer_ids, num_taps=num_taps, name_or_path=source
        )

    # ------------------------------------------------------------ frozen parts
    @property
    def embed_tokens(self) -> nn.Embedding:
        """The target's input embedding, (V, d) weight; the drafter embeds its block with it."""
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Module:
        """The target's output projection d -> V; the drafter's logits come from it."""
        return self.model.get_output_embeddings()

    @property
    def final_norm(self) -> nn.Module | None:
        """The text decoder's final norm (``language_model.norm``), applied before ``lm_head``; None if absent."""
        return getattr(self.language_model, "norm", None)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the target computes in (that of its input embedding)."""
        return self.embed_tokens.weight.dtype

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The frozen LM head on hidden states (..., d) of any dtype -> logits (..., V) in the target's dtype.

        The drafter may run in another dtype than the target (fp32 master weights beside a
        bf16 target): its hidden states are cast to the head's dtype first, as when served."""
        head = self.lm_head
        return head(hidden.to(head.weight.dtype))

    def train(self, mode: bool = True) -> TargetModel:
        """Keep the HF model in eval whatever is asked: Lightning calls ``.train()`` on the whole module tree."""
        self.training = mode
        self.model.eval()
        return self

    # ----------------------------------------------------------------- forward
    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Any = None,
        use_cache: bool = False,
        position_ids: torch.Tensor | None = None,
    ) -> TargetOutput:
        """Run the target on input_ids (N, L) -> logits (N, L, V), taps (N, L, K*d), cache.

        Passing ``past_key_values`` implies ``use_cache`` (the cache is updated in place by HF).
        """
        use_cache = bool(use_cache or past_key_values is not None)
        kwargs = {"attention_mask": attention_mask, "position_ids": position_ids, "use_cache": use_cache}
        if past_key_values is not None:
            kwargs[self._cache_kwarg] = past_key_values
        with self._capture() as captured:
            out = self.model(input_ids=input_ids, **kwargs)
        cache = out.get("cache", out.get("past_key_values")) if use_cache else None
        return TargetOutput(logits=out["logits"], taps=self._concat(captured), past_key_values=cache)

    @torch.no_grad()
    def tap_features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Only the taps: input_ids (N, L) -> (N, L, K*d), concatenated in target_layer_ids order.

        Runs the text decoder without ``lm_head``: the (N, L, V) logits are the largest
        activation of a big-vocab target and training features do not need them.
        """
        with self._capture() as captured:
            self.language_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        return self._concat(captured)

    def _capture(self):
        """Context manager: forward hooks on the tapped layers fill a dict {layer id: (N, L, d)}.

        Hooks keep only K layer outputs alive (O(K) memory), where
        ``output_hidden_states=True`` would keep all L+1. They are removed on exit
        so a failed forward leaves no hook behind.
        """
        return _LayerCapture(self._tapped)

    def _concat(self, captured: dict[int, torch.Tensor]) -> torch.Tensor:
        missing = [i for i in self.target_layer_ids if i not in captured]
        if missing:
            raise RuntimeError(f"target layers {missing} did not run; cannot build taps")
        return torch.cat([captured[i] for i in self.target_layer_ids], dim=-1)  # (N, L, K*d)

    # ---------------------------------------------------------------- summary
    def describe(self) -> str:
        """One paragraph: name, class, params, layer kinds, width, vocab and taps."""
        params = sum(p.numel() for p in self.model.parameters())
        kinds = " + ".join(f"{n} {k}" for k, n in Counter(self.layer_types).items())
        dtype = next(self.model.parameters()).dtype
        k = len(self.target_layer_ids)
        return (
            f"Target {self.name_or_path} ({type(self.model).__name__}, {dtype}): {_human(params)} params, "
            f"{self.num_layers} layers ({kinds}), hidden {self.hidden_size}, vocab {self.vocab_size}; "
            f"taps at layers {self.target_layer_ids} -> {k} x {self.hidden_size} = {k * self.hidden_size} "
            f"features per token; frozen (eval, no grad)."
        )


class _LayerCapture:
    """Forward hooks that record decoder-layer outputs; see :meth:`TargetModel._capture`."""

    def __init__(self, layers: dict[int, nn.Module]):
        self.layers, self.captured, self.handles = layers, {}, []

    def _hook(self, layer_id: int):
        def hook(module, args, output):
            # Decoder layers return a tensor (transformers 5.x) or a tuple whose first item is it (older code).
            self.captured[layer_id] = output[0] if isinstance(output, (tuple, list)) else output

        return hook

    def __enter__(self) -> dict[int, torch.Tensor]:
        self.handles = [layer.register_forward_hook(self._hook(i)) for i, layer in self.layers.items()]
        return self.captured

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


# ----------------------------------------------------------------- helpers
def _layer_kinds(raw: Any, num_layers: int) -> list[str]:
    """Map config.layer_types to 'full_attention' / 'linear_attention'; absent -> all full (Qwen3, Llama)."""
    if raw is None:
        return ["full_attention"] * num_layers
    kinds = []
    for i, name in enumerate(list(raw)[:num_layers]):
        if name not in _LAYER_KINDS:
            raise DFlash2Error(
                f"target layer {i} has type {name!r}, which dflash2 does not support; "
                f"known types: {sorted(_LAYER_KINDS)}"
            )
        kinds.append(_LAYER_KINDS[name])
    return kinds


def _looks_like_path(s: str) -> bool:
    """'/x/y', './x', '~/x', 'x/y/z', 'x\\y' are paths; 'org/name' and 'name' are hub ids."""
    if os.path.isabs(s) or s.startswith((".", "~")) or "\\" in s or s.endswith("/"):
        return True
    return "/" in s and not _HUB_ID.match(s)


def check_target_source(name_or_path: str) -> None:
    """Raise the one-line DFlash2Error that loading would raise for a missing or damaged local
    folder (no weights, a truncated safetensors header), without loading anything: callers
    check before they copy or write anything for the target."""
    _resolve_source(str(name_or_path))


def _resolve_source(name_or_path: str) -> tuple[str, bool]:
    """Return (what to hand to HF, is_local); check a local folder before HF sees it."""
    path = os.path.expanduser(name_or_path)
    if os.path.isdir(path):
        _check_folder(path)
        return os.path.abspath(path), True
    if os.path.exists(path):
        raise DFlash2Error(
            f"target path {name_or_path} is a file; point target.path at the HF model folder "
            "that holds config.json and the weights"
        )
    if _looks_like_path(name_or_path):
        raise DFlash2Error(
            f"target path {name_or_path} does not exist; point target.path at a saved HF model "
            "folder or give a hub id like Qwen/Qwen3-8B"
        )
    return name_or_path, False


def _check_folder(folder: str) -> None:
    """A loadable folder has config.json and weights; every safetensors header must parse (catches truncation)."""
    from safetensors import safe_open

    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise DFlash2Error(
            f"target folder {folder} has no config.json; point target.path at a folder written by save_pretrained"
        )
    files = [
        f
        for pattern in ("*.safetensors", "pytorch_model*.bin", "*.index.json")
        for f in sorted(glob.glob(os.path.join(folder, pattern)))
    ]
    if not files:
        raise DFlash2Error(
            f"target folder {folder} has no weights (*.safetensors / pytorch_model.bin); point "
            "target.path at a saved HF model folder (save_pretrained writes both config and weights)"
        )
    for index in (f for f in files if f.endswith(".index.json")):
        with open(index) as fh:
            shards = set(json.load(fh).get("weight_map", {}).values())
        missing = sorted(s for s in shards if not os.path.isfile(os.path.join(folder, s)))
        if missing:
            raise DFlash2Error(
                f"target folder {folder} misses weight shards {missing} listed in "
                f"{os.path.basename(index)}; re-download or re-save the model"
            )
    for f in (f for f in files if f.endswith(".safetensors")):
        try:
            with safe_open(f, framework="pt"):  # reads and checks the header only: cheap
                pass
        except Exception as e:  # SafetensorError or OSError
            raise DFlash2Error(
                f"target weights file {f} is corrupted or truncated ({_first_line(e)}); re-save or re-download it"
            ) from e


def _is_corrupt_weights_error(e: Exception) -> bool:
    text = f"{type(e).__name__} {e}"
    return any(s in text for s in ("SafetensorError", "PytorchStreamReader", "failed finding central directory"))


def _hub_error(source: str, e: Exception) -> DFlash2Error:
    text = str(e)
    if "couldn't connect" in text or "offline" in text.lower() or "connection" in text.lower():
        return DFlash2Error(
            f"target {source!r} is not a local folder and the Hugging Face Hub can't be reached "
            "(offline); pass a local folder with target.path=/path/to/saved/model"
        )
    return DFlash2Error(
        f"could not load target {source!r} from the Hugging Face Hub ({_first_line(e)}); check the "
        "id (or log in for gated models) or pass a local folder"
    )


def _load_tokenizer(source: str, is_local: bool, trust_remote_code: bool):
    """The tokenizer saved with the target, or None when the folder has none."""
    from transformers import AutoTokenizer

    if is_local and not any(os.path.isfile(os.path.join(source, f)) for f in _TOKENIZER_FILES):
        return None
    try:
        return AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    except Exception as e:
        if not is_local:
            return None  # a hub model without a usable tokenizer: the caller brings its own
        raise DFlash2Error(
            f"tokenizer files in target folder {source} could not be loaded ({_first_line(e)}); "
            "re-save the tokenizer with save_pretrained or remove the broken files"
        ) from e


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _human(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return str(n)
