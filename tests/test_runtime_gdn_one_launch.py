"""``one_launch``: the GDN verify's prep and recurrence as one kernel whose recurrence programs wait for
their own head's prep programs on counters in global memory (dflash2/runtime/kernels/gdn_verify/one_launch.py).

* Against the two-kernel form over verify / commit steps with ragged n (deferred folds included): outputs,
  logs, native states and the committed states agree to fp32 rounding (the prep's L2 norm sums in
  another order: its programs are one warp of 4 tokens, not 4 warps of 16), the conv window exactly.
* The exact fold with it on: a block verify + commit equals single-token decoding bit for bit (bf16
  inputs), which is what keeps speculative output equal to plain greedy output.
* The counters are zeros again after every launch (the next launch hands out roles from ticket 0).

In the interpreter the programs run one after another in id order, which is ticket order, so every
prep program has finished before a recurrence program polls; on the GPU (``cuda``) they really run
side by side and the recurrence programs spin."""

import pytest
import torch
from test_runtime_gdn_kernels import (
    DEVICES,
    F32,
    GQA,
    GQA_CPU,
    _gdn_state,
    _steps,
    assert_block_verify_equals_single_token_decoding,
    make_case,
    per_device,
)

from dflash2.runtime.kernels.gdn_verify import gdn_verify_triton


def _sync_is_zero(device) -> bool:
    from dflash2.runtime.kernels.gdn_verify.one_launch import _SYNC

    bufs = [b for (kind, _, _), b in _SYNC.items() if kind == torch.device(device).type]
    return bool(bufs) and all(int(b.abs().sum()) == 0 for b in bufs)


@pytest.mark.parametrize(
    "device, mode, heads, T, N",
    per_device(
        cpu=[("replay", GQA_CPU, 3, 2), ("native", GQA_CPU, 2, 2)],
        cuda=[("replay", GQA, 16, 4), ("native", GQA, 16, 4), ("replay", (3, 3, 9, 5), 9, 3)],
    ),
)
def test_one_launch_matches_the_two_kernels(device, mode, heads, T, N):
    L = 2 if device == "cuda" else 1
    start = make_case(N, T, heads, device=device, seed=120)
    states = {}
    for one in (False, True):
        s = _gdn_state(start, mode, L, kernel_options=dict(one_launch=one))
        s.reserve(T)
        states[one] = s
    # ragged n across the batch, 0 and T included; three steps so that two verifies fold a deferred commit
    schedule = [[min(T, r * 3 % (T + 1)) for r in range(N)] for _ in range(3)]
    schedule[1][0], schedule[2][-1] = T, 0
    for args, n in zip(_steps(N, T, heads, L, len(schedule), device, seed=121), schedule):
        for layer in range(L):
            o_two = states[False].verify(layer, *args[layer])
            o_one = states[True].verify(layer, *args[layer])
            assert _sync_is_zero(device)
            torch.testing.assert_close(o_one, o_two, **F32)
            for name in ("k", "u", "g", "states"):
                a, b = getattr(states[True].logs[layer], name), getattr(states[False].logs[layer], name)
                assert (a is None) == (b is None), name
                if a is not None:
                    torch.testing.assert_close(a, b, **F32, msg=name)
            assert torch.equal(states[True].logs[layer].x, states[False].logs[layer].x)
        n = torch.tensor(n, device=device)
        for s in states.values():
            s.commit(n)
    for s in states.values():
        s.flush()
    torch.testing.assert_close(states[True].rec, states[False].rec, **F32)
    assert torch.equal(states[True].conv, states[False].conv)


@pytest.mark.parametrize("device, T, heads", per_device(cpu=[(3, GQA_CPU)], cuda=[(16, GQA), (9, (3, 3, 9, 5))]))
def test_one_launch_block_verify_equals_single_token_decoding(device, T, heads):
    """test_bf16_block_verify_equals_single_token_decoding (test_runtime_gdn_kernels.py) with one_launch on
    in both: the block's bf16 outputs and the committed states bit for bit those of T single-token steps."""
    case = make_case(2, T, heads, dtype=torch.bfloat16, device=device, seed=130 + T)
    assert_block_verify_equals_single_token_decoding(case, kernel_options=dict(one_launch=True))


@pytest.mark.parametrize("device", DEVICES)
def test_one_launch_leaves_the_states_alone_and_the_counters_zero(device):
    """Without a fold, verify only reads the states; and after a launch of another grid size (other N,
    T) the counters are zeros again."""
    for N, T in ((1, 2), (3, 1)):
        case = make_case(N, T, GQA_CPU, device=device, seed=140 + N)
        conv, rec = case["conv_state"].clone(), case["rec_state"].clone()
        o, log = gdn_verify_triton(**case, one_launch=True)
        o_ref, log_ref = gdn_verify_triton(**case)
        torch.testing.assert_close(o, o_ref, **F32)
        torch.testing.assert_close(log.u, log_ref.u, **F32)
        assert torch.equal(case["conv_state"], conv) and torch.equal(case["rec_state"], rec)
        assert _sync_is_zero(device)
