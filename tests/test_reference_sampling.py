"""Sampling warps and lossless acceptance (ARCHITECTURE.md §4), checked statistically.

Chi-square goodness of fit with fixed seeds on a tiny vocabulary: the tokens that
rejection sampling emits must follow the target's distribution p whatever the
proposal q is, and the same statistic must reject deliberately wrong acceptance
rules (so a pass means something). ``chi2_pvalue`` (tests/conftest.py) computes
the p-value without scipy.
"""

import pytest
import torch
from conftest import chi2_pvalue, nontrivial_dflash2

from dflash2.decoding import (
    SamplingParams,
    greedy_accept,
    point_mass,
    rejection_accept,
    speculative_generate,
    warp_probs,
)
from dflash2.drafter import CandidateSelector
from dflash2.errors import DFlash2Error

V, P, M = 8, 3, 40_000  # vocab, drafted positions, samples of the direct test
PASS, FAIL = 1e-3, 1e-6  # p-value above PASS: consistent with p; below FAIL: rejected


@pytest.fixture(scope="module")
def dists():
    """Fixed target p (P+1, V) and proposal q (P, V), different and both with full support."""
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(1.5 * torch.randn(P + 1, V, generator=g), -1)
    q = torch.softmax(1.5 * torch.randn(P, V, generator=g), -1)
    return p, q


def _draw(q, n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.multinomial(q.repeat(n, 1), 1, replacement=True, generator=g).view(n, q.shape[0])


def _emitted(a, drafts, nxt, k):
    """The k-th emitted token (0-based) of each row that emitted at least k+1, as a flat tensor."""
    rows = a >= k  # rows whose first k tokens were accepted drafts
    return torch.where(a[rows] > k, drafts[rows, k] if k < drafts.shape[1] else nxt[rows], nxt[rows])


# ------------------------------------------------------------------ warps and greedy acceptance
def test_warp_probs_temperature_top_k_top_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    torch.testing.assert_close(warp_probs(logits, SamplingParams(1.0)), torch.tensor([0.5, 0.3, 0.15, 0.05]))
    torch.testing.assert_close(warp_probs(logits, SamplingParams(2.0)), torch.softmax(logits / 2, -1))
    torch.testing.assert_close(warp_probs(logits, SamplingParams(1.0, top_k=2)), torch.tensor([0.625, 0.375, 0, 0]))
    # top-p keeps the smallest prefix reaching the mass: 0.5 + 0.3 >= 0.8, but 0.81 needs the third token
    torch.testing.assert_close(warp_probs(logits, SamplingParams(1.0, top_p=0.8)), torch.tensor([0.625, 0.375, 0, 0]))
    assert (warp_probs(logits, SamplingParams(1.0, top_p=0.81)) > 0).sum() == 3
    assert warp_probs(logits, SamplingParams(1.0, top_p=0.1))[0] == 1.0  # the top token always survives
    batch = torch.randn(3, 5, 16)
    w = warp_probs(batch, SamplingParams(0.7, top_k=4, top_p=0.9))
    assert w.shape == batch.shape and ((w > 0).sum(-1) <= 4).all()
    torch.testing.assert_close(w.sum(-1), torch.ones(3, 5))


@pytest.mark.parametrize(
    "bad", [dict(temperature=-0.1), dict(temperature=float("nan")), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5)]
)
def test_sampling_params_reject_bad_values(bad):
    with pytest.raises(DFlash2Error):
        SamplingParams(**bad)


def test_greedy_accept_longest_prefix_and_bonus():
    target_argmax = torch.tensor([[5, 6, 9, 2], [5, 6, 7, 2], [1, 6, 7, 2]])
    drafts = torch.tensor([[5, 6, 7], [5, 6, 7], [5, 6, 7]])
    a, nxt = greedy_accept(target_argmax, drafts)
    assert a.tolist() == [2, 3, 0]  # a later match after a mismatch never counts
    assert nxt.tolist() == [9, 2, 1]  # correction at the mismatch, bonus after a full match


# ------------------------------------------------------------------ rejection sampling, direct
def test_rejection_sampling_emits_target_distribution(dists):
    p, q = dists
    drafts = _draw(q, M, seed=1)  # (M, P), row-wise d_i ~ q_i
    a, nxt = rejection_accept(p.expand(M, -1, -1), q.expand(M, -1, -1), drafts, torch.Generator().manual_seed(2))
    for k in range(P + 1):  # token k given the k before it were accepted drafts: distributed as p_k
        assert chi2_pvalue(_emitted(a, drafts, nxt, k), p[k]) > PASS, f"emitted token {k}"
    # acceptance probability of the first draft is sum_x min(p_0(x), q_0(x)) (Leviathan et al.)
    rate, expected = (a >= 1).float().mean(), torch.minimum(p[0], q[0]).sum()
    assert abs(rate - expected) < 4 * (expected * (1 - expected) / M) ** 0.5
    assert set(a.unique().tolist()) == set(range(P + 1))


def test_point_mass_proposal_for_argmax_drafts(dists):
    p, q = dists
    drafts = q.argmax(-1).expand(M, -1)  # deterministic drafts: q is a point mass
    a, nxt = rejection_accept(p.expand(M, -1, -1), point_mass(drafts, V), drafts, torch.Generator().manual_seed(3))
    assert chi2_pvalue(_emitted(a, drafts, nxt, 0), p[0]) > PASS
    rate = (a >= 1).float().mean()  # accepted with probability p_0(d_0)
    assert abs(rate - p[0, drafts[0, 0]]) < 4 * (0.25 / M) ** 0.5


def test_equal_p_and_q_accept_everything(dists):
    p, _ = dists
    drafts = _draw(p[:P], 1000, seed=4)
    a, nxt = rejection_accept(
        p.expand(1000, -1, -1), p[:P].expand(1000, -1, -1), drafts, torch.Generator().manual_seed(5)
    )
    assert (a == P).all()  # p/q = 1: never rejected; the bonus comes from p_P
    assert chi2_pvalue(nxt, p[P]) > PASS


def _always_accept(p, q, drafts, generator):
    """Wrong rule 1: accept every draft (emits q, not p)."""
    n = torch.full(drafts.shape[:-1], drafts.shape[-1], dtype=torch.long)
    return n, torch.multinomial(p[..., -1, :], 1, generator=generator)[..., 0]


def _resample_from_p(p, q, drafts, generator):
    """Wrong rule 2: the right acceptance test, but resample from p instead of norm(max(0, p - q))."""
    a, _ = rejection_accept(p, q, drafts, generator)
    idx = a[:, None, None].expand(-1, 1, p.shape[-1])
    return a, torch.multinomial(p.gather(1, idx)[:, 0], 1, generator=generator)[:, 0]


@pytest.mark.parametrize("wrong_rule", [_always_accept, _resample_from_p])
def test_the_statistic_rejects_wrong_acceptance_rules(dists, wrong_rule):
    p, q = dists
    drafts = _draw(q, M, seed=1)
    a, nxt = wrong_rule(p.expand(M, -1, -1), q.expand(M, -1, -1), drafts, torch.Generator().manual_seed(2))
    assert chi2_pvalue(_emitted(a, drafts, nxt, 0), p[0]) < FAIL


# ------------------------------------------------------------------ end to end
@pytest.mark.parametrize("v2", [False, True], ids=["dflash", "dflash2"])
def test_speculative_sampling_follows_the_target_end_to_end(make_spec_target, make_spec_drafter, v2, monkeypatch):
    """Tokens 1 to 3 of real speculative decoding (tiny vocab target, T=0.8, top-k 6) with a random DFlash
    drafter (q = its warped softmax) or DFlash2 drafter (non-trivial conv + selector: drafts and q from the
    selector's sampled path over its top-4 candidates, each position conditioned on the sampled one before).

    Token 1 comes from the prefill; tokens 2 and 3 from the first verify step (accepted drafts, residual
    or bonus) or, after a rejection, token 3 from the second. Exact law from the target's own warped
    logits: p(x1), p(x2 | x1), p(x3 | x1, x2).
    """
    target = make_spec_target("qwen3", vocab_size=V, seed=3)
    drafter = make_spec_drafter(target, 4, v2=v2, seed=4)
    drafter = nontrivial_dflash2(drafter) if v2 else drafter
    params = SamplingParams(0.8, top_k=6)
    prompt, n = [1, 2, 3, 4], 800  # 800 rows: ~2 target forwards each; the direct test has 40k
    p1 = warp_probs(target(torch.tensor([prompt])).logits[0, -1], params)  # (V,)
    p2_given = warp_probs(target(torch.tensor([[*prompt, a] for a in range(V)])).logits[:, -1], params)  # (V, V)
    pairs = torch.tensor([[*prompt, a, b] for a in range(V) for b in range(V)])
    p3_given = warp_probs(target(pairs).logits[:, -1], params).view(V, V, V)  # [x1, x2] -> p(x3 | x1, x2)
    joint12 = p1[:, None] * p2_given  # (V, V)
    joint123 = joint12[:, :, None] * p3_given  # (V, V, V)
    sampled_paths = []  # the selector's sampled path must be what drafts (and gives q) at T>0
    real_sample_path = CandidateSelector.sample_path
    monkeypatch.setattr(
        CandidateSelector, "sample_path", lambda *a, **k: sampled_paths.append(1) or real_sample_path(*a, **k)
    )

    res = speculative_generate(
        target,
        drafter,
        [prompt] * n,
        max_new_tokens=3,
        temperature=params.temperature,
        top_k=params.top_k,
        generator=torch.Generator().manual_seed(5),
    )
    out = torch.tensor(res.sequences)  # (n, 3)
    accepted = torch.tensor([acc[0] for acc in res.accepted_drafts])
    # the residual, one accepted draft and two accepted drafts (the path's second, conditional q) all ran
    assert (accepted == 0).any() and (accepted == 1).any() and (accepted >= 2).any()
    assert bool(sampled_paths) == v2
    assert chi2_pvalue(out[:, 0], p1) > PASS
    assert chi2_pvalue(out[:, 1], joint12.sum(0)) > PASS
    assert chi2_pvalue(out[:, 2], joint123.sum((0, 1))) > PASS
    assert chi2_pvalue(out[:, 0] * V + out[:, 1], joint12.flatten()) > PASS
    assert chi2_pvalue(out[:, 1] * V + out[:, 2], joint123.sum(0).flatten()) > PASS
