"""DFlash2 block-local dynamic convolution (ARCHITECTURE.md §3.1).

A grouped, *dynamic*, depthwise, *causal* convolution along the positions of a block,
wrapped around every attention and MLP sub-layer:

    out[i, c] = Σ_t (base[side, t, c] + δ[i, side, t, g(c)]) · x[i - t, c]

* ``side`` 0 is the pre-conv (on the normed sub-layer input), 1 the post-conv (on the
  sub-layer output); both use the δ predicted once from the normed input.
* δ is predicted per position by ``kernel_projection`` and shared by the
  ``group_size`` consecutive channels of a group g(c) = c // group_size.
* tap t reads position i - t only when (i mod B) >= t: causal inside a block and
  nothing across blocks, so the sequence axis may be a concatenation of blocks
  (training: S = A·B) or a single block (decoding).

Layout matches vLLM's DFlash2 loader: ``kernel_projection(x).reshape(..., 2, taps, groups)``.
"""

from __future__ import annotations

import torch
from torch import nn


class BlockLocalConv(nn.Module):
    def __init__(self, hidden: int, kernel_size: int = 2, group_size: int = 16):
        super().__init__()
        assert hidden % group_size == 0, "hidden must be divisible by group_size"
        self.hidden, self.kernel_size, self.group_size = hidden, kernel_size, group_size
        self.groups = hidden // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden))  # [side, tap, channel]
        self.kernel_projection = nn.Linear(hidden, 2 * kernel_size * self.groups, bias=False)
        self.reset_parameters()

    def reset_parameters(self):
        # Identity at init: tap 0 = 1, other taps 0, no dynamic part. A fresh DFlash2
        # drafter therefore computes exactly DFlash v1 and the conv is learned as a
        # correction on top of it (and the v1/v2 ablation starts from the same function).
        if self.base_kernel.is_meta:  # built on "meta" to be loaded: nothing to init
            return
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0, :] = 1.0
            self.kernel_projection.weight.zero_()

    def deltas(self, x: torch.Tensor) -> torch.Tensor:
        """Dynamic taps from the normed sub-layer input.

        x: (..., T, hidden) -> δ: (..., T, 2, kernel_size, groups)
        """
        d = self.kernel_projection(x)  # (..., T, 2·K·G)
        return d.unflatten(-1, (2, self.kernel_size, self.groups))

    # drafter.conv_kernels: each side as the Triton kernels of conv_kernels.py where they run (set on every conv
    # of a drafter by set_conv_kernels; off by default, and the torch code below wherever they cannot run)
    use_kernels: bool = False

    def forward(self, x: torch.Tensor, side: int, delta: torch.Tensor, block_size: int) -> torch.Tensor:
        """Apply one side of the conv (``conv(x, s)`` of ARCHITECTURE.md §3.1; named
        ``forward`` so that ``nn.Module.apply(fn)`` keeps working for init/FSDP).

        x: (..., T, hidden), delta: (..., T, 2, K, G) from ``deltas``; T a multiple of
        block_size or a single (possibly partial) block. Returns (..., T, hidden).
        """
        if self.use_kernels:
            from dflash2.drafter.conv_kernels import conv_side, kernels_apply

            if kernels_apply(x, delta, self.group_size):
                return conv_side(x, delta, self.base_kernel, side, block_size, self.group_size)
        return block_conv_side_torch(x, delta, self.base_kernel, side, block_size, self.group_size)


def set_conv_kernels(module: nn.Module, flag: bool) -> None:
    """``use_kernels`` of every BlockLocalConv inside ``module`` (a drafter): drafter.conv_kernels."""
    for m in module.modules():
        if isinstance(m, BlockLocalConv):
            m.use_kernels = bool(flag)


def block_conv_side_torch(x, delta, base_kernel, side: int, block_size: int, group_size: int) -> torch.Tensor:
    """One side of the conv in torch ops (the module's default path and the kernels' twin).

    x: (..., T, hidden), delta: (..., T, 2, K, G), base_kernel: (2, K, hidden). Returns (..., T, hidden).
    """
    T = x.shape[-2]
    pos_in_block = torch.arange(T, device=x.device) % block_size  # (T,)
    out = None
    for t in range(base_kernel.shape[1]):
        # per-position kernel for tap t: base (hidden,) + group delta broadcast to channels
        dyn = delta[..., side, t, :].repeat_interleave(group_size, dim=-1)  # (..., T, hidden)
        w = base_kernel[side, t].to(x.dtype) + dyn  # (..., T, hidden)
        if t == 0:
            xs = x
        else:
            # x shifted down by t along T: xs[i] = x[i - t], zero where i - t leaves the block
            xs = torch.nn.functional.pad(x[..., : T - t, :], (0, 0, t, 0)) if t < T else torch.zeros_like(x)
            keep = (pos_in_block >= t).to(x.dtype)[:, None]  # (T, 1)
            xs = xs * keep
        term = w * xs
        out = term if out is None else out + term
    return out


def naive_block_local_conv(x, base_kernel, delta, side: int, block_size: int, group_size: int):
    """Loop reference of ``BlockLocalConv.forward`` for tests.

    x: (T, hidden), base_kernel: (2, K, hidden), delta: (T, 2, K, G). Returns (T, hidden).
    """
    T, C = x.shape
    K = base_kernel.shape[1]
    group_of = torch.arange(C) // group_size  # g(c) for every channel
    out = torch.zeros_like(x)
    for i in range(T):
        for t in range(K):
            if i % block_size >= t:  # tap stays inside the block (implies i - t >= 0)
                w = base_kernel[side, t, :] + delta[i, side, t, group_of]  # (C,)
                out[i] += w * x[i - t]
    return out
