"""Peak GPU memory of training, per rank (the figure a multi-GPU run reports per GPU).

``torch.cuda.max_memory_allocated`` counts the tensors the caching allocator handed out since the
last reset: the frozen target, the drafter, its gradients and optimizer state (or their shards under
FSDP) and the activations of the largest step. The count is reset right before ``trainer.fit`` (the
data regeneration before it runs the target on the same GPU, with its own, other peak) and read right
after it, before the held-out report and the final measured τ: the training peak, the validations
and their measured τ included. The allocator's reserved pool (what ``nvidia-smi`` shows) is larger;
reserved is reported beside it because fragmentation is what an out-of-memory error meets.

Compare runs whose kernels are already tuned. Measured on an H200 with the micro drafter of the GPU
tests (tests/test_gpu_strategies.py), in the order they ran on a fresh machine: the plain run and
the DDP run peaked at 0.31 GiB, and the FSDP run and both resumed runs after them at 0.06 GiB. The
0.25 GiB difference matches the 256 MB scratch buffer that Triton's benchmarking allocates while it
tunes a kernel, which a run only does when its kernels are not in the disk caches yet. That cause is
inferred from the size; it was not traced.
"""

from __future__ import annotations

import torch

GIB = 2**30


def reset_peak_memory(device: torch.device) -> None:
    """Start this rank's peak count afresh (no-op off CUDA)."""
    # Before CUDA's first use in this process (target and data both cached) there is nothing to reset,
    # and torch refuses the call ("Invalid device argument").
    if device.type == "cuda" and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_per_rank(strategy, device: torch.device) -> dict[str, list[float]] | None:
    """Every rank's peak allocated and reserved GiB on its GPU, indexed by global rank; None off CUDA.

    Call it on every rank: with several processes it is a collective (one all-gather of two
    numbers). ``strategy`` is the Lightning strategy the run trained under (its ``all_gather``
    returns a (world, 2) tensor with several processes and the (2,) tensor itself with one).
    """
    if device.type != "cuda":
        return None
    local = torch.tensor(
        [torch.cuda.max_memory_allocated(device) / GIB, torch.cuda.max_memory_reserved(device) / GIB],
        dtype=torch.float64,
        device=device,
    )
    gathered = strategy.all_gather(local).reshape(-1, 2).cpu()
    return {
        "allocated_gib": [round(float(v), 3) for v in gathered[:, 0]],
        "reserved_gib": [round(float(v), 3) for v in gathered[:, 1]],
    }
