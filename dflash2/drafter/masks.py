"""Block-sparse attention masks for training every block of a sequence in one pass (ARCHITECTURE.md §2.6).

Layout (shared by the dense and the flex mask, and by ``DFlashDrafter.forward``):

* queries: S = A·B block tokens; block j (anchor j) occupies rows j·B .. j·B+B-1.
* keys:    [L context positions ; S block tokens] (context first, as in KV injection).

Rules (True = may attend):

* block j sees context key p iff p < anchors[j] (context strictly before its anchor:
  at decode time the anchor is the last verified token and the target has not yet
  produced features for it), and only when the anchor is valid;
* block j sees all B tokens of its own block (bidirectional), nothing of other blocks;
* an invalid (padding) anchor sees its own block only. Every row therefore has at
  least one visible key, so softmax never produces NaN; the caller masks its loss.

The context key index equals the context position (context positions are 0..L-1).

``sliding_attention`` layers (ARCHITECTURE.md §2.4) AND these masks with a window on
absolute positions: key k is visible to query q only if |q - k| < W (the window
counts the query itself and is the same on both sides, as vLLM's and z-lab's
non-causal sliding layers have it). Every query still sees itself, so no row empties.
"""

from __future__ import annotations

import torch


def dense_block_mask(
    anchors: torch.Tensor, anchor_valid: torch.Tensor, context_len: int, block_size: int
) -> torch.Tensor:
    """Dense boolean mask for SDPA.

    anchors: (N, A) long, anchor_valid: (N, A) bool.
    Returns (N, 1, S, L+S) bool with S = A·B; True = may attend.
    """
    N, A = anchors.shape
    B, L = block_size, context_len
    S = A * B
    dev = anchors.device
    q_block = torch.arange(S, device=dev) // B  # (S,) block index of each query row
    # context part: key p visible iff p < anchor of the query's block (and anchor valid)
    anchor_q = anchors[:, q_block]  # (N, S)
    valid_q = anchor_valid[:, q_block]  # (N, S)
    ctx = torch.arange(L, device=dev)  # (L,)
    ctx_ok = (ctx[None, None, :] < anchor_q[:, :, None]) & valid_q[:, :, None]  # (N, S, L)
    # block part: same block only (bidirectional inside it)
    blk_ok = q_block[:, None] == q_block[None, :]  # (S, S)
    blk_ok = blk_ok[None].expand(N, S, S)
    return torch.cat([ctx_ok, blk_ok], dim=-1)[:, None]  # (N, 1, S, L+S)


def sliding_window_mask(query_positions: torch.Tensor, key_positions: torch.Tensor, window: int) -> torch.Tensor:
    """Which keys a sliding_attention layer may see: |q - k| < window, on absolute positions.

    query_positions (N, S), key_positions (N, K) long -> (N, 1, S, K) bool (True = inside).
    AND it with the layer's block mask.
    """
    dist = query_positions[:, :, None] - key_positions[:, None, :]  # (N, S, K)
    return (dist.abs() < window)[:, None]


def block_mask_mod(
    anchors: torch.Tensor, anchor_valid: torch.Tensor, context_len: int, block_size: int, window: int | None = None
):
    """The same rule as ``dense_block_mask`` as a FlexAttention ``mask_mod(b, h, q, kv)``;
    ``window``: also the sliding window of ``sliding_window_mask`` (None = none)."""
    L, B = context_len, block_size

    def mask_mod(b, h, q_idx, kv_idx):
        blk = q_idx // B
        is_ctx = kv_idx < L
        ctx_ok = is_ctx & (kv_idx < anchors[b, blk]) & anchor_valid[b, blk]
        # for context keys (kv_idx - L) // B is negative, so this never fires for them
        blk_ok = (~is_ctx) & ((kv_idx - L) // B == blk)
        if window is None:
            return ctx_ok | blk_ok
        # query position anchor + (q mod B); a context key sits at kv_idx, a key of the same
        # block at anchor + ((kv_idx - L) mod B): compare offsets, the anchor cancels
        q_off = q_idx % B
        ctx_in = (anchors[b, blk] + q_off - kv_idx) < window  # context keys precede the query
        blk_in = (q_off - (kv_idx - L) % B).abs() < window
        return (ctx_ok & ctx_in) | (blk_ok & blk_in)

    return mask_mod


_COMPILED: dict = {}  # name -> the torch.compile'd function, built once per process (see compiled())


def compile_without_duck_sizing(fn, **compile_options):
    """``torch.compile(fn, **compile_options)``, every call traced with duck sizing off.

    Why: under ``dynamic=True`` torch.compile gives two input dims that happen to be equal on the first call
    one symbol ("duck sizing"), assuming they always will be. Wherever one of them is then made static, the
    other is too. flex_attention does that to its head dims (``torch._dynamo.mark_static(x, -3)`` on q, k and
    v), so with 2 rows per batch and 2 kv heads the row count N was compiled as the constant 2 and the next
    batch of 3 rows built another graph (guard "tensor 'key' size mismatch at index 0. expected 2, actual 3"):
    another cold compile of the flex forward and backward kernels, for a last partial batch or another
    per-device batch. Any chance equality of two batch dims (N and A, N and a tile count) would equally
    recompile once they differ. With duck sizing off, each dim keeps its own symbol and only the dims torch
    asks for are static. It is a trace-time setting (``torch.fx.experimental._config.use_duck_shape``,
    the switch torch's own guard log names), read when a graph is traced: scoped to these calls, so other
    compiles in the process keep torch's default. The kernels compute the same values either way."""
    import functools

    from torch.fx.experimental import _config as fx_config

    compiled_fn = torch.compile(fn, **compile_options)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        with fx_config.patch(use_duck_shape=False):
            return compiled_fn(*args, **kwargs)

    return call


def compiled(name: str):
    """flex_attention / create_block_mask, ``torch.compile``d once per process with ``dynamic=True``.

    Why dynamic: a training batch is padded to its longest sequence, so the context length L (and with it
    the key length L + S and the block mask's tile tables) changes from batch to batch. Compiled for static
    shapes, the first change makes torch.compile compile everything again with symbolic lengths
    (automatic dynamic shapes): two cold compiles of the mask builder and of the flex forward and backward
    kernels instead of one. Compiled dynamic from the start, one graph serves every length, row count N and
    anchor count (tests/test_flex_compile.py); nothing is recompiled per step at fixed shapes either way (the
    mask_mod is a new closure every step, but torch.compile guards a closure by its code, not its identity).
    Traced without duck sizing (``compile_without_duck_sizing``): otherwise a row count equal to the number
    of kv heads on the first batch is compiled as a constant, and the next N recompiles.
    Built once here, not per call: ``create_block_mask(..., _compile=True)`` wraps a new compiled function
    at every call (and is deprecated). ``DFLASH2_FLEX_DYNAMIC=0`` in the environment compiles them as
    before (torch's default: static, then symbolic after the first change), a fallback should a torch
    version's symbolic flex kernels misbehave."""
    if name not in _COMPILED:
        import os

        from torch.nn.attention import flex_attention as fa

        dynamic = None if os.environ.get("DFLASH2_FLEX_DYNAMIC", "1") == "0" else True
        _COMPILED[name] = compile_without_duck_sizing(getattr(fa, name), dynamic=dynamic)
    return _COMPILED[name]


def flex_block_mask(
    anchors: torch.Tensor,
    anchor_valid: torch.Tensor,
    context_len: int,
    block_size: int,
    window: int | None = None,
    compile_mask: bool | None = None,
):
    """FlexAttention ``BlockMask`` with the semantics of ``dense_block_mask`` (and of
    ``sliding_window_mask`` when ``window`` is given).

    anchors (N, A) long, anchor_valid (N, A) bool (the only tensors the mask reads).
    Shape (N, 1, S, L+S) with S = A·B; heads broadcast (H=None). On CUDA it lets
    flex_attention skip fully-masked 128x128 tiles (most of them: blocks never see each
    other, and sorted anchors leave early blocks without the late context).

    ``compile_mask`` (None = on CUDA): build it with the compiled ``create_block_mask`` (``compiled``).
    Uncompiled, ``create_block_mask`` evaluates the mask_mod on the whole (N, 1, S, L+S) index grid
    with int64 intermediates, transiently larger than the dense bool mask it replaces;
    compiled, it works tile by tile. Eager on CPU (tests: small shapes, no compiler).
    Imported lazily: only training with flex needs it.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    N, A = anchors.shape
    S = A * block_size
    if compile_mask is None:
        compile_mask = anchors.is_cuda
    create = compiled("create_block_mask") if compile_mask else create_block_mask
    mod = block_mask_mod(anchors, anchor_valid, context_len, block_size, window)
    return create(mod, B=N, H=None, Q_LEN=S, KV_LEN=context_len + S, device=anchors.device)


def block_mask_sparsity(block_mask) -> float:
    """Fraction of the (query tile, key tile) pairs a FlexAttention ``BlockMask`` skips.

    Counted over its kv_num_blocks (partial tiles) and full_kv_num_blocks (tiles with
    no masked element), both (N, H, ceil(Q/bq)): 0 = dense work, 1 = nothing computed.
    The attention's cost scales with 1 - sparsity (tiles visited), the dense SDPA
    path's with S·(L+S) whatever the mask.
    """
    q_len, kv_len = block_mask.shape[-2:]  # the lengths it was built for (not padded to tiles)
    bq, bkv = block_mask.BLOCK_SIZE
    n, h = block_mask.kv_num_blocks.shape[:2]
    total = n * h * (-(-q_len // bq)) * (-(-kv_len // bkv))
    visited = int(block_mask.kv_num_blocks.sum())
    if block_mask.full_kv_num_blocks is not None:
        visited += int(block_mask.full_kv_num_blocks.sum())
    return 1.0 - visited / total


ATTENTION_MODES = ("auto", "flex", "dense")


# torch's compiled flex kernels refuse head dims below 16 ("NYI: embedding dimension ... must be at least 16")
FLEX_MIN_HEAD_DIM = 16


def uses_flex(mode: str, device: torch.device | str, head_dim: int | None = None) -> bool:
    """Whether training attention ``mode`` (``drafter.attention``) takes the flex path on ``device``.

    auto: flex on CUDA (block-sparse, compiled kernels) for head dims of at least
    ``FLEX_MIN_HEAD_DIM`` (None: not checked), dense elsewhere: on the CPU flex_attention is
    unfused (it materializes the full score matrix anyway) and has no backward, and torch's
    compiled kernels refuse smaller heads. dense: SDPA with the (N, 1, S, L+S) bool mask, the
    reference. flex: always (the caller reports what cannot run).
    """
    if mode not in ATTENTION_MODES:
        raise ValueError(f"attention mode {mode!r}: expected one of {', '.join(ATTENTION_MODES)}")
    small_heads = head_dim is not None and head_dim < FLEX_MIN_HEAD_DIM
    return mode == "flex" or (mode == "auto" and torch.device(device).type == "cuda" and not small_heads)


def context_padding_mask(lengths: torch.Tensor, context_slots: int, block_len: int) -> torch.Tensor:
    """Decode-time mask for one block per row over [context slots ; block].

    lengths: (N,) long, valid cached context per row (slots >= length are padding).
    Returns (N, 1, block_len, context_slots + block_len) bool.
    """
    N = lengths.shape[0]
    ctx_ok = torch.arange(context_slots, device=lengths.device)[None, :] < lengths[:, None]  # (N, C)
    blk_ok = torch.ones(N, block_len, dtype=torch.bool, device=lengths.device)  # bidirectional
    row = torch.cat([ctx_ok, blk_ok], dim=-1)  # (N, C+T)
    return row[:, None, None, :].expand(N, 1, block_len, context_slots + block_len)
