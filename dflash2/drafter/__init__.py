"""DFlash / DFlash2 drafter: config, model, masks, DFlash2 additions, save/load.

DFlash v1 is ``DrafterConfig(use_local_conv=False, use_selector=False)``; DFlash2
turns on the block-local conv and/or the candidate selector (ARCHITECTURE.md §2, §3).
"""

from dflash2.drafter.config import DrafterConfig
from dflash2.drafter.io import hf_config, load_drafter, save_drafter
from dflash2.drafter.local_conv import BlockLocalConv, naive_block_local_conv
from dflash2.drafter.masks import (
    ATTENTION_MODES,
    block_mask_mod,
    block_mask_sparsity,
    context_padding_mask,
    dense_block_mask,
    flex_block_mask,
    sliding_window_mask,
    uses_flex,
)
from dflash2.drafter.model import ContextCache, DFlashDrafter, RMSNorm
from dflash2.drafter.selector import CandidateSelector

__all__ = [
    "ATTENTION_MODES",
    "BlockLocalConv",
    "CandidateSelector",
    "ContextCache",
    "DFlashDrafter",
    "DrafterConfig",
    "RMSNorm",
    "block_mask_mod",
    "block_mask_sparsity",
    "context_padding_mask",
    "dense_block_mask",
    "flex_block_mask",
    "hf_config",
    "load_drafter",
    "naive_block_local_conv",
    "save_drafter",
    "sliding_window_mask",
    "uses_flex",
]
