"""GDN commit: fold n[r] verified tokens into row r's states (ReplaySSM) or keep the stored one (native).

:func:`gdn_replay_triton` (Triton, kernel.py) updates the states in place; its plain-PyTorch
twin :func:`~.reference.gdn_replay` returns the new states. :func:`gdn_defer_commit_triton`
(defer_kernel.py, twin :func:`~.reference.gdn_defer_commit`) is ReplaySSM's deferred commit: everything
but the fold, for all layers in one launch. docs/ARCHITECTURE.md §5.5.
"""

from __future__ import annotations

import torch

from dflash2.runtime.kernels.gdn_log import GDNLog, default_fma


def gdn_replay_triton(
    conv_state: torch.Tensor,
    rec_state: torch.Tensor,
    log: GDNLog,
    n: torch.Tensor,
    *,
    block_v: int | None = None,
    num_warps: int | None = None,
    roll_conv: bool = True,
    fma: bool | None = None,
) -> None:
    """Commit the first n[r] tokens of the verify that wrote ``log`` into row r, in place.

    conv_state (N, C, K-1) model dtype, contiguous columns; rec_state (N, H, d_k, d_v) fp32,
    (H, d_k, d_v) contiguous per row (e.g. one layer's slice of GDNState's buffers); log from
    :func:`~dflash2.runtime.kernels.gdn_verify.gdn_verify_triton` (ReplaySSM or native);
    n (N,) integer on the device, each in [0, T] (not checked: that would read it back to the host).
    Rows with n = 0 keep both states. block_v / num_warps: tuning knobs. roll_conv=False folds the
    recurrent state only (GDNState.flush after a deferred commit, which rolled the window already).
    fma: fold with the state update as one fused multiply-add, as the verify's ``fma`` option does (None: the
    same default as the verify's, gdn_log.default_fma; a log must be committed with the setting it was
    verified with, or the exact fold breaks).
    """
    N, T, C = log.x.shape
    dk, dv = rec_state.shape[2:]
    if conv_state.shape[:2] != (N, C) or rec_state.shape[0] != N or n.shape != (N,):
        raise ValueError(
            f"shapes: conv_state {tuple(conv_state.shape)}, rec_state {tuple(rec_state.shape)}, n {tuple(n.shape)}"
            f" for a log of (N, T, C) = {(N, T, C)}"
        )
    if conv_state.stride(-1) != 1 or rec_state[0].stride() != (dk * dv, dv, 1) or log.x.stride(-1) != 1:
        raise ValueError("conv_state / x need contiguous columns / channels and rec_state contiguous (H, d_k, d_v)")
    import triton  # here, not at import: the twins and GDNState's reference mode need no Triton

    from dflash2.runtime.kernels.gdn_replay.kernel import launch_replay
    from dflash2.runtime.kernels.triton_util import check_device, default_warps

    check_device(rec_state, conv_state)
    if T == 0 or N == 0:
        return
    if log.native:
        k = u = g = states = log.states
        hk = 1  # unused by the native variant
    else:
        k, u, g, states = log.k, log.u, log.g, log.u
        hk = log.k.shape[2]
    bv = block_v or min(triton.next_power_of_2(dv), 16)
    warps = num_warps or default_warps(triton.next_power_of_2(dk) * bv)
    launch_replay(
        conv_state,
        rec_state,
        log.x,
        k,
        u,
        g,
        states,
        n,
        num_k_heads=hk,
        native=log.native,
        block_v=bv,
        num_warps=warps,
        roll_conv=roll_conv,
        fma=default_fma(fma),
    )


def gdn_defer_commit_triton(
    n: torch.Tensor,
    pend: torch.Tensor,
    conv: torch.Tensor,
    x: torch.Tensor,
    k: torch.Tensor,
    g: torch.Tensor,
    stash_k: torch.Tensor,
    stash_g: torch.Tensor,
) -> None:
    """ReplaySSM's deferred commit of all L GDN layers in one launch (defer_kernel.py; twin
    :func:`~.reference.gdn_defer_commit`): every count of row r := n[r], row r's conv windows rolled by
    n[r], and the first n[r] logged k / g rows copied to the stash the next verify folds from.

    n (N,) integer in [0, T] on the device (not checked); pend (L, N, P) int32; conv (L, N, C, K-1);
    x (L, N, T, C); k, stash_k (L, N, T, Hk, d_k) and g, stash_g (L, N, T, H) fp32: each contiguous below
    its first two dims (GDNState's reserved logs are stacked that way)."""
    L, N, T, C = x.shape
    hk = k.shape[3]
    if (
        n.shape != (N,)
        or pend.shape[:2] != (L, N)
        or conv.shape[:3] != (L, N, C)
        or k.shape[:3] != (L, N, T)
        or g.shape[:3] != (L, N, T)
        or stash_k.shape != k.shape
        or stash_g.shape != g.shape
        or g.shape[3] % hk
    ):
        raise ValueError(
            f"shapes: n {tuple(n.shape)}, pend {tuple(pend.shape)}, conv {tuple(conv.shape)}, x {tuple(x.shape)}, "
            f"k {tuple(k.shape)}, g {tuple(g.shape)}, stash {tuple(stash_k.shape)} / {tuple(stash_g.shape)}"
        )
    if L == 0 or N == 0:
        return
    for name, t in dict(pend=pend, conv=conv, x=x, k=k, g=g, stash_k=stash_k, stash_g=stash_g).items():
        if not t[0, 0].is_contiguous():
            raise ValueError(f"{name} must be contiguous below its (layer, row) dims")
    # the kernel addresses the stash with the log's (layer, row) strides, and n as a contiguous vector
    if stash_k.stride()[:2] != k.stride()[:2] or stash_g.stride()[:2] != g.stride()[:2]:
        raise ValueError("stash_k / stash_g must have the (layer, row) strides of k / g")
    if n.stride(0) != 1 or n.device != conv.device:
        raise ValueError(f"n must be a contiguous vector on {conv.device}, got stride {n.stride(0)} on {n.device}")
    from dflash2.runtime.kernels.gdn_replay.defer_kernel import launch_defer
    from dflash2.runtime.kernels.triton_util import check_device

    check_device(conv, pend)
    launch_defer(n, pend, conv, x, k, g, stash_k, stash_g)
