"""Plain-PyTorch twin of the GDN commit kernel (and the runtime's ``mode="reference"`` commit).

ReplaySSM ("exact fold"): for t = 1..n[r], h ← exp(g_t)·h; h ← h + k_t u_tᵀ — the two
state updates of verify / single-token decode, in the same order on the same fp32
values, so the folded state is the one decoding the n tokens one by one reaches (u_t
already holds β(v − hᵀk) for the state before token t, which verify computed
sequentially). Native rollback: the state verify stored after token n[r]. Either way
the conv window becomes the last K-1 columns of [old window | x_1..x_n]. Rows with
n[r] = 0 keep both states. Also the twin of the deferred commit (:func:`gdn_defer_commit`:
the window roll and the stash copy, no fold). docs/ARCHITECTURE.md §5.3, §5.5.

Shapes: N rows, T block tokens, C conv channels, K conv kernel, Hk key heads, H value heads.
"""

from __future__ import annotations

import torch

from dflash2.runtime.kernels.gdn_log import GDNLog


def gdn_replay(
    conv_state: torch.Tensor, rec_state: torch.Tensor, log: GDNLog, n: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Commit the first n[r] logged tokens of row r; n (N,) long in [0, T].

    conv_state (N, C, K-1), rec_state (N, H, d_k, d_v) fp32, both only read. Returns the new
    (conv_state, rec_state), equal to feeding the n tokens one by one.
    """
    N, T = log.x.shape[:2]
    keep = n > 0
    if log.native:
        picked = log.states[torch.arange(N, device=n.device), (n - 1).clamp(min=0)]  # (N, H, d_k, d_v)
        h = torch.where(keep[:, None, None, None], picked, rec_state)
    else:
        H = rec_state.shape[1]
        k = log.k.repeat_interleave(H // log.k.shape[2], dim=2)  # (N, T, H, d_k): value head h reads key head h // r
        h = rec_state
        for t in range(T):
            folded = h * log.g[:, t].exp()[..., None, None]  # decay first, then the rank-1 update,
            folded = folded + k[:, t, :, :, None] * log.u[:, t, :, None, :]  # exactly as verify rounds
            h = torch.where((t < n)[:, None, None, None], folded, h)
    return roll_window(conv_state, log.x, n), h  # window columns n .. n+K-2 = the last K-1 inputs after n tokens


def roll_window(conv_state: torch.Tensor, x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """The conv window after n[r] of the T tokens x (N, T, C): columns n .. n+K-2 of [window | x]."""
    km1 = conv_state.shape[-1]
    window = torch.cat([conv_state, x.transpose(1, 2).to(conv_state.dtype)], dim=-1)  # (N, C, K-1+T)
    idx = (n[:, None] + torch.arange(km1, device=n.device))[:, None, :].expand(-1, window.shape[1], -1)
    return window.gather(-1, idx)


def gdn_defer_commit(
    n: torch.Tensor,
    pend: torch.Tensor,
    conv: torch.Tensor,
    x: torch.Tensor,
    k: torch.Tensor,
    g: torch.Tensor,
    stash_k: torch.Tensor,
    stash_g: torch.Tensor,
) -> None:
    """Twin of the deferred commit kernel (defer_kernel.py), in place, for all L layers at once.

    n (N,) accepted tokens per row; pend (L, N, P) int32 counts; conv (L, N, C, K-1) windows; x (L, N, T, C),
    k (L, N, T, Hk, d_k), g (L, N, T, H) the verifies' logs; stash_k / stash_g shaped as k / g. Every count
    of row r becomes n[r], row r's windows are rolled by n[r], and the first n[r] rows of k and g are copied
    to the stash (the rest of the stash is left as it was: the fold never reads it)."""
    pend.copy_(n.view(1, -1, 1).expand_as(pend))
    for layer in range(conv.shape[0]):
        conv[layer].copy_(roll_window(conv[layer], x[layer], n))
    kept = torch.arange(x.shape[2], device=n.device)[None, :] < n[:, None]  # (N, T)
    stash_k.copy_(torch.where(kept[None, :, :, None, None], k, stash_k))
    stash_g.copy_(torch.where(kept[None, :, :, None], g, stash_g))
