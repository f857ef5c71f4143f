"""DFlash2 candidate selector (ARCHITECTURE.md §3.2): paths vs brute force, sampled q, trainable loss."""

import itertools

import pytest
import torch

from dflash2.drafter import CandidateSelector
from dflash2.drafter.selector import scale_logits

V, D = 64, 32


def make(k=3, rank=8, seed=0, scale=1.0):
    torch.manual_seed(seed)
    sel = CandidateSelector(V, D, rank, k)
    with torch.no_grad():  # strong pair term so paths differ from per-position argmax
        for p in sel.parameters():
            p.normal_(std=scale)
    return sel


def toy(N=4, P=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, P, D, generator=g), torch.randn(N, P, V, generator=g), torch.randint(0, V, (N,), generator=g)


def edge(sel, hidden, logits, n, pos, pred, cand):
    """score(pos, pred -> cand) written out from the formula."""
    hh = sel.hidden_projection.weight @ hidden[n, pos]
    return logits[n, pos, cand] + (sel.predecessor_codebook[pred] * hh * sel.successor_codebook[cand]).sum()


def test_edge_scores_formula_and_shapes():
    sel = make()
    hidden, logits, _ = toy()
    cand, unary = sel.candidates(logits)
    assert cand.shape == unary.shape == (4, 3, 3)
    assert torch.equal(unary, logits.gather(-1, cand))
    pred = torch.randint(0, V, (4, 3))
    s = sel.edge_scores(hidden, pred, cand, unary)
    s_m = sel.edge_scores(hidden, torch.stack([pred, pred], -1), cand, unary)
    assert s.shape == (4, 3, 3) and s_m.shape == (4, 3, 2, 3)
    torch.testing.assert_close(s_m[:, :, 1], s)
    with torch.no_grad():
        torch.testing.assert_close(s[2, 1, 0], edge(sel, hidden, logits, 2, 1, pred[2, 1], cand[2, 1, 0]))


@torch.no_grad()
def test_greedy_matches_stepwise_bruteforce():
    sel = make(k=4)
    hidden, logits, anchor = toy(P=5)
    path = sel.greedy_path(hidden, logits, anchor)
    cand, _ = sel.candidates(logits)
    for n in range(4):
        pred = anchor[n]
        for pos in range(5):
            scores = torch.stack([edge(sel, hidden, logits, n, pos, pred, c) for c in cand[n, pos]])
            pred = cand[n, pos, scores.argmax()]
            assert path[n, pos] == pred


@torch.no_grad()
def test_greedy_is_argmax_with_zero_pair_term():
    sel = make()
    with torch.no_grad():
        sel.hidden_projection.weight.zero_()
    hidden, logits, anchor = toy()
    assert torch.equal(sel.greedy_path(hidden, logits, anchor), logits.argmax(-1))


@torch.no_grad()
def test_viterbi_matches_bruteforce_over_all_paths():
    sel = make(k=3)
    hidden, logits, anchor = toy(P=3)
    path = sel.viterbi_path(hidden, logits, anchor)
    cand, _ = sel.candidates(logits)
    for n in range(4):
        best, best_path = -float("inf"), None
        for combo in itertools.product(range(3), repeat=3):
            toks = [cand[n, pos, c] for pos, c in enumerate(combo)]
            preds = [anchor[n], *toks[:-1]]
            tot = sum(float(edge(sel, hidden, logits, n, pos, preds[pos], toks[pos])) for pos in range(3))
            if tot > best:
                best, best_path = tot, toks
        assert path[n].tolist() == [int(t) for t in best_path]
        # greedy's path can never beat the exact optimum
        g = sel.greedy_path(hidden, logits, anchor)[n]
        g_preds = [anchor[n], *g[:-1]]
        g_tot = sum(float(edge(sel, hidden, logits, n, pos, g_preds[pos], g[pos])) for pos in range(3))
        assert g_tot <= best + 1e-5


@torch.no_grad()
def test_sample_path_q_is_the_sampling_distribution():
    sel = make(k=4, scale=0.5)
    hidden, logits, anchor = toy(N=1, P=3)
    gen = torch.Generator().manual_seed(0)
    toks, q = sel.sample_path(hidden, logits, anchor, 0.8, generator=gen)
    cand, _ = sel.candidates(logits)
    assert toks.shape == (1, 3) and q.shape == (1, 3, V)
    torch.testing.assert_close(q.sum(-1), torch.ones(1, 3))
    support = torch.zeros(1, 3, V, dtype=torch.bool).scatter_(-1, cand, True)
    assert (q[~support] == 0).all() and (q.gather(-1, toks[..., None]) > 0).all()
    # first position: q does not depend on the sample; compare empirical frequencies
    n = 4000
    rep = lambda t: t.expand(n, *t.shape[1:])
    toks_n, q_n = sel.sample_path(rep(hidden), rep(logits), rep(anchor), 0.8, generator=gen)
    freq = torch.bincount(toks_n[:, 0], minlength=V).float() / n
    assert (freq - q_n[0, 0]).abs().max() < 0.03
    # later positions: q is the conditional given the sampled predecessor
    for i in range(3):
        pred = toks_n[i, 0]
        hh = sel.hidden_projection(hidden[0, 1])
        s = logits[0, 1, cand[0, 1]] + (sel.predecessor_codebook[pred] * hh * sel.successor_codebook[cand[0, 1]]).sum(
            -1
        )
        torch.testing.assert_close(q_n[i, 1, cand[0, 1]], torch.softmax(s / 0.8, -1))


def test_loss_finite_and_decreases():
    torch.manual_seed(0)
    sel = CandidateSelector(V, D, rank=8, top_k=6)
    hidden, logits, anchor = toy(N=8, P=4, seed=3)
    cand, _ = sel.candidates(logits)
    # labels: a random candidate (not always the top-1) so the selector has work to do
    labels = cand.gather(-1, torch.randint(0, 6, (8, 4, 1)))[..., 0]
    labels[0, 0] = (cand[0, 0] + 1 + torch.arange(6)).remainder(V)[0]  # maybe outside top-k
    mask = torch.ones(8, 4, dtype=torch.bool)
    mask[1, 3] = False
    hidden.requires_grad_(True)
    logits.requires_grad_(True)
    # sign-SGD (= Adam's step size behaviour, as in training): the trilinear pair term
    # starts near a saddle (all three factors ~0.02) where plain SGD barely moves.
    # (Manual, because building a torch.optim optimizer costs seconds on first use.)
    losses = []
    for _ in range(20):
        loss, stats = sel.loss(hidden, logits, anchor, labels, mask)
        assert torch.isfinite(loss)
        sel.zero_grad()
        loss.backward()
        with torch.no_grad():
            for p in sel.parameters():
                p -= 3e-2 * p.grad.sign()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses
    assert hidden.grad is None and logits.grad is None, "selector loss must not reach the drafter"
    assert 0.9 < float(stats["coverage"]) <= 1.0
    assert float(stats["acc"]) >= float(stats["top1"])
    # and with detach_hidden=False the backbone does receive gradient
    loss, _ = sel.loss(hidden, logits, anchor, labels, mask, detach_hidden=False)
    loss.backward()
    assert hidden.grad is not None and logits.grad is None


# ------------------------------------------------------------------ training options (issue 12 item 5)
def _outside_top_k_case(k=3, P=4, N=6, softcap=None):
    """A selector with a strong pair term and labels: position (0, 1) and (2, 3) outside the top-k."""
    sel = make(k=k, rank=8, scale=0.5)
    sel.final_logit_softcapping = softcap
    hidden, logits, anchor = toy(N=N, P=P, seed=5)
    cand, _ = sel.candidates(logits)
    labels = cand[..., 1].clone()  # inside the top-k: the second candidate
    # Outside: tokens that are no candidate at any position (so only injection can make them one).
    absent = [t for t in range(V) if not (cand == t).any()]
    labels[0, 1], labels[2, 3] = absent[0], absent[1]
    mask = torch.ones(N, P, dtype=torch.bool)
    mask[4, 3] = False  # the last slot: in training a masked label has only masked ones after it
    return sel, hidden, logits, anchor, labels, mask


@pytest.mark.parametrize("softcap", [None, 1.5])
def test_gold_injection_adds_the_label_as_a_candidate_where_it_is_outside_the_top_k(softcap):
    sel, hidden, logits, anchor, labels, mask = _outside_top_k_case(softcap=softcap)
    dropped, stats = sel.loss(hidden, logits, anchor, labels, mask)
    injected, stats_inj = sel.loss(hidden, logits, anchor, labels, mask, inject_gold=True)
    cand, _ = sel.candidates(logits)
    with torch.no_grad():
        ces = {}
        for n in range(6):
            for pos in range(4):
                if not mask[n, pos]:
                    continue
                pred = anchor[n] if pos == 0 else labels[n, pos - 1]
                options = cand[n, pos].tolist()
                if labels[n, pos] not in options:
                    options.append(int(labels[n, pos]))  # the injected gold candidate
                # the injected label's unary is scaled like the top-k ones (softcap, ARCHITECTURE.md §3.4)
                served = scale_logits(logits, 1.0, softcap)
                scores = torch.stack([edge(sel, hidden, served, n, pos, pred, c) for c in options])
                ces[(n, pos)] = -torch.log_softmax(scores, 0)[options.index(int(labels[n, pos]))]
        outside = {(0, 1), (2, 3)}
        expected_dropped = torch.stack([v for key, v in ces.items() if key not in outside]).mean()
        expected_injected = torch.stack(list(ces.values())).mean()
    torch.testing.assert_close(dropped, expected_dropped)
    torch.testing.assert_close(injected, expected_injected)
    assert injected > dropped  # the two outside labels are hard: they add loss instead of vanishing
    assert all(torch.equal(stats[k], stats_inj[k]) for k in stats)  # the same metrics either way
    # Only with injection does the outside label's successor row learn (it is a candidate nowhere else).
    for inject in (False, True):
        sel.zero_grad()
        sel.loss(hidden, logits, anchor, labels, mask, inject_gold=inject)[0].backward()
        grad = sel.successor_codebook.grad[labels[0, 1]].abs().sum()
        assert (grad > 0) == inject


def test_gold_injection_changes_nothing_when_every_label_is_a_candidate():
    sel, hidden, logits, anchor, labels, mask = _outside_top_k_case()
    mask[0, 1] = mask[2, 3] = False  # drop the two outside labels
    a, _ = sel.loss(hidden, logits, anchor, labels, mask)
    b, _ = sel.loss(hidden, logits, anchor, labels, mask, inject_gold=True)
    assert torch.equal(a, b)


def test_zero_successor_init_makes_the_selector_exactly_argmax_and_still_trainable():
    sel = make(k=4, scale=1.0)  # a pair term large enough to reorder candidates ...
    hidden, logits, anchor = toy(N=8, P=5, seed=2)
    assert not torch.equal(sel.greedy_path(hidden, logits, anchor), logits.argmax(-1))
    sel.zero_successor_()  # ... and gone
    cand, unary = sel.candidates(logits)
    pred = torch.randint(0, V, (8, 5))
    assert torch.equal(sel.edge_scores(hidden, pred, cand, unary), unary.float())
    assert torch.equal(sel.greedy_path(hidden, logits, anchor), logits.argmax(-1))
    labels = cand[..., 2]
    loss, _ = sel.loss(hidden, logits, anchor, labels, torch.ones(8, 5, dtype=torch.bool))
    loss.backward()
    assert sel.successor_codebook.grad.abs().sum() > 0  # the codebook moves at the first step
    assert sel.predecessor_codebook.grad.abs().sum() == 0  # the others follow once it has


def test_fresh_dflash2_with_zero_successor_init_drafts_exactly_what_argmax_drafts(make_spec_target):
    from omegaconf import OmegaConf

    from dflash2.decoding import speculative_generate
    from dflash2.drafter.from_target import drafter_config_for_target
    from dflash2.training.train_drafter import fresh_drafter

    target = make_spec_target("qwen3_5")
    from conftest import REPO

    settings = OmegaConf.to_container(OmegaConf.load(REPO / "configs" / "drafter" / "dflash.yaml"))
    settings.update(use_local_conv=True, use_selector=True, num_hidden_layers=1, selector_rank=8, selector_top_k=4)
    settings.update(conv_group_size=8, mask_token_id=target.vocab_size - 1)
    config = drafter_config_for_target(settings, target)
    normal = fresh_drafter(config, settings, seed=3).eval()
    zeroed = fresh_drafter(config, {**settings, "selector_zero_successor_init": True}, seed=3).eval()
    assert torch.equal(
        zeroed.candidate_selector.successor_codebook, torch.zeros_like(normal.candidate_selector.successor_codebook)
    )
    assert normal.candidate_selector.successor_codebook.abs().sum() > 0  # the option, not the seed, zeroes it
    argmax = fresh_drafter(config, settings, seed=3).eval()
    argmax.candidate_selector = None  # plain per-position argmax of the same weights
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    a = speculative_generate(target, zeroed, prompts, max_new_tokens=24)
    b = speculative_generate(target, argmax, prompts, max_new_tokens=24)
    assert a.sequences == b.sequences and a.accepted == b.accepted
    # and every block's drafts, not only the accepted prefix: the selector path is the argmax
    hidden = torch.randn(3, config.block_size, config.hidden_size)
    anchor = torch.tensor([1, 2, 3])
    assert torch.equal(
        zeroed.drafted_tokens(hidden, target.lm_head, anchor), argmax.drafted_tokens(hidden, target.lm_head, anchor)
    )


def test_the_training_module_passes_gold_injection_to_the_selector(make_spec_target, make_spec_drafter):
    from dflash2.drafter.objective import anchor_generator
    from dflash2.training.drafter_module import DrafterTrainingModule

    target = make_spec_target("qwen3")
    drafter = make_spec_drafter(target, 4, v2=True)
    kw = dict(num_anchors=4, loss_gamma=4.0, selector_loss_weight=1.0, lr=1e-3, weight_decay=0.0)
    kw.update(warmup_ratio=0.0, total_steps=1, seed=0)
    ids = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "loss_mask": (torch.arange(24) >= 8).long().expand(2, 24)}
    outs = {
        inject: DrafterTrainingModule(drafter, target, selector_gold_injection=inject, **kw).block_outputs(
            batch, anchor_generator(0, 0)
        )
        for inject in (False, True)
    }
    assert float(outs[True]["selector_stats"]["coverage"]) < 1.0  # random drafter: some labels outside
    assert outs[True]["selector_loss"] > outs[False]["selector_loss"]
    assert torch.equal(outs[True]["ce"], outs[False]["ce"])  # the drafter's own loss is untouched
