"""Work queued beside the current CUDA stream, joined back before a phase ends (docs/ARCHITECTURE.md §6).

At batch 1 a decode phase is a chain of small kernels that each fill a few SMs, so two independent chains
overlap almost fully when they run on two streams. :class:`SideStream` forks a function onto a side stream
after everything queued so far and later makes the current stream wait for it. Inside a CUDA graph capture
the fork and the join become graph edges (the side stream joins the capture, its temporaries come from the
capture's pool), so a phase may fork as long as it joins before it returns. On the CPU ``fork`` just calls.
"""

from __future__ import annotations

import torch


class SideStream:
    """``fork(fn)``: fn() runs after the work queued so far on the current stream, beside what is queued next;
    ``join()``: the current stream waits for every fork since the last join. fn must read only tensors that
    outlive it (the current stream may reuse its own temporaries' memory meanwhile) and write only such."""

    def __init__(self, device, enabled: bool = True):
        device = torch.device(device)
        self.stream = torch.cuda.Stream(device) if enabled and device.type == "cuda" else None  # None: fork calls
        self.pending = False

    def fork(self, fn) -> None:
        if self.stream is None:
            fn()
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            fn()
        self.pending = True

    def join(self) -> None:
        if self.pending:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
            self.pending = False
