"""Seeded initialisation of a drafter: one random stream for the backbone, one per DFlash2 addition.

The v1 vs DFlash2 ablation (issue 11) compares variants trained from the same seed. That is only
fair if they start from the same backbone (``fc``, ``hidden_norm``, the decoder layers' attention,
MLP and norms, ``norm``), bit for bit. Drawing every tensor from the global RNG in module order
breaks this: the additions' tensors (and the default init that ``nn.Linear`` runs while the modules
are built) consume random numbers before the backbone is drawn, so switching an addition on
reshuffles everything. Here each stream is a ``torch.Generator`` seeded from (seed, stream name):
the backbone stream never sees the additions, and the selector draws the same initial codebooks
whether or not the conv is on.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from dflash2.drafter.local_conv import BlockLocalConv
from dflash2.drafter.selector import CandidateSelector

INIT_STD = 0.02  # HF Qwen3 initializer_range; the drafter trains from scratch
ADDITIONS = (BlockLocalConv, CandidateSelector)  # DFlash2's modules (ARCHITECTURE.md §3): not part of the backbone
BACKBONE_STREAM = "backbone"
SELECTOR_STREAM = "candidate_selector"


def stream_generator(seed: int, stream: str) -> torch.Generator:
    """A CPU generator for ``stream``, seeded from (seed, stream) by sha256 (stable across processes)."""
    digest = hashlib.sha256(f"{int(seed)}/{stream}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def draw_seed() -> int:
    """A seed drawn from the global CPU RNG: ``torch.manual_seed(s)`` then a build is reproducible."""
    return int(torch.randint(0, 2**62, (1,), device="cpu"))


def backbone_modules(drafter: nn.Module) -> list[nn.Module]:
    """The drafter's modules outside the DFlash2 additions, in registration order."""
    inside_additions = {id(m) for a in drafter.modules() if isinstance(a, ADDITIONS) for m in a.modules()}
    return [m for m in drafter.modules() if id(m) not in inside_additions]


def is_backbone_parameter(name: str) -> bool:
    """True for state-dict keys of the backbone (those of a DFlash v1 drafter)."""
    return "_conv." not in name and not name.startswith("candidate_selector.")


@torch.no_grad()
def normal_from(tensor: torch.Tensor, generator: torch.Generator, std: float = INIT_STD) -> None:
    """Fill ``tensor`` with N(0, std²) drawn on the CPU from ``generator`` (same values on any device)."""
    # device="cpu" explicitly: a caller may build the drafter under ``with torch.device("cuda")``,
    # which would otherwise put this buffer on the GPU, where the CPU generator cannot draw
    tensor.copy_(torch.empty(tensor.shape, dtype=torch.float32, device="cpu").normal_(0.0, std, generator=generator))


@torch.no_grad()
def initialise_drafter(drafter: nn.Module, seed: int) -> None:
    """Backbone Linears ~ N(0, 0.02²) from the backbone stream, RMSNorm weights 1; the conv back to
    identity (no random numbers); the selector from its own stream."""
    from dflash2.drafter.model import RMSNorm  # model.py imports this module

    backbone = stream_generator(seed, BACKBONE_STREAM)
    for module in backbone_modules(drafter):
        if isinstance(module, nn.Linear):
            normal_from(module.weight, backbone)
        elif isinstance(module, RMSNorm):
            module.weight.fill_(1.0)
    for module in drafter.modules():
        if isinstance(module, BlockLocalConv):
            module.reset_parameters()
        elif isinstance(module, CandidateSelector):
            module.reset_parameters(generator=stream_generator(seed, SELECTOR_STREAM))
