"""Batched T=0 acceptance (dflash2.runtime.step.accept_greedy) against the reference decoder's greedy_accept."""

import torch

from dflash2.decoding.sampling import greedy_accept
from dflash2.runtime.step import accept_greedy

B = 8
P = B - 1


def _batch(seed: int, N: int = 64, vocab: int = 3):
    """Target argmaxes and drafts that agree often (small vocab), so every a in 0..P shows up."""
    g = torch.Generator().manual_seed(seed)
    argmax = torch.randint(0, vocab, (N, B), generator=g)
    drafts = argmax[:, :-1].clone()
    wrong = torch.rand(N, P, generator=g) < 0.2
    drafts[wrong] = (drafts[wrong] + 1) % vocab
    drafts[0] = argmax[0, :-1]  # a full match
    drafts[1, 0] = (argmax[1, 0] + 1) % vocab  # nothing accepted: the correction alone is emitted
    return argmax, drafts


def test_matches_reference_row_by_row():
    argmax, drafts = _batch(0)
    acc = accept_greedy(argmax, drafts)
    assert set(acc.num_accepted.tolist()) == set(range(B))  # every acceptance length occurs
    for r in range(argmax.shape[0]):
        a, nxt = greedy_accept(argmax[r], drafts[r])
        assert acc.num_accepted[r] == a and acc.next_anchor[r] == nxt
        assert acc.commit[r] == a + 1 and acc.num_emitted[r] == a + 1
        assert acc.tokens[r, : a + 1].tolist() == [*drafts[r, :a].tolist(), int(nxt)]
    assert acc.num_accepted[0] == P and acc.num_accepted[1] == 0
    assert not acc.finished.any()


def test_eos_budget_and_inactive_rows():
    eos = 2
    argmax = torch.tensor(
        [
            [0, 1, 0, 1, 0, 1, 0, 1],  # full match, no EOS
            [0, 1, eos, 1, 0, 1, 0, 1],  # EOS accepted as the 3rd draft: emit 3, finished
            [0, 1, 0, eos, 0, 1, 0, 1],  # first mismatch at d_4: the bonus there is EOS
            [0, 1, 0, 1, 0, 1, 0, 1],  # EOS only among rejected drafts: ignored
            [0, 1, 0, 1, 0, 1, 0, 1],  # budget 2 cuts a full match
            [0, 1, 0, 1, 0, 1, 0, 1],  # inactive
        ]
    )
    drafts = argmax[:, :-1].clone()
    drafts[2, 3] = 1  # d_4 != eos: a = 3, bonus = eos
    drafts[3, 1], drafts[3, 4] = 0, eos  # mismatch at d_2: a = 1; the EOS at d_5 is never emitted
    budget = torch.tensor([100, 100, 100, 100, 2, 100])
    active = torch.tensor([True, True, True, True, True, False])
    acc = accept_greedy(argmax, drafts, eos_token_id=eos, budget=budget, active=active, pad_token_id=-1)
    assert acc.num_accepted.tolist() == [7, 7, 3, 1, 7, 0]
    assert acc.commit.tolist() == [8, 8, 4, 2, 8, 0]
    assert acc.num_emitted.tolist() == [8, 3, 4, 2, 2, 0]
    assert acc.finished.tolist() == [False, True, True, False, True, True]
    assert acc.tokens[1].tolist() == [0, 1, eos, -1, -1, -1, -1, -1]
    assert acc.tokens[2].tolist() == [0, 1, 0, eos, -1, -1, -1, -1]
    assert acc.tokens[3].tolist() == [0, 1, -1, -1, -1, -1, -1, -1]
    assert acc.tokens[5].tolist() == [-1] * B
