"""Triton kernels of the runtime, one folder per op (docs/ARCHITECTURE.md §5.5, §6).

Each op folder holds ``reference.py`` (the plain-PyTorch twin, also the runtime's
``mode="reference"`` path), ``kernel.py`` (the Triton kernel and its launcher) and an
``__init__`` with the public function and its shapes:

- :mod:`.gdn_verify`: Gated DeltaNet outputs of a block of T tokens from the untouched
  state (conv + SiLU, q/k L2 norm, gates, recurrence fused), logging what a commit needs;
- :mod:`.gdn_replay`: the commit: fold n[r] logged tokens into row r's state ("exact fold")
  or, for the native-rollback ablation, copy the state verify stored at position n[r];
  and roll the conv window.

Importing this package does not import Triton (the reference twins are plain PyTorch);
:mod:`.triton_util` says how Triton must be set up to run the kernels on CPU tensors.
"""
