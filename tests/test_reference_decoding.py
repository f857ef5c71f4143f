"""Reference speculative decoding is lossless at T=0 (ARCHITECTURE.md §2.7, §4, §5).

Random fp32 targets (tiny Qwen3 = attention; tiny Qwen3.5 = 3 GDN : 1 attention)
and random drafters: the speculative output must equal plain greedy decoding of
the target token for token, for block sizes 4, 8 and 16, over >= 200 tokens.
Scripted drafters force the extreme steps: an oracle drafting the target's own
greedy continuation (every draft accepted, τ = B), a wrong one (nothing
accepted, τ = 1) and a partial one (a random number accepted each step).
The DFlash2 drafters get a non-trivial conv and selector (``nontrivial_dflash2``,
tests/conftest.py), and a test below checks that their drafts go through both.
"""

import copy
import random

import pytest
import torch
from conftest import nontrivial_dflash2

from dflash2.decoding import DFlashProposer, SamplingParams, SpecResult, greedy_generate, speculative_generate
from dflash2.errors import DFlash2Error

KINDS = ["qwen3", "qwen3_5"]
N_TOKENS = 200


def _prompt(length, seed):
    return torch.randint(0, 100, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = [_prompt(7, 1), _prompt(12, 2), _prompt(3, 3)]  # different lengths: ragged batches


@pytest.fixture(scope="module")
def greedy_refs(spec_targets):
    """{kind: [prompt + greedy continuation]} per prompt (N_TOKENS + 16 tokens; 48 for the third), once."""
    refs = {}
    for kind, target in spec_targets.items():
        outs = greedy_generate(target, PROMPTS[:2], N_TOKENS + 16) + greedy_generate(target, PROMPTS[2:], 48)
        refs[kind] = [p + o for p, o in zip(PROMPTS, outs)]
    return refs


class ScriptedProposer:
    """A drafter stub with the decoder's Proposer interface, drafting from a known continuation.

    mode per row: 'oracle' drafts the target's greedy continuation (all accepted), 'wrong'
    drafts a different token everywhere (none accepted), 'partial' is right for a random
    0..B-1 positions then wrong. It also checks the decoder's bookkeeping: the anchor it gets is
    the true token at the anchor position, and the drafter context covers exactly the
    positions before the anchor.
    """

    def __init__(self, full, modes, block_size, vocab, seed=0):
        self.full, self.modes, self.block_size, self.vocab = full, modes, block_size, vocab
        self.rng = random.Random(seed)
        self.context = [0] * len(full)

    def add_context(self, taps, positions, num_valid):
        for n, k in enumerate(num_valid.tolist()):
            if k:
                assert positions[n, 0] == self.context[n], "context appended at the wrong position"
            self.context[n] += k

    def propose(self, anchor_ids, anchor_pos, params, generator):
        rows = []
        for n, (a, pos) in enumerate(zip(anchor_ids.tolist(), anchor_pos.tolist())):
            assert a == self.full[n][pos], f"row {n}: anchor {a} is not the token at position {pos}"
            assert self.context[n] == pos, f"row {n}: drafter context has {self.context[n]} positions, anchor at {pos}"
            truth = self.full[n][pos + 1 : pos + self.block_size]
            right = {"oracle": self.block_size, "wrong": 0}.get(self.modes[n], self.rng.randrange(self.block_size))
            rows.append([t if i < right else (t + 1) % self.vocab for i, t in enumerate(truth)])
        return torch.tensor(rows), None


def _check_result(res: SpecResult, expected, block_size):
    assert res.sequences == expected
    for accepted, emitted, seq in zip(res.accepted_drafts, res.emitted, res.sequences):
        assert all(0 <= a < block_size for a in accepted)
        # every step emits its accepted drafts + 1, except that EOS / max_new_tokens may cut the last one
        assert emitted[:-1] == [a + 1 for a in accepted[:-1]]
        assert not emitted or 1 <= emitted[-1] <= accepted[-1] + 1
        assert len(seq) == 1 + sum(emitted)  # the prefill's token + what the verify steps emitted


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("block_size", [4, 8, 16])
def test_random_drafter_equals_greedy(spec_targets, make_spec_drafter, greedy_refs, kind, block_size):
    """Real DFlash drafters (v1 at B=4, DFlash2 with a non-trivial conv + selector at 8/16), random weights."""
    target = spec_targets[kind]
    drafter = make_spec_drafter(target, block_size, v2=block_size > 4)
    drafter = nontrivial_dflash2(drafter) if block_size > 4 else drafter
    # 200 tokens at B=8; 48 at B=4/16 keeps the suite fast (τ ≈ 1: a verify + a replay per token);
    # the scripted test below covers 200 tokens for every block size.
    n = N_TOKENS if block_size == 8 else 48
    res = speculative_generate(target, drafter, [PROMPTS[0]], max_new_tokens=n)
    _check_result(res, [greedy_refs[kind][0][len(PROMPTS[0]) :][:n]], block_size)
    assert 0 in res.accepted_drafts[0]  # a random drafter has rejected steps


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("block_size", [4, 8, 16])
def test_scripted_drafters_equal_greedy_with_all_or_partial_acceptance(spec_targets, greedy_refs, kind, block_size):
    """A batch of two rows with different acceptance: oracle (τ = B every step) and partial."""
    target = spec_targets[kind]
    full = greedy_refs[kind][:2]
    proposer = ScriptedProposer(full, ["oracle", "partial"], block_size, target.vocab_size)
    res = speculative_generate(target, proposer, PROMPTS[:2], max_new_tokens=N_TOKENS)
    _check_result(res, [f[len(p) :][:N_TOKENS] for f, p in zip(full, PROMPTS)], block_size)
    oracle, partial = res.accepted_drafts
    assert oracle == [block_size - 1] * len(oracle)  # every draft accepted: τ = B
    assert len(oracle) == -(-(N_TOKENS - 1) // block_size)  # the prefill token + B per step
    assert {0, block_size - 1} <= set(partial)  # zero-accept and all-accept steps in one run
    assert len(set(partial)) >= min(block_size, 4)


@pytest.mark.parametrize("kind", KINDS)
def test_wrong_drafter_accepts_nothing_in_a_ragged_batch(spec_targets, greedy_refs, kind):
    target = spec_targets[kind]
    full = greedy_refs[kind]
    proposer = ScriptedProposer(full, ["wrong", "oracle", "partial"], 4, target.vocab_size)
    res = speculative_generate(target, proposer, PROMPTS, max_new_tokens=33)
    _check_result(res, [f[len(p) :][:33] for f, p in zip(full, PROMPTS)], 4)
    assert res.accepted_drafts[0] == [0] * 32  # τ = 1: the bonus (the target's own token) every step
    assert res.accepted_drafts[1] == [3] * 8  # τ = B = 4
    assert 0 < len(res.accepted_drafts[2]) < 32


@pytest.mark.parametrize("kind", KINDS)
def test_eos_inside_a_block_stops_there(spec_targets, greedy_refs, kind):
    """The oracle accepts whole blocks; EOS = a greedy token in the middle of one: emit it, nothing after."""
    target, B = spec_targets[kind], 8
    gen = greedy_refs[kind][0][len(PROMPTS[0]) :]
    # a token at its first occurrence, not the last of its block (so the block is cut after it)
    k = max(k for k in range(2, 100) if gen[k] not in gen[:k] and k % B != 0)
    eos = gen[k]
    assert greedy_generate(target, PROMPTS[:1], N_TOKENS, eos_token_id=eos) == [gen[: k + 1]]
    # greedy with EOS = greedy without, cut after the first EOS
    n = k + 3 * B  # room after the EOS: it, not max_new_tokens, ends row 0
    expected = [f[len(p) :][:n] for f, p in zip(greedy_refs[kind][:2], PROMPTS)]
    expected = [e[: e.index(eos) + 1] if eos in e else e for e in expected]
    proposer = ScriptedProposer(greedy_refs[kind][:2], ["oracle", "partial"], B, target.vocab_size)
    res = speculative_generate(target, proposer, PROMPTS[:2], max_new_tokens=n, eos_token_id=[eos])
    assert res.sequences == expected
    assert res.accepted_drafts[0][-1] == B - 1  # the block was fully accepted, then cut after EOS
    assert res.emitted[0][-1] == k - B * (res.steps[0] - 1) < B  # ... so the step emitted less than B
    assert res.steps[0] == -(-k // B)


def test_max_new_tokens_truncates_exactly(spec_targets, greedy_refs):
    target = spec_targets["qwen3"]
    gen = greedy_refs["qwen3"][0][len(PROMPTS[0]) :]
    for n in (0, 1, 2, 13):
        proposer = ScriptedProposer(greedy_refs["qwen3"][:1], ["oracle"], 8, target.vocab_size)
        res = speculative_generate(target, proposer, [PROMPTS[0]], max_new_tokens=n)
        assert res.sequences == [gen[:n]]
        assert res.steps == [max(0, -(-(n - 1) // 8))]  # the first token comes from the prefill
    proposer = ScriptedProposer(greedy_refs["qwen3"][:1], ["oracle"], 8, target.vocab_size)
    first_is_eos = speculative_generate(target, proposer, [PROMPTS[0]], max_new_tokens=50, eos_token_id=gen[0])
    assert first_is_eos.sequences == [[gen[0]]] and first_is_eos.steps == [0]


# An oracle's every step could emit B tokens; a last step cut by max_new_tokens or EOS must count only
# what it emitted (counting accepted + 1, as before, claims τ = B in both tests), the prefill's token not at all.
@pytest.mark.parametrize("kind", KINDS)
def test_tau_does_not_count_tokens_cut_by_max_new_tokens(spec_targets, greedy_refs, kind):
    target, B = spec_targets[kind], 8
    full = greedy_refs[kind][:1]
    gen = full[0][len(PROMPTS[0]) :]
    # 13, not a multiple of B: the prefill's token, a full step of 8, a last step cut to 4
    proposer = ScriptedProposer(full, ["oracle"], B, target.vocab_size)
    res = speculative_generate(target, proposer, [PROMPTS[0]], max_new_tokens=13)
    assert res.sequences == [gen[:13]]
    assert res.accepted_drafts == [[B - 1, B - 1]] and res.emitted == [[B, 4]]
    assert res.mean_tau == (13 - 1) / 2 == 6.0


def test_tau_does_not_count_tokens_cut_by_eos(spec_targets, greedy_refs):
    target, B = spec_targets["qwen3_5"], 8  # its greedy output is diverse: an EOS can sit deep in a block
    full = greedy_refs["qwen3_5"][:1]
    gen = full[0][len(PROMPTS[0]) :]
    # EOS = gen[k] at its first occurrence, inside a block after the first: full steps of B, then a
    # last step cut right after the EOS
    k = max(k for k in range(B + 1, 100) if gen[k] not in gen[:k] and k % B not in (0, 1))
    steps = -(-k // B)
    proposer = ScriptedProposer(full, ["oracle"], B, target.vocab_size)
    res = speculative_generate(target, proposer, [PROMPTS[0]], max_new_tokens=k + 2 * B, eos_token_id=gen[k])
    assert res.sequences == [gen[: k + 1]]
    assert res.accepted_drafts == [[B - 1] * steps]
    assert res.emitted == [[B] * (steps - 1) + [k - B * (steps - 1)]]
    assert steps >= 2 and res.mean_tau == k / steps < B


@pytest.mark.parametrize(
    "kind,v2,block_size", [("qwen3_5", False, 4), ("qwen3_5", True, 8), ("qwen3", True, 8)], ids=str
)
def test_random_drafter_batch_equals_greedy(spec_targets, make_spec_drafter, greedy_refs, kind, v2, block_size):
    """Batched DFlash / DFlash2 drafting with ragged per-row context (prompts of 7, 12 and 3 tokens)."""
    target = spec_targets[kind]
    drafter = make_spec_drafter(target, block_size, v2=v2)
    res = speculative_generate(target, nontrivial_dflash2(drafter) if v2 else drafter, PROMPTS, max_new_tokens=24)
    _check_result(res, [f[len(p) :][:24] for f, p in zip(greedy_refs[kind], PROMPTS)], block_size)
    assert res.mean_tau >= 1.0


def _first_blocks(target, drafter, prompts):
    """What the decoder's proposer drafts for the first block after each prompt (all of one length),
    beside the drafter's own unary logits there: (drafts (N, B-1), logits (N, B-1, V))."""
    ids = torch.tensor(prompts)  # (N, P)
    N, P = ids.shape
    out = target(ids)
    proposer = DFlashProposer(drafter, target)
    proposer.add_context(out.taps, torch.arange(P).expand(N, -1), torch.full((N,), P))
    anchor, anchor_pos = out.logits[:, -1].argmax(-1), torch.full((N,), P)
    drafts, q = proposer.propose(anchor, anchor_pos, SamplingParams(), None)
    assert q is None  # T=0: deterministic drafts
    B = drafter.config.block_size
    block = torch.full((N, B), drafter.config.mask_token_id)
    block[:, 0] = anchor
    with torch.no_grad():
        hidden = drafter.draft_block(target.embed_tokens(block), anchor_pos[:, None] + torch.arange(B), proposer.cache)
        logits = target.lm_head(hidden[:, 1:]).float()  # (N, B-1, V)
    return drafts, logits


@pytest.mark.parametrize("kind", KINDS)
def test_the_dflash2_drafter_drafts_through_its_conv_and_selector(spec_targets, make_spec_drafter, kind):
    """The DFlash2 drafter of these tests (``nontrivial_dflash2``) is not at its init (identity conv, ~0 pair
    term, where it drafts exactly what v1 drafts): the decoder's drafts differ from plain argmax of the
    unary logits (so a path that skipped the selector would draft differently), and the conv changes the
    logits and the drafts (vs the same weights with the conv reset to the identity)."""
    target = spec_targets[kind]
    drafter = nontrivial_dflash2(make_spec_drafter(target, 8, v2=True))
    prompts = [_prompt(10, seed) for seed in range(16)]
    drafts, logits = _first_blocks(target, drafter, prompts)
    selector_changes = (drafts != logits.argmax(-1)).float().mean()
    assert 0.1 < selector_changes < 0.9, selector_changes  # the pair term matters, and so do the unary logits

    identity_conv = copy.deepcopy(drafter)
    for layer in identity_conv.layers:
        layer.attention_conv.reset_parameters()
        layer.mlp_conv.reset_parameters()
    drafts_id, logits_id = _first_blocks(target, identity_conv, prompts)
    assert (logits_id - logits).abs().max() > 0.1 * logits.std()  # a change on the logits' own scale
    assert (drafts_id != drafts).float().mean() > 0.1


def test_tensor_prompts_and_bad_inputs(spec_targets, make_spec_drafter):
    target = spec_targets["qwen3"]
    drafter = make_spec_drafter(target, 4)
    ids = torch.tensor([PROMPTS[0], PROMPTS[0]])  # (N, P) tensor
    res = speculative_generate(target, drafter, ids, max_new_tokens=5)
    assert res.sequences[0] == res.sequences[1] == greedy_generate(target, ids[:1], 5)[0]
    with pytest.raises(DFlash2Error, match="empty"):
        speculative_generate(target, drafter, [[1, 2], []], max_new_tokens=5)
    with pytest.raises(DFlash2Error, match="temperature"):
        speculative_generate(target, drafter, ids, max_new_tokens=5, temperature=-1)
    other = make_spec_drafter(spec_targets["qwen3_5"], 4)
    other.config.target_layer_ids = [0, 3]  # a drafter reading other target layers
    with pytest.raises(DFlash2Error, match="target layers"):
        speculative_generate(spec_targets["qwen3_5"], other, ids, max_new_tokens=5)
