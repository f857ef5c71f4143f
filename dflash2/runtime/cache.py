"""Static caches of the runtime target and the per-row lengths (docs/ARCHITECTURE.md §6).

Every forward of a runtime model processes a block of T tokens per row, (N, T), at
per-row positions: row n's tokens sit at ``lengths[n] .. lengths[n] + T - 1``, so
the rows of a batch may be ragged (different prompt lengths, different numbers of
accepted drafts). A forward never changes what is *committed*:

* attention layers write the block's K/V into the static cache at those positions
  (beyond the committed length: overwritten by the next step unless committed);
* Gated DeltaNet layers compute their outputs from the untouched state and log
  what a commit needs (gdn_state.py).

``DecodeState.commit(n)`` then keeps the first n[r] tokens of row r: lengths grow by
n and the GDN states fold exactly n[r] tokens. Stale K/V past a row's length is
never read: the mask lets query t of row r see key positions ≤ lengths[r] + t only.

Everything here stays on the device: lengths are a tensor, the masks and write
indices are built from it once per step (:meth:`DecodeState.step_meta`), and no
function reads a value back to the host.

Shapes: N rows, T block tokens, L_a attention layers, Hkv key/value heads, G query
heads per K/V head, S_max cache positions, S ≤ S_max positions attended, D head_dim.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from dflash2.runtime.gdn_state import GDNState

BACKENDS = ("default", "triton", "sdpa", "efficient")  # the names set_attention_backend takes
_SDPA_BACKENDS = None  # None: PyTorch's choice; else the allowed backends, in set_attention_backend's order
_TRITON = True  # the decode-attention kernel where it applies ('default' / 'triton'); False: SDPA everywhere
TRITON_MAX_T = 16  # longer blocks (prefill) keep SDPA: the kernel is built for G·T decode / verify rows


def set_attention_backend(name: str | None) -> None:
    """Which kernel attention uses (names: :data:`BACKENDS`).

    * None / 'default' = 'triton' (the runtime's default): the split-K decode kernel,
      :func:`~dflash2.runtime.kernels.attention.decode_attention`, for blocks of ≤ TRITON_MAX_T tokens whose
      StepMeta says its mask rule; everything else keeps PyTorch's SDPA (its own choice of kernel): prefill
      blocks longer than TRITON_MAX_T, sliding windows (no mask rule), dtypes or head dims the kernel does not
      take, CPU tensors (they reach the kernel only inside ``kernels.on_cpu()`` under Triton's interpreter: tests)
      and ``kernels.kernels(False)`` (the kernel runs where the other fused kernels do: ``kernels.use_triton``).
    * 'sdpa': PyTorch's SDPA everywhere, its own choice of kernel (cuDNN on Hopper); the default until the
      Triton kernel was measured.
    * 'efficient': SDPA restricted to its memory-efficient kernel, else math, on CUDA tensors.

    Why triton: for decode-sized queries (G·T rows) cuDNN's SDPA kernel is latency-bound and returns a layout
    that costs a copy; the split-K kernel is several times faster per layer call (docs/BENCHMARKS.md).
    Graphs keep the kernels chosen when they were captured."""
    from torch.nn.attention import SDPBackend

    global _SDPA_BACKENDS, _TRITON
    canonical = {None: "triton", "default": "triton", "triton": "triton", "sdpa": "sdpa", "efficient": "efficient"}
    if name not in canonical:
        raise ValueError(f"attention backend {name!r} not known; use one of {', '.join(BACKENDS)}")
    name = canonical[name]
    _SDPA_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH] if name == "efficient" else None
    _TRITON = name == "triton"


def attention_backend() -> str:
    """The backend set_attention_backend last chose, by its own name: 'triton' (also for None / 'default'),
    'sdpa' or 'efficient'; ``set_attention_backend(attention_backend())`` restores it."""
    return "triton" if _TRITON else "sdpa" if _SDPA_BACKENDS is None else "efficient"


def attention_in_use(device: torch.device | str) -> str:
    """What decode blocks (≤ TRITON_MAX_T tokens, a mask rule) on ``device`` run now, fallbacks applied:
    'triton', 'efficient' (CUDA only) or 'sdpa' (PyTorch's choice). Prefill and sliding windows are always
    SDPA. For records of what a measurement ran (eval.speedup), e.g. 'sdpa' inside ``kernels(False)``."""
    from dflash2.runtime.kernels import use_triton

    probe = torch.empty(0, device=device)
    if _TRITON and use_triton(probe):
        return "triton"
    return "efficient" if _SDPA_BACKENDS is not None and probe.is_cuda else "sdpa"


class StepMeta:
    """Per-step metadata, built once per forward and shared by all layers.

    positions:   (N, T) long, absolute position of each block token (RoPE and the cache slot).
    write_index: (N, Hkv, T, D) long, positions broadcast for ``scatter_`` into the K/V cache (a view).
    mask:        (N, 1, G·T, S) bool, True where a query may attend: query row g·T + t of row n sees
                 key positions ≤ positions[n, t] (the committed context and the block causally).
                 Built on first use when given as a function: the Triton decode kernel reads the limits
                 from ``positions`` (``mask_rule``) and never needs it, so a step that only runs that
                 kernel (every decode block on CUDA) launches none of the mask's ops.
    kv_len:      S, the cache positions attended (a static bound ≤ S_max; positions beyond are never read).
    mask_rule:   what ``mask`` says in terms of positions, for the Triton decode kernel, which reads the
                 limits from ``positions`` instead of a dense mask: 'causal' (query t of row n sees keys
                 ≤ positions[n, t]), 'block' (every query of row n sees keys ≤ positions[n, T-1]: the
                 drafter's context + whole block), or None (only ``mask`` describes it, e.g. a sliding
                 window: SDPA with the mask).
    """

    def __init__(
        self,
        positions: torch.Tensor,
        write_index: torch.Tensor | None,
        mask: torch.Tensor | Callable[[], torch.Tensor] | None,
        kv_len: int,
        mask_rule: str | None = None,
    ):
        self.positions, self.write_index, self.kv_len, self.mask_rule = positions, write_index, kv_len, mask_rule
        self._mask = mask

    @property
    def mask(self) -> torch.Tensor | None:
        if callable(self._mask):
            self._mask = self._mask()
        return self._mask


class KVCache:
    """Preallocated K/V of all attention layers: k, v (L_a, N, Hkv, S_max, D), slot i = i-th attention layer.

    GQA is attended by folding the G query heads of each K/V head into the query
    length, (N, H, T, D) -> (N, Hkv, G·T, D), so SDPA sees as many heads as the cache
    and no repeated K/V copy is ever made (the mask is tiled G times instead).
    """

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        *,
        groups: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        shape = (num_layers, batch_size, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.groups = groups
        self.max_len = max_len

    def write(self, slot: int, k: torch.Tensor, v: torch.Tensor, meta: StepMeta) -> None:
        """k, v (N, Hkv, T, D) -> cache slot at meta.positions (in place, static addresses)."""
        self.k[slot].scatter_(2, meta.write_index, k)
        self.v[slot].scatter_(2, meta.write_index, v)

    def write_layers(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """k, v (L_a, N, Hkv, T, D) of every slot (any strides) -> the cache at positions (N, T): one scatter
        each instead of one per slot (the drafter's context append writes all its layers at once)."""
        index = positions[None, :, None, :, None].expand(k.shape)  # (L_a, N, Hkv, T, D)
        self.k.scatter_(3, index, k)
        self.v.scatter_(3, index, v)

    def attend(self, slot: int, q: torch.Tensor, meta: StepMeta, token_major: bool = False) -> torch.Tensor:
        """q (N, H, T, D) -> (N, H, T, D): softmax attention over the first meta.kv_len cache positions.

        token_major: return (N, T, H, D) contiguous instead, the output projection's layout (the Triton
        kernel writes it directly; SDPA's output is transposed into it)."""
        N, H, T, D = q.shape
        hkv = self.k.shape[2]
        k = self.k[slot, :, :, : meta.kv_len]  # (N, Hkv, S, D), a view
        v = self.v[slot, :, :, : meta.kv_len]
        if _TRITON and meta.mask_rule is not None and T <= TRITON_MAX_T and _triton_applies(q):
            from dflash2.runtime.kernels.attention import decode_attention

            causal = meta.mask_rule == "causal"
            return decode_attention(q, k, v, meta.positions, causal=causal, token_major=token_major)
        # head h = j·G + g reads K/V head j (HF's repeat_kv order): fold g into the query length
        qg = q.reshape(N, hkv, self.groups * T, D)
        if _SDPA_BACKENDS is not None and q.is_cuda:
            from torch.nn.attention import sdpa_kernel

            with sdpa_kernel(_SDPA_BACKENDS):
                y = F.scaled_dot_product_attention(qg, k, v, attn_mask=meta.mask)
        else:
            y = F.scaled_dot_product_attention(qg, k, v, attn_mask=meta.mask)  # (N, Hkv, G·T, D)
        y = y.reshape(N, H, T, D)  # reshape: fused kernels may return a non-contiguous layout
        return y.transpose(1, 2).contiguous() if token_major else y


def _triton_applies(q: torch.Tensor) -> bool:
    from dflash2.runtime.kernels import use_triton
    from dflash2.runtime.kernels.attention import MAX_HEAD_DIM

    return q.dtype in (torch.bfloat16, torch.float16, torch.float32) and q.shape[-1] <= MAX_HEAD_DIM and use_triton(q)


class DecodeState:
    """Everything a runtime target carries between steps: lengths, the KV cache and the GDN states.

    lengths: (N,) long on the device, committed tokens per row.
    kv:      KVCache of the attention layers, or None (no attention layer).
    gdn:     GDNState of the Gated DeltaNet layers, or None (attention-only targets).
    rope:    the model's RoPE rows for positions 0..S_max-1, cos and sin (S_max, R) (``Rotary.table``),
             or None (computed per step); kept here so that graphs captured on this state read them.

    Use: ``meta = state.step_meta(T)``, run the forward (the model calls this itself),
    then ``state.commit(n)``; ``state.flush()`` before reading GDN states outside a forward.
    Built by a model's ``new_state(batch_size, max_len)``.
    """

    def __init__(
        self,
        lengths: torch.Tensor,
        kv: KVCache | None,
        gdn: GDNState | None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ):
        self.lengths, self.kv, self.gdn, self.rope = lengths, kv, gdn, rope
        max_len = kv.max_len if kv is not None else None
        # made once: a step's positions are then one add (an arange per step is one more launch)
        self._offsets = None if max_len is None else torch.arange(max_len, device=lengths.device)

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    def step_meta(self, T: int, kv_len: int | None = None) -> StepMeta:
        """Positions, K/V write index and attention mask for a block of T tokens per row.

        kv_len: cache positions to attend (default: all S_max). A caller that knows an upper
        bound on lengths + T (the engine does) passes it rounded up to a bucket, so attention
        reads only that much of the cache; keys at positions ≥ kv_len must never be needed.
        """
        device = self.lengths.device
        offsets = self._offsets[:T] if self._offsets is not None else torch.arange(T, device=device)
        positions = self.lengths[:, None] + offsets  # (N, T)
        if self.kv is None:
            return StepMeta(positions, None, None, 0)
        kv_len = self.kv.max_len if kv_len is None else kv_len
        hkv, D = self.kv.k.shape[2], self.kv.k.shape[-1]
        write_index = positions[:, None, :, None].expand(-1, hkv, -1, D)  # (N, Hkv, T, D)
        groups = self.kv.groups

        def mask() -> torch.Tensor:
            keys = torch.arange(kv_len, device=device)
            visible = keys[None, None, :] <= positions[:, :, None]  # (N, T, S)
            return visible.repeat(1, groups, 1)[:, None]  # (N, 1, G·T, S), row g·T + t

        return StepMeta(positions, write_index, mask, kv_len, "causal")

    def commit(self, n: torch.Tensor, defer: bool = True) -> None:
        """Keep the first n[r] tokens of the last forward's block in row r; n (N,) long in [0, T].

        n[r] = 0 leaves row r unchanged (for rows that did not take part); a speculative
        step always commits ≥ 1 (the accepted drafts + the bonus token, or the correction).
        Attention layers only need the new lengths; GDN layers replay n[r] logged tokens (ReplaySSM:
        deferred into the next forward unless ``defer=False``; GDNState.commit).
        """
        if self.gdn is not None:
            self.gdn.commit(n, defer=defer)
        self.lengths += n

    def flush(self) -> None:
        """Materialise the GDN states (a ReplaySSM commit may be deferred into the next verify:
        GDNState.flush); call before reading them anywhere but in a forward. Idempotent."""
        if self.gdn is not None:
            self.gdn.flush()
