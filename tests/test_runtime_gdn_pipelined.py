"""The verify recurrence's software-pipelined loops (``stages`` ≥ 1) against its hand prefetch (0).

``stages`` only changes how the token rows reach the registers (Triton's pipeliner instead of
rows carried two tokens ahead), never the arithmetic, so every result must be bit for bit the
same: outputs, logs, native states, the deferred fold, and the exact fold against single-token
decoding through the same option. CPU cases run in Triton's interpreter (which ignores the
stage count but runs the pipelined code path); the ``cuda`` cases run the real pipeline.
``split_out`` is the exception by design: it reorders the output's arithmetic, so its outputs
are checked to fp32 rounding and its logs (hence the states) bit for bit.
"""

import pytest
import torch
from test_runtime_gdn_kernels import DEVICES, F32, GQA, _after, _decode, _gdn_state, _inputs, _steps, make_case

from dflash2.runtime.kernels.gdn_verify import gdn_verify_triton


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("native", [False, True], ids=["replayssm", "native"])
@pytest.mark.parametrize("T, tiles", [(1, {}), (5, dict(block_v=4))])
def test_pipelined_verify_equals_the_hand_prefetch(device, native, T, tiles):
    case = make_case(3, T, device=device, seed=70 + T)
    o0, log0 = gdn_verify_triton(**case, native=native, stages=0, **tiles)
    for stages in (2,):
        o, log = gdn_verify_triton(**case, native=native, stages=stages, **tiles)
        assert torch.equal(o, o0), stages
        for name in ("states",) if native else ("k", "u", "g"):
            assert torch.equal(getattr(log, name), getattr(log0, name)), (stages, name)
    # split_out: o_t = hᵀq + (k·q) u_t rounds the outputs differently; the logs stay bit for bit
    o, log = gdn_verify_triton(**case, native=native, stages=2, split_out=True, **tiles)
    torch.testing.assert_close(o, o0, **F32)
    for name in ("states",) if native else ("k", "u", "g"):
        assert torch.equal(getattr(log, name), getattr(log0, name)), name


@pytest.mark.parametrize("device", DEVICES)
def test_pipelined_deferred_fold_equals_the_hand_prefetch(device):
    """Reserved logs (the engine's decode steps): each verify folds the previous commit's ragged n
    inside its pipelined loop; outputs and states bit for bit those of the default kernel."""
    N, T, L = 3, 4, 1
    start = make_case(N, T, GQA, device=device, seed=80)
    states = {s: _gdn_state(start, "replay", L, kernel_options=dict(stages=s, block_v=4)) for s in (0, 3)}
    for s in states.values():
        s.reserve(T)
    schedule = [[0, 1, T], [T, 0, 2]]
    for args, n in zip(_steps(N, T, GQA, L, len(schedule), device, seed=81), schedule):
        for layer in range(L):
            o = {k: s.verify(layer, *args[layer]) for k, s in states.items()}
            assert torch.equal(o[0], o[3])
        assert torch.equal(states[0].rec, states[3].rec) and torch.equal(states[0].conv, states[3].conv)
        for s in states.values():
            s.commit(torch.tensor(n, device=device))
    for s in states.values():
        s.flush()
    assert torch.equal(states[0].rec, states[3].rec) and torch.equal(states[0].conv, states[3].conv)


@pytest.mark.parametrize("device", DEVICES)
def test_pipelined_exact_fold_equals_single_token_decoding(device):
    """verify(T) + commit(n) through the pipelined kernel == n single-token steps through it."""
    N, T = 4, 4
    case = make_case(N, T, device=device, seed=90)
    n = torch.tensor([0, 1, T // 2, T], device=device)
    opts = dict(kernel_options=dict(stages=2))
    _, rec_steps, u_steps = _decode(case, "replay", **opts)
    s = _gdn_state(case, "replay", **opts)
    s.verify(0, *_inputs(case))
    assert torch.equal(s.logs[0].u, u_steps)
    s.commit(n)
    assert torch.equal(s.rec[0], _after(rec_steps, n))
