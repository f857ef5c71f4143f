"""dflash2: DFlash2 block-diffusion drafters for speculative decoding.

The library root. Lightning and Hydra are imported only by
``dflash2.training`` (and ``train.py``); everything else loads without them.
"""

from dflash2.errors import DFlash2Error

__all__ = ["DFlash2Error"]
__version__ = "0.1.0"
