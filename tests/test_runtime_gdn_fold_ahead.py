"""``fold_ahead``: each GDN layer's verify also folds the next layer's pending (deferred) commit.

The fold-ahead programs run the fold that layer's own verify would run — same tile, same operations, same
order — so everything must be bit for bit what the state gives with the option off: every verify's output,
the states after the flush, and after each verify the next layer's counts are zero (nothing left for its
verify). CPU cases run in Triton's interpreter; the ``cuda`` cases on a GPU.
"""

import pytest
import torch
from test_runtime_gdn_kernels import DEVICES, GQA, _gdn_state, _steps, make_case

from dflash2.runtime.kernels.gdn_log import NextLayerFold, PendingFold
from dflash2.runtime.kernels.gdn_verify import gdn_verify_triton


@pytest.mark.parametrize("device", DEVICES)
def test_fold_ahead_equals_each_layer_folding_its_own(device):
    N, T, L = 2, 4, 3
    start = make_case(N, T, GQA, device=device, seed=140)
    states = {on: _gdn_state(start, "replay", L, kernel_options=dict(block_v=4, fold_ahead=on)) for on in (1, 0)}
    assert states[1].fold_ahead and not states[0].fold_ahead
    for s in states.values():
        s.reserve(T)
    # ragged counts with the pitfalls: 0 (nothing pending for that row), T (all), 1
    schedule = [[0, T], [T, 2], [1, 3]]
    for step, (args, n) in enumerate(zip(_steps(N, T, GQA, L, len(schedule), device, seed=141), schedule)):
        for layer in range(L):
            o = {on: s.verify(layer, *args[layer]) for on, s in states.items()}
            assert torch.equal(o[1], o[0]), (step, layer)
            if layer + 1 < L:
                assert not states[1]._pend[T][layer + 1].any(), (step, layer)  # folded ahead: nothing pending
                if step > 0:
                    assert states[0]._pend[T][layer + 1].any()  # off: still pending for its own verify
        for s in states.values():
            s.commit(torch.tensor(n, device=device))
    for s in states.values():
        s.flush()
    assert torch.equal(states[1].rec, states[0].rec) and torch.equal(states[1].conv, states[0].conv)


def test_fold_ahead_defaults_and_refusals():
    case = make_case(2, 3, GQA, seed=150)
    kw = dict(kernel_options=dict(block_v=4))
    off = _gdn_state(case, "replay", 2, **kw)
    assert not off.fold_ahead and "fold_ahead" not in off.options_ran()  # CPU: off unless asked
    on = _gdn_state(case, "replay", 2, kernel_options=dict(fold_ahead=True))
    assert on.fold_ahead and on.options_ran()["fold_ahead"] is True  # what results.json records
    # no sequential walk to run the programs in: off whatever was asked
    for mode, opts in [("native", {}), ("replay", dict(stages=0)), ("replay", dict(one_launch=True))]:
        assert not _gdn_state(case, mode, 2, kernel_options=dict(opts, fold_ahead=True)).fold_ahead, (mode, opts)
    # gdn_verify_triton: a next layer's fold is run only by the fold-ahead programs
    T = case["x"].shape[1]
    s = _gdn_state(case, "replay", 2, kernel_options=dict(block_v=4, fold_ahead=True))
    s.reserve(T)
    log = s._static[T][0]
    here = PendingFold(s._pend[T][0], *(t[0] for t in s._stash[T]))
    nxt = NextLayerFold(s.rec[1], s._static[T][1].u, PendingFold(s._pend[T][1], *(t[1] for t in s._stash[T])))
    with pytest.raises(ValueError, match="fold_ahead"):
        gdn_verify_triton(**case, out=log, fold=here, fold_next=nxt, block_v=4)
    with pytest.raises(ValueError, match="own fold"):  # no fold of its own: not the deferred path
        gdn_verify_triton(**case, out=log, fold_next=nxt, block_v=4, fold_ahead=True)
    with pytest.raises(ValueError, match="state layout"):
        bad = NextLayerFold(s.rec[1, :1], nxt.u, nxt.fold)
        gdn_verify_triton(**case, out=log, fold=here, fold_next=bad, block_v=4, fold_ahead=True)


@pytest.mark.cuda
def test_fold_ahead_is_on_at_one_row_on_the_gpu():
    for rows, on in ((1, True), (2, False)):
        case = make_case(rows, 3, GQA, device="cuda", seed=160)
        assert _gdn_state(case, "replay", 2).fold_ahead is on
    assert not _gdn_state(make_case(1, 3, GQA, device="cuda", seed=161), "native", 2).fold_ahead
