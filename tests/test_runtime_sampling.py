"""T>0 on the runtime (dflash2.runtime.sampling, engine): sparse proposals and lossless sampling.

* The runtime's rejection sampling is the reference ``rejection_accept`` without a dense q where
  none is needed and without host syncs: for one generator state both return exactly the same
  counts and tokens (point masses, k-sparse and dense q); its sync-free ``sample`` draws what
  ``torch.multinomial`` draws.
* The selector's sparse sampled path draws what ``CandidateSelector.sample_path`` draws.
* End to end, chi-square tests like the reference decoder's (tests/test_reference_sampling.py):
  the first three tokens of the runtime's speculative decode (v1 drafter with a dense q, the same
  drafter's argmax drafts as point masses, a DFlash2 selector with a sparse q) and of its AR
  decode follow the target's warped distribution, for an attention and a hybrid target. A whole
  sample is one ragged batch: thousands of rows decoded in the same steps.
"""

import pytest
import torch
from conftest import build_runtime_hf, nontrivial_dflash2, spec_drafter
from test_reference_sampling import chi2_pvalue

from dflash2.decoding import SamplingParams, rejection_accept, warp_probs
from dflash2.decoding import sample as reference_sample
from dflash2.drafter.selector import CandidateSelector
from dflash2.runtime import load_model
from dflash2.runtime.drafter import RuntimeDrafter
from dflash2.runtime.engine import generate_ar, generate_spec
from dflash2.runtime.sampling import Proposal, rejection_accept_proposal, sample
from dflash2.runtime.selector_path import selector_sample_sparse
from dflash2.runtime.step import accept_sampled

V, P, K = 8, 3, 3  # vocab, drafted positions, sparse candidates
PASS = 1e-3  # p-value above PASS: consistent with the target's distribution


def _sparse_q(M: int, seed: int):
    """Random p (M, P+1, V), a k-sparse q (M, P, K) with distinct ids, and drafts drawn from q."""
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(1.5 * torch.randn(M, P + 1, V, generator=g), -1)
    ids = torch.rand(M, P, V, generator=g).argsort(-1)[..., :K]  # K distinct ids per position
    probs = torch.softmax(torch.randn(M, P, K, generator=g), -1)
    pick = torch.multinomial(probs.view(-1, K), 1, generator=g).view(M, P, 1)
    return p, ids, probs, ids.gather(-1, pick)[..., 0]


def test_sample_draws_what_multinomial_draws():
    probs = torch.softmax(2 * torch.randn(3, 40, 50, generator=torch.Generator().manual_seed(0)), -1)
    probs[0, 0, :45] = 0  # zero-probability tokens are never drawn
    probs[0, 0] /= probs[0, 0].sum()
    for seed in range(4):
        got = sample(probs, torch.Generator().manual_seed(seed))
        assert torch.equal(got, reference_sample(probs, torch.Generator().manual_seed(seed)))
    assert (got[0, 0] >= 45).all()


def test_rejection_is_the_reference_on_the_densified_q():
    p, ids, probs, drafts = _sparse_q(4000, seed=0)
    dense = torch.softmax(torch.randn(4000, P, V, generator=torch.Generator().manual_seed(7)), -1)
    dense_drafts = reference_sample(dense, torch.Generator().manual_seed(8))
    for proposal in (Proposal(drafts, ids, probs), Proposal(drafts), Proposal(dense_drafts, dense=dense)):
        got = rejection_accept_proposal(p, proposal, torch.Generator().manual_seed(1))
        ref = rejection_accept(p, proposal.densify(V), proposal.tokens, torch.Generator().manual_seed(1))
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
        assert set(got[0].tolist()) == set(range(P + 1))  # rejections at every position and full accepts


def test_sparse_rejection_emits_the_target_distribution():
    """Independently of the reference: the first emitted token follows p_0 (accepted draft or residual)."""
    M = 40_000
    p, ids, probs, drafts = _sparse_q(1, seed=2)
    drafts = ids.expand(M, -1, -1).gather(
        -1, torch.multinomial(probs[0], M, replacement=True, generator=torch.Generator().manual_seed(3)).T[..., None]
    )[..., 0]
    proposal = Proposal(drafts, ids.expand(M, -1, -1), probs.expand(M, -1, -1))
    a, nxt = rejection_accept_proposal(p.expand(M, -1, -1), proposal, torch.Generator().manual_seed(4))
    first = torch.where(a > 0, drafts[:, 0], nxt)
    assert chi2_pvalue(first, p[0, 0]) > PASS
    q0 = torch.zeros(V).scatter_(0, ids[0, 0], probs[0, 0])
    rate, expected = (a >= 1).float().mean(), torch.minimum(p[0, 0], q0).sum()
    assert abs(rate - expected) < 4 * (expected * (1 - expected) / M) ** 0.5


def test_selector_sparse_path_draws_what_sample_path_draws():
    torch.manual_seed(0)
    sel = CandidateSelector(vocab=50, hidden=16, rank=8, top_k=5, init_std=0.5)
    hidden, logits, anchor = torch.randn(6, 7, 16), torch.randn(6, 7, 50), torch.randint(0, 50, (6,))
    tokens, q = sel.sample_path(hidden, logits, anchor, 0.7, torch.Generator().manual_seed(9))
    got = selector_sample_sparse(sel, hidden, logits, anchor, 0.7, torch.Generator().manual_seed(9))
    assert torch.equal(got.tokens, tokens) and got.ids.shape == (6, 7, 5)
    torch.testing.assert_close(got.densify(50), q, rtol=0, atol=0)


def test_accept_sampled_budget_eos_and_inactive_rows():
    p, ids, probs, drafts = _sparse_q(64, seed=5)
    p[:32] = torch.nn.functional.one_hot(torch.cat([drafts[:32], drafts[:32, :1]], 1), V).float()  # all accepted
    acc = accept_sampled(
        p,
        Proposal(drafts, ids, probs),
        torch.Generator().manual_seed(6),
        active=torch.arange(64) != 1,
        budget=torch.full((64,), 2),
    )
    assert acc.num_accepted[0] == P and acc.num_emitted[0] == 2 and acc.finished[0]  # cut by the budget
    assert acc.num_emitted[1] == 0 and acc.commit[1] == 0  # inactive
    assert bool((acc.num_emitted <= 2).all()) and bool((acc.commit[2:] == acc.num_accepted[2:] + 1).all())


# ------------------------------------------------------------------ end to end
@pytest.fixture(scope="module")
def tiny_vocab_targets(tmp_path_factory):
    """{kind: (HF model, runtime model)} with an 8-token vocabulary, so distributions can be tested."""
    from dflash2.target import TargetModel

    out = {}
    for kind in ("qwen3", "qwen3_5"):
        hf = build_runtime_hf(kind, seed=3, vocab_size=V)
        folder = tmp_path_factory.mktemp(f"tiny_vocab_{kind}")
        hf.save_pretrained(folder)
        out[kind] = (TargetModel(hf, target_layer_ids=[0, 1]), load_model(folder, target_layer_ids=[0, 1]))
    return out


def _exact_laws(target, prompt, params):
    """Warped law of tokens 1..3 from the HF target: p1 (V,), joint12 (V, V), joint123 (V, V, V)."""
    with torch.no_grad():
        p1 = warp_probs(target(torch.tensor([prompt])).logits[0, -1], params)
        one = torch.tensor([[*prompt, x] for x in range(V)])
        p2 = warp_probs(target(one).logits[:, -1], params)  # (V, V): x1 -> p(x2 | x1)
        two = torch.tensor([[*prompt, x, y] for x in range(V) for y in range(V)])
        p3 = warp_probs(target(two).logits[:, -1], params).view(V, V, V)
    joint12 = p1[:, None] * p2
    return p1, joint12, joint12[..., None] * p3


def _check_law(out: torch.Tensor, laws):
    p1, joint12, joint123 = laws
    assert chi2_pvalue(out[:, 0], p1) > PASS
    assert chi2_pvalue(out[:, 1], joint12.sum(0)) > PASS
    assert chi2_pvalue(out[:, 2], joint123.sum((0, 1))) > PASS
    assert chi2_pvalue(out[:, 0] * V + out[:, 1], joint12.flatten()) > PASS
    assert chi2_pvalue(out[:, 1] * V + out[:, 2], joint123.sum(0).flatten()) > PASS


DRAFTS = {"v1-dense": (False, False), "v1-point-mass": (False, True), "dflash2-sparse": (True, False)}


@pytest.mark.parametrize("drafts", list(DRAFTS))
@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_speculative_sampling_follows_the_target(tiny_vocab_targets, kind, drafts):
    v2, argmax_drafts = DRAFTS[drafts]
    target, model = tiny_vocab_targets[kind]
    drafter = spec_drafter(target, 4, v2=v2, seed=4)
    drafter = nontrivial_dflash2(drafter) if v2 else drafter
    params = SamplingParams(0.8, top_k=6, top_p=0.95)
    prompt, n = [1, 2, 3, 4], 3000
    res = generate_spec(
        model,
        RuntimeDrafter(drafter, model),
        [prompt] * n,
        3,
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        generator=torch.Generator().manual_seed(5),
        argmax_drafts=argmax_drafts,
    )
    first = torch.tensor([acc[0] for acc in res.accepted_drafts])
    assert (first == 0).any() and (first > 0).any()  # the residual and the accepted path both ran
    _check_law(torch.tensor(res.sequences), _exact_laws(target, prompt, params))


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_ar_sampling_follows_the_target(tiny_vocab_targets, kind):
    target, model = tiny_vocab_targets[kind]
    params = SamplingParams(0.8, top_k=6, top_p=0.95)
    prompt = [1, 2, 3, 4]
    out = generate_ar(
        model, [prompt] * 3000, 3, temperature=0.8, top_k=6, top_p=0.95, generator=torch.Generator().manual_seed(7)
    )
    _check_law(torch.tensor(out), _exact_laws(target, prompt, params))
