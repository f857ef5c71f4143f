"""The decode loop's lagged host read (dflash2/runtime/poll.py).

On CUDA the host reads a step's (any row active, longest row) one step late, so the last
steps of a generation run with every row finished and attention reads up to a bound of the
longest row. Both must change nothing: the same tokens, per-row accepted counts and emitted
counts at every lag, greedy and sampled (same seed), for ragged batches with EOS inside a
block, attention-only and hybrid targets. The CPU runs the same loop with the lag forced.
"""

import pytest
import torch
from conftest import nontrivial_dflash2, spec_drafter
from test_runtime_engine import N_NEW, PROMPTS, ScriptedProposer, runtimes  # noqa: F401 (fixture)

from dflash2.runtime.drafter import RuntimeDrafter
from dflash2.runtime.engine import Decoder
from dflash2.runtime.poll import LaggedPoll

LAGS = (0, 1, 2)


def test_pairs_are_read_lag_steps_late_and_bound_the_longest_row():
    T, lag = 4, 2
    poll = LaggedPoll(torch.device("cpu"), lag)
    assert poll.start(torch.tensor([True, False]), torch.tensor([5, 9])) and poll.longest == 9
    assert poll.longest_bound(T) == 9  # nothing launched since the prefill's pair
    lengths = [(9, True), (13, True), (17, False), (17, False)]  # after steps 1..4
    seen = []
    for longest, active in lengths:
        go = poll.after_step(torch.tensor([active, False]), torch.tensor([longest, 3]))
        seen.append((go, poll.known, poll.longest_bound(T)))
    # step s's pair is read after step s + lag; until then the bound adds T per launched step
    assert seen == [(True, 0, 9 + 4), (True, 0, 9 + 8), (True, 1, 9 + 8), (True, 2, 13 + 8)]
    assert poll.after_step(torch.tensor([False, False]), torch.tensor([17, 3])) is False  # step 3: none active
    assert poll.known == 3 and poll.longest == 17
    with pytest.raises(ValueError, match="lag"):
        LaggedPoll(torch.device("cpu"), -1)


def _decoder(model, drafter, lag):
    dec = Decoder(model, drafter, max_len=128, poll_lag=lag)
    dec.kv_bucket = 1  # attention reads exactly up to the bound: one too short would change tokens
    return dec


def _generate(model, drafter, lag, **kw):
    dec = _decoder(model, drafter, lag)
    res = dec.generate_spec(PROMPTS, N_NEW, **kw)
    ar = dec.generate_ar(PROMPTS, N_NEW, **kw)
    return res.sequences, res.accepted_drafts, res.emitted, ar


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_every_lag_gives_the_same_tokens_and_steps(runtimes, kind):  # noqa: F811
    """Scripted ragged acceptance with EOS inside a block: identical outputs and per-row steps at every lag."""
    _, model, full = runtimes[kind]
    eos = full[0][len(PROMPTS[0]) + 11]
    runs = []
    for lag in LAGS:
        proposer = ScriptedProposer(full, ["oracle", "partial", "wrong", "partial"], 8, model.vocab_size, seed=3)
        runs.append(_generate(model, proposer, lag, eos_token_id=eos))
    assert runs[1] == runs[0] and runs[2] == runs[0]


def test_every_lag_samples_the_same_tokens_from_one_seed(runtimes):  # noqa: F811
    target, model, _ = runtimes["qwen3_5"]
    drafter = RuntimeDrafter(nontrivial_dflash2(spec_drafter(target, 4, v2=True, seed=2)), model)
    runs = []
    for lag in LAGS:
        dec = _decoder(model, drafter, lag)
        g = torch.Generator().manual_seed(7)
        res = dec.generate_spec(PROMPTS, 20, temperature=0.9, top_k=30, generator=g)
        runs.append((res.sequences, res.accepted_drafts))
    assert runs[1] == runs[0] and runs[2] == runs[0]


@pytest.mark.parametrize("lag", LAGS)
def test_the_commit_phase_writes_the_pair_at_one_address(runtimes, monkeypatch, lag):  # noqa: F811
    """The loop's pair is computed inside the commit phase (so that a graph replay writes it) into the slot's
    poll_pair: after every step it equals (any row active, longest row) as that step left them, at one address
    across steps and generations (a graph reads and writes fixed addresses); the loop never computes it
    eagerly (LaggedPoll.after_step), and the poll reads the pair of the step ``lag`` back."""
    _, model, full = runtimes["qwen3_5"]
    eos = full[0][len(PROMPTS[0]) + 11]
    monkeypatch.setattr(LaggedPoll, "after_step", lambda *a: pytest.fail("the loop computed the pair eagerly"))
    proposer = ScriptedProposer(full, ["oracle", "partial", "wrong", "partial"], 8, model.vocab_size, seed=3)
    dec = _decoder(model, proposer, lag)
    pairs, addresses, reads = [], set(), []  # per step: the slot's pair and the state's; the poll after it

    def on_step(s):
        expected = [int(s.active.any()), int(s.state.lengths.max())]
        pairs.append((s.poll_pair.tolist(), expected))
        addresses.add(s.poll_pair.data_ptr())

    after = LaggedPoll.after_step_pair

    def after_step_pair(self, pair):
        go = after(self, pair)
        reads.append((go, self.known, self.longest))
        return go

    monkeypatch.setattr(LaggedPoll, "after_step_pair", after_step_pair)
    dec.on_step = on_step
    for run in range(2):  # two generations, AR then speculative, in the same slot
        pairs.clear()
        reads.clear()
        if run == 0:
            dec.generate_ar(PROMPTS, N_NEW, eos_token_id=eos)
        else:
            dec.generate_spec(PROMPTS, N_NEW, eos_token_id=eos)
        assert all(got == want for got, want in pairs), pairs
        assert len(dec.slots) == 1 and addresses == {next(iter(dec.slots.values())).poll_pair.data_ptr()}
        # step k's pair is read after step k + lag; the generation stops at the first read pair with no row active
        done = next(k for k, (pair, _) in enumerate(pairs, 1) if pair[0] == 0)
        assert len(pairs) == done + lag
        for k, (go, known, longest) in enumerate(reads, 1):
            assert known == max(0, k - lag)
            if known:
                assert longest == pairs[known - 1][0][1] and go == bool(pairs[known - 1][0][0])
