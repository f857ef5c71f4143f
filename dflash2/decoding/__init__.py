"""Reference (plain PyTorch) lossless speculative decoding: sampling, target-cache rollback, decoder.

ARCHITECTURE.md §2.7 (inference step), §4 (lossless verification), §5 (GDN rollback). The
Triton runtime reuses the acceptance math here and is tested against this path.
"""

from dflash2.decoding.decoder import DFlashProposer, Proposer, SpecResult, greedy_generate, speculative_generate
from dflash2.decoding.sampling import SamplingParams, greedy_accept, point_mass, rejection_accept, sample, warp_probs
from dflash2.decoding.target_state import CacheSnapshot, crop_attention, restore, rollback, snapshot

__all__ = [
    "CacheSnapshot",
    "DFlashProposer",
    "Proposer",
    "SamplingParams",
    "SpecResult",
    "crop_attention",
    "greedy_accept",
    "greedy_generate",
    "point_mass",
    "rejection_accept",
    "restore",
    "rollback",
    "sample",
    "snapshot",
    "speculative_generate",
    "warp_probs",
]
