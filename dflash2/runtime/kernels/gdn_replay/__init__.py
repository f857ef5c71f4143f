"""GDN commit: fold n[r] verified tokens into row r's states (ReplaySSM) or keep the stored one (native).

:func:`gdn_replay_triton` (Triton, kernel.py) updates the states in place; its plain-PyTorch
twin :func:`~.reference.gdn_replay` returns the new states. docs/ARCHITECTURE.md §5.5.
"""

from __future__ import annotations

import torch

from dflash2.runtime.kernels.gdn_log import GDNLog


def gdn_replay_triton(
    conv_state: torch.Tensor,
    rec_state: torch.Tensor,
    log: GDNLog,
    n: torch.Tensor,
    *,
    block_v: int | None = None,
    num_warps: int | None = None,
) -> None:
    """Commit the first n[r] tokens of the verify that wrote ``log`` into row r, in place.

    conv_state (N, C, K-1) model dtype, contiguous columns; rec_state (N, H, d_k, d_v) fp32,
    (H, d_k, d_v) contiguous per row (e.g. one layer's slice of GDNState's buffers); log from
    :func:`~dflash2.runtime.kernels.gdn_verify.gdn_verify_triton` (ReplaySSM or native);
    n (N,) integer on the device, each in [0, T] (not checked: that would read it back to the host).
    Rows with n = 0 keep both states. block_v / num_warps: tuning knobs.
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
        conv_state, rec_state, log.x, k, u, g, states, n, num_k_heads=hk, native=log.native, block_v=bv, num_warps=warps
    )
