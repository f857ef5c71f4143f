"""Where the runtime's Triton kernel tests run (shared by tests/test_runtime_*kernels.py and the attention tests).

On the CPU, Triton's interpreter (conftest.py sets TRITON_INTERPRET=1 on machines without a GPU); on a GPU,
for real. The ``interpret`` fixture (conftest.py) routes CPU tensors to the kernels while a test runs.
"""

import os

import torch


def kernel_devices() -> list[str]:
    """ "cpu" under Triton's interpreter, "cuda" where a GPU is present (both when a GPU run interprets too)."""
    cpu = ["cpu"] if os.environ.get("TRITON_INTERPRET") == "1" else []
    return cpu + (["cuda"] if torch.cuda.is_available() else [])
