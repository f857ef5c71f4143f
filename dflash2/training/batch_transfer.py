"""A pinned training batch copied to the GPU on a side stream, beside the compute (issue 15; docs/TRAINING.md
"Training step overheads").

Lightning moves each batch with ``tensor.to(device, non_blocking=True)`` on the current (compute) stream.
From page-locked memory (``data.pin_memory``) that copy is an asynchronous DMA, but on the compute stream
it still runs in turn: after the previous step's backward and optimiser kernels, before this step's
forward, which waits for it. At the time Lightning moves the batch the host is usually far ahead of the
GPU (the step's syncs come later), so the same copy issued on a stream of its own runs while the GPU is
still busy with the previous step, and the compute stream only waits for its end, which has usually
passed. Values are the same: a copy is a copy.

The copy stream does not wait for the compute stream (that wait is what is avoided): the sources are
host memory the CPU filled before the call, and the destinations are new allocations of the copy
stream, whose earlier blocks the allocator hands out again only once every stream recorded on them
is done with them. The compute stream waits for the copy stream (``wait_stream``) before anything it
runs next, and each copied tensor is recorded as used by the compute stream (``record_stream``), so
its memory is not handed to the copy stream again while the step still reads it. The pinned source
stays valid until its copy ends: torch's pinned-memory allocator keeps a block until the copies that
read it have finished.
"""

from __future__ import annotations

from typing import Any

import torch


def batch_tensors(batch: Any) -> list[torch.Tensor]:
    """Every tensor of a batch (dicts, lists and tuples of tensors, nested), in order."""
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, dict):
        return [t for v in batch.values() for t in batch_tensors(v)]
    if isinstance(batch, (list, tuple)):
        return [t for v in batch for t in batch_tensors(v)]
    return []


def copies_beside_compute(batch: Any, device: torch.device) -> bool:
    """Whether ``copy_beside_compute`` applies: a CUDA destination and a batch whose tensors are all on the
    host in page-locked memory (a pageable copy would block the host anyway: no point in a side stream)."""
    tensors = batch_tensors(batch)
    return (
        torch.device(device).type == "cuda"
        and bool(tensors)
        and all(t.device.type == "cpu" and t.is_pinned() for t in tensors)
    )


def _moved(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return type(batch)((k, _moved(v, device)) for k, v in batch.items())
    if isinstance(batch, (list, tuple)):
        return type(batch)(_moved(v, device) for v in batch)
    return batch


def copy_beside_compute(batch: Any, device: torch.device, streams: dict) -> Any:
    """``batch`` (pinned host tensors, see ``copies_beside_compute``) on ``device``, copied on a side stream of
    that device (kept in ``streams``, one per device, made on first use); the current stream waits for it."""
    device = torch.device(device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in streams:
        streams[device] = torch.cuda.Stream(device)
    side, compute = streams[device], torch.cuda.current_stream(device)
    with torch.cuda.stream(side):
        moved = _moved(batch, device)
    compute.wait_stream(side)
    for t in batch_tensors(moved):
        t.record_stream(compute)
    return moved
