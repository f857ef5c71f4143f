"""``pdl``: the GDN verify's recurrence kernel launched as a programmatic dependent of its prep kernel
(dflash2/runtime/kernels/gdn_verify: it starts early, loads what the prep does not write, and waits
(gdc_wait) before reading the prep's outputs). Only the timing may change, never a value: outputs, logs,
native states and the deferred fold of a few verify / commit steps bit for bit against pdl off, both
recurrence loops (hand prefetch, pipelined). On CPU tensors the option is ignored (the interpreter has no
grid dependency control), so the CPU case checks the switch is accepted and harmless; the ``cuda`` case
runs it for real (an H200, Hopper's griddepcontrol)."""

import pytest
import torch
from test_runtime_gdn_kernels import DEVICES, GQA, _gdn_state, _steps, make_case

CUDA_CASES = [("replay", 0), ("replay", 2), ("native", 0)]
CASES = [pytest.param(DEVICES[0].values[0], "replay", 0, marks=DEVICES[0].marks)] + [
    pytest.param(DEVICES[1].values[0], mode, stages, marks=DEVICES[1].marks) for mode, stages in CUDA_CASES
]  # the interpreter (where the switch is ignored): one small case, the switch accepted and harmless


@pytest.mark.parametrize("device, mode, stages", CASES)
def test_pdl_changes_no_value(device, mode, stages):
    T, N, L = (5, 3, 2) if device == "cuda" else (2, 2, 1)
    start = make_case(N, T, GQA, device=device, seed=90)
    states = {}
    for pdl in (False, True):
        s = _gdn_state(start, mode, L, kernel_options=dict(pdl=pdl, stages=stages))
        s.reserve(T)
        states[pdl] = s
    schedule = [[0, T, 1], [T, 2, 0], [1, 1, T]] if device == "cuda" else [[0, T], [T, 1]]
    for args, n in zip(_steps(N, T, GQA, L, len(schedule), device, seed=91), schedule):
        for layer in range(L):
            o_off = states[False].verify(layer, *args[layer])
            o_on = states[True].verify(layer, *args[layer])
            assert torch.equal(o_on, o_off), layer
            for name in ("x", "k", "u", "g", "states"):
                a, b = getattr(states[True].logs[layer], name), getattr(states[False].logs[layer], name)
                assert (a is None and b is None) or torch.equal(a, b), name
        n = torch.tensor(n, device=device)
        for s in states.values():
            s.commit(n)
    for s in states.values():
        s.flush()
    assert torch.equal(states[True].rec, states[False].rec) and torch.equal(states[True].conv, states[False].conv)


def test_pdl_default_is_on_only_for_one_replayssm_row_on_hopper(monkeypatch):
    """gdn_verify_triton(pdl=None): on for ReplaySSM's sequential walk of one row on a GPU of compute
    capability ≥ 9 (where it was measured faster); off for native, the chunked walk, more rows, older GPUs
    and CPU tensors (the interpreter)."""
    from dflash2.runtime.kernels.gdn_verify import PDL_MAX_ROWS, _pdl_by_default

    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert PDL_MAX_ROWS == 1
    assert _pdl_by_default(cuda, 1, native=False, chunked=False)
    assert not _pdl_by_default(cuda, 2, native=False, chunked=False)
    assert not _pdl_by_default(cuda, 1, native=True, chunked=False)
    assert not _pdl_by_default(cuda, 1, native=False, chunked=True)
    assert not _pdl_by_default(torch.device("cpu"), 1, native=False, chunked=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert not _pdl_by_default(cuda, 1, native=False, chunked=False)
