"""What every runtime target family shares around its own forward: state allocation, taps, the LM head.

A family (qwen3.py, llama.py, qwen3_5.py) subclasses :class:`RuntimeCausalLM`, builds
its layers in ``__init__`` from the HF text config, declares ``KEY_MAP`` (its names
<-> HF checkpoint names, loading.py) and writes ``forward``:

    out = model(tokens, state)          # tokens (N, T) at positions state.lengths + 0..T-1
    state.commit(n)                     # keep n[r] of the T tokens of row r

Taps (docs/ARCHITECTURE.md §2.1): the outputs of the decoder layers
in ``target_layer_ids`` (HF's ``hidden_states[i + 1]``), concatenated in that order
into (N, T, K·d), written straight into a caller's buffer when one is given (the
drafter's context buffer) — no hooks, and no launch of their own: the residual norm
after a tapped layer stores its output h + delta into the layer's slice (``_tap``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dflash2.runtime.cache import DecodeState, KVCache
from dflash2.runtime.gdn_state import GDNState
from dflash2.runtime.gemm import linear

ATTENTION, GDN = "full_attention", "linear_attention"


@dataclass
class ModelOutput:
    """logits: (N, T, V), or (N, V) when the forward got ``logits_index``; taps: (N, T, K·d) or None."""

    logits: torch.Tensor
    taps: torch.Tensor | None


class RuntimeCausalLM(nn.Module):
    """Base of the runtime targets. Subclasses set the attributes below in ``__init__``.

    embed (V, d) / lm_head (d -> V) / norm: the embedding, output projection and final norm;
    layer_types: per layer 'full_attention' or 'linear_attention';
    num_kv_heads, head_dim, num_heads: attention shapes (for the KV cache);
    gdn_dims: kwargs of :class:`GDNState` besides layers/batch/dtype/device, or None;
    gdn_mode: the GDN verify / commit implementation of new states (set by ``load_model`` or by hand);
    'auto' (the default) is resolved per state by its device (``gdn_state.resolve_gdn_mode``);
    gdn_kernel_options: GDNState's kernel_options for new states (tuning knobs of the Triton modes, e.g.
    ``{"chunked": True}``; default {}: the kernels' defaults).
    """

    KEY_MAP = None  # loading.KeyMap, set by each family

    def __init__(self, text_config):
        super().__init__()
        self.config = text_config
        self.vocab_size = int(text_config.vocab_size)
        self.hidden_size = int(text_config.hidden_size)
        self.num_layers = int(text_config.num_hidden_layers)
        self.target_layer_ids: list[int] = []
        self.layer_types: list[str] = [ATTENTION] * self.num_layers
        self.num_heads = self.num_kv_heads = self.head_dim = 0
        self.gdn_dims: dict | None = None
        # GDNState mode of new states: 'auto' | 'reference' | 'replay' | 'native'. 'auto' stays unresolved
        # here so that a model moved to another device after loading still gets its device's mode.
        self.gdn_mode = "auto"
        self.gdn_kernel_options: dict = {}

    # ------------------------------------------------------------------ state
    def slots(self) -> list[int]:
        """Per layer, its index among the layers of its own kind (KV-cache slot or GDN-state slot)."""
        seen = {ATTENTION: 0, GDN: 0}
        out = []
        for kind in self.layer_types:
            out.append(seen[kind])
            seen[kind] += 1
        return out

    def new_state(self, batch_size: int, max_len: int, device=None, gdn_mode: str | None = None) -> DecodeState:
        """Empty caches for ``batch_size`` rows of up to ``max_len`` positions (prompt + generated + one block).

        gdn_mode: how GDN layers verify / commit (gdn_state.py); default ``self.gdn_mode``; 'auto' is
        resolved by ``device``.
        """
        weight = self.embed.weight
        device = weight.device if device is None else device
        n_attn, n_gdn = self.layer_types.count(ATTENTION), self.layer_types.count(GDN)
        kv = None
        if n_attn:
            kv = KVCache(
                n_attn,
                batch_size,
                self.num_kv_heads,
                max_len,
                self.head_dim,
                groups=self.num_heads // self.num_kv_heads,
                dtype=weight.dtype,
                device=device,
            )
        gdn = None
        if n_gdn:
            mode = gdn_mode or self.gdn_mode
            gdn = GDNState(
                n_gdn,
                batch_size,
                dtype=weight.dtype,
                device=device,
                mode=mode,
                kernel_options=self.gdn_kernel_options,
                **self.gdn_dims,
            )
        lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        rope = self.rotary.table(max_len, weight.dtype, device) if n_attn else None  # only attention rotates
        return DecodeState(lengths, kv, gdn, rope)

    # ------------------------------------------------------------------- taps
    def set_taps(self, target_layer_ids) -> None:
        """Tap the outputs of these layers (0-based, concatenated in this order); [] turns taps off."""
        ids = [int(i) for i in target_layer_ids]
        bad = [i for i in ids if not 0 <= i < self.num_layers]
        if bad or len(set(ids)) != len(ids):
            raise ValueError(f"target_layer_ids {ids} must be distinct layers in 0..{self.num_layers - 1}")
        self.target_layer_ids = ids

    def _tap_buffer(self, N: int, T: int, taps_out: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor | None:
        """(N, T, K·d) where the taps go: the caller's buffer (any strided view) or a new tensor."""
        if not self.target_layer_ids:
            return None
        if taps_out is not None:
            return taps_out
        return like.new_empty(N, T, len(self.target_layer_ids) * self.hidden_size)

    def _tap(self, taps: torch.Tensor | None, layer: int, h: torch.Tensor, delta: torch.Tensor | None, on_taps=None):
        """Route layer ``layer``'s output h + delta (N, T, d) into its slice of taps if the layer is tapped.

        Returns (out, done). out: the layer's (N, T, d) slice of taps (rows K·d apart) for the norm that adds
        h + delta next to write (``h_out=``: the next layer's first norm, or the final norm in :meth:`_logits`),
        which then carries that view as the residual stream; done: None, or (after the last tapped layer) a
        callable of no arguments running ``on_taps(taps)``, to be called once that norm has written out — only
        then is every slice written (an earlier layer's slice is written by its next layer's first norm). on_taps
        is the forward's argument: work that needs only the taps may start there, beside the layers still to run.
        (None, None) when the layer is not tapped, or when its slice was written here.

        Why: layers return (h, delta) with the last residual add left to the next norm (fused there), whose
        kernel stores h = round(h + delta) anyway; storing that into the taps replaces an add launch per tapped
        layer (5 per speculative verify at the embedded pair's shape) with a strided store, bit for bit the same
        values (one fp32 add rounded to the dtype, as torch.add). Written here instead: delta None (the output
        is h itself: a copy), or a taps buffer the norm cannot write (another dtype or device than h, a non-unit
        last stride): ``torch.add`` into it, and on_taps at once after the last tapped layer."""
        if taps is None or layer not in self.target_layer_ids:
            return None, None
        j = self.target_layer_ids.index(layer)
        out = taps[..., j * self.hidden_size : (j + 1) * self.hidden_size]
        last = on_taps is not None and layer == max(self.target_layer_ids)
        done = (lambda: on_taps(taps)) if last else None
        if delta is not None and out.dtype == h.dtype and out.device == h.device and out.stride(-1) == 1:
            return out, done
        if delta is None:
            out.copy_(h)
        else:
            torch.add(h, delta, out=out)
        if done is not None:
            done()
        return None, None

    def fuse_projections(self) -> RuntimeCausalLM:
        """One GEMV per fused group (q|k|v, gate|up, GDN in_proj_*): see ``layers.fuse_linears``."""
        for module in self.modules():
            if module is not self and hasattr(module, "fuse"):
                module.fuse()
        return self

    # ------------------------------------------------------------------- head
    def _logits(
        self,
        h: torch.Tensor,
        delta: torch.Tensor | None,
        logits_index: torch.Tensor | None,
        h_out: torch.Tensor | None = None,
        on_h_out=None,
    ) -> torch.Tensor:
        """Last residual add + final norm + LM head. h, delta (N, T, d) -> (N, T, V);
        with logits_index (N,) long -> (N, V) at those t.

        h_out: the last layer's (N, T, d) tap slice (:meth:`_tap`), written with h + delta, then on_h_out() if
        given. Without logits_index the final norm writes it. With it the norm sees one position per row, and
        the tap needs all T (prefill: the drafter's context reads every position): a plain add writes it, and
        the norm normalises the gathered rows of that sum (the same values as adding the gathered rows)."""
        if h_out is not None and logits_index is not None:
            h, delta = torch.add(h, delta, out=h_out), None
            h_out = None
            if on_h_out is not None:
                on_h_out()
                on_h_out = None
        if logits_index is not None:
            index = logits_index[:, None, None].expand(-1, 1, h.shape[-1])
            h = h.gather(1, index)[:, 0]  # (N, d)
            delta = None if delta is None else delta.gather(1, index)[:, 0]
        x = self.norm.add_forward(h, delta, out=h_out)[1]
        if on_h_out is not None:  # the final norm wrote the last tap: the LM head runs beside on_taps' work
            on_h_out()
        return linear(x, self.lm_head.weight, self.lm_head.bias)
