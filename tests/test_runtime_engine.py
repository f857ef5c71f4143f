"""The runtime's decoding loops at T=0 (dflash2.runtime.engine): lossless, batched, ragged.

For random Qwen3, Llama and Qwen3.5-hybrid targets (fp32, CPU) the runtime's AR decode
and its speculative decode with random drafters (v1 at B=4, DFlash2 with a non-trivial
conv and selector at B=8 and 16) must emit exactly HF's greedy tokens, at batch 1 and
for a ragged batch of 4 prompts of different lengths, with a token budget that is not
a multiple of B. Scripted drafters force what random drafters rarely do: an oracle
(every draft accepted, τ = B), a wrong one (none) and partial ones (a random count per
step), all in one batch where every row advances by its own count in the same step;
EOS inside an accepted block; budgets that cut a block.
"""

import random
from types import SimpleNamespace

import pytest
import torch
from conftest import RUNTIME_KINDS, nontrivial_dflash2, spec_drafter

from dflash2.decoding import greedy_generate
from dflash2.errors import DFlash2Error
from dflash2.runtime import load_model
from dflash2.runtime.drafter import RuntimeDrafter
from dflash2.runtime.engine import generate_ar, generate_spec
from dflash2.runtime.sampling import Proposal

TAPS = [0, 1]
N_NEW = 45  # not a multiple of 4, 8 or 16: the last step is cut by the budget


def _prompt(length, seed):
    return torch.randint(0, 100, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = [_prompt(7, 1), _prompt(12, 2), _prompt(3, 3), _prompt(9, 4)]  # ragged


@pytest.fixture(scope="module")
def runtimes(hf_targets):
    """{kind: (reference TargetModel, runtime model, [prompt + HF greedy continuation of N_NEW + 32])}."""
    from dflash2.target import TargetModel

    out = {}
    for kind in RUNTIME_KINDS:
        hf, folder = hf_targets[kind]
        target = TargetModel(hf, target_layer_ids=TAPS)
        gen = greedy_generate(target, PROMPTS, N_NEW + 32)
        out[kind] = (target, load_model(folder, target_layer_ids=TAPS), [p + g for p, g in zip(PROMPTS, gen)])
    return out


def _expected(full, prompts, n, eos=None):
    out = [f[len(p) :][:n] for f, p in zip(full, prompts)]
    return [e[: e.index(eos) + 1] if eos in e else e for e in out]


def _check_steps(res, block_size):
    """Every step emits accepted + 1 tokens except a last one cut by EOS / the budget, and the
    emitted counts add up to the output (after the prefill's token)."""
    for acc, emitted, seq in zip(res.accepted_drafts, res.emitted, res.sequences):
        assert all(0 <= a < block_size for a in acc)
        assert emitted[:-1] == [a + 1 for a in acc[:-1]]
        assert not acc or (1 <= emitted[-1] <= acc[-1] + 1 and len(seq) == 1 + sum(emitted))


class ScriptedProposer:
    """The runtime drafter interface, drafting from a known continuation (no model).

    mode per row: 'oracle' drafts the greedy continuation (all accepted), 'wrong' a different
    token everywhere (none accepted), 'partial' is right for none, all or a random
    0..B-1 positions. It checks
    the engine's bookkeeping on the way: the anchor is the true token at the row's context length.
    """

    def __init__(self, full, modes, block_size, vocab, seed=0):
        self.full, self.modes, self.block_size, self.vocab = full, modes, block_size, vocab
        self.rng = random.Random(seed)

    def new_context(self, batch_size, max_len):
        return SimpleNamespace(taps=None, lengths=torch.zeros(batch_size, dtype=torch.long))

    def write_context(self, ctx, taps):  # no K/V: the script needs only the lengths
        pass

    def append(self, ctx, taps, n):
        ctx.lengths += n

    def propose(self, ctx, anchor, params, generator=None, *, kv_len=None, argmax_drafts=False):
        rows = []
        for r, (a, pos) in enumerate(zip(anchor.tolist(), ctx.lengths.tolist())):
            assert a == self.full[r][pos], f"row {r}: anchor {a} is not the token at position {pos}"
            truth = self.full[r][pos + 1 : pos + self.block_size]
            truth += [0] * (self.block_size - 1 - len(truth))  # past the reference: finished rows only
            # partial: none, all or a random count right, so short runs still see both extremes
            partial = self.rng.choice((0, self.block_size, self.rng.randrange(self.block_size)))
            right = {"oracle": self.block_size, "wrong": 0}.get(self.modes[r], partial)
            rows.append([t if i < right else (t + 1) % self.vocab for i, t in enumerate(truth)])
        return Proposal(torch.tensor(rows))


@pytest.mark.parametrize("kind", RUNTIME_KINDS)
def test_ar_decode_equals_hf_greedy(runtimes, kind):
    _, model, full = runtimes[kind]
    assert generate_ar(model, PROMPTS[:1], N_NEW) == _expected(full[:1], PROMPTS[:1], N_NEW)
    assert generate_ar(model, PROMPTS, N_NEW) == _expected(full, PROMPTS, N_NEW)


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("block_size", [4, 8, 16])
@pytest.mark.parametrize("kind", RUNTIME_KINDS)
def test_spec_with_random_drafters_equals_hf_greedy(runtimes, kind, block_size, batch):
    """v1 drafter at B=4, DFlash2 (conv + selector off their init) at 8 and 16."""
    target, model, full = runtimes[kind]
    v2 = block_size > 4
    drafter = spec_drafter(target, block_size, v2=v2, seed=2)
    drafter = nontrivial_dflash2(drafter) if v2 else drafter
    res = generate_spec(model, RuntimeDrafter(drafter, model), PROMPTS[:batch], N_NEW)
    assert res.sequences == _expected(full[:batch], PROMPTS[:batch], N_NEW)
    assert res.block_size == block_size
    _check_steps(res, block_size)


@pytest.mark.parametrize("block_size", [4, 8, 16])
@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_scripted_drafters_ragged_acceptance_in_one_batch(runtimes, kind, block_size):
    """Four rows accept different counts in the same steps: oracle (τ = B), partial ×2, wrong (τ = 1)."""
    _, model, full = runtimes[kind]
    modes = ["oracle", "partial", "wrong", "partial"]
    proposer = ScriptedProposer(full, modes, block_size, model.vocab_size)
    res = generate_spec(model, proposer, PROMPTS, N_NEW)
    assert res.sequences == _expected(full, PROMPTS, N_NEW)
    _check_steps(res, block_size)
    oracle, partial, wrong, partial2 = res.accepted_drafts
    assert oracle == [block_size - 1] * -(-(N_NEW - 1) // block_size)  # the prefill token + B per step
    assert wrong == [0] * (N_NEW - 1)
    assert {0, block_size - 1} <= set(partial + partial2)
    assert len(set(partial + partial2)) >= min(block_size, 4)


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_eos_inside_a_block_stops_that_row_only(runtimes, kind):
    """EOS = a greedy token of row 0 in the middle of a block the oracle gets fully accepted."""
    target, model, full = runtimes[kind]
    B = 8
    gen = full[0][len(PROMPTS[0]) :]
    k = max(k for k in range(2, N_NEW - 2) if gen[k] not in gen[:k] and k % B != 0)  # mid-block, first time
    eos = gen[k]
    expected = _expected(full, PROMPTS, N_NEW, eos)
    assert len(expected[0]) == k + 1
    assert generate_ar(model, PROMPTS, N_NEW, eos_token_id=eos) == expected
    proposer = ScriptedProposer(full, ["oracle", "partial", "oracle", "wrong"], B, model.vocab_size)
    res = generate_spec(model, proposer, PROMPTS, N_NEW, eos_token_id=[eos])
    assert res.sequences == expected
    assert res.accepted_drafts[0][-1] == B - 1 and res.steps[0] == -(-k // B)  # a full block, cut after EOS
    drafter = RuntimeDrafter(nontrivial_dflash2(spec_drafter(target, B, v2=True, seed=5)), model)
    assert generate_spec(model, drafter, PROMPTS, N_NEW, eos_token_id=eos).sequences == expected


def test_budget_cuts_and_first_token_eos(runtimes):
    _, model, full = runtimes["qwen3"]
    gen = full[0][len(PROMPTS[0]) :]
    for n in (0, 1, 2, 13):
        proposer = ScriptedProposer(full[:1], ["oracle"], 8, model.vocab_size)
        res = generate_spec(model, proposer, PROMPTS[:1], n)
        assert res.sequences == [gen[:n]] and generate_ar(model, PROMPTS[:1], n) == [gen[:n]]
        assert res.steps == [max(0, -(-(n - 1) // 8))]  # the first token comes from the prefill
    proposer = ScriptedProposer(full, ["oracle"] * 4, 8, model.vocab_size)
    first = generate_spec(model, proposer, PROMPTS, 20, eos_token_id=gen[0])
    assert first.sequences[0] == [gen[0]] and first.steps[0] == 0  # row 0 stops at its prefill token
    assert first.sequences[1:] == _expected(full[1:], PROMPTS[1:], 20, gen[0])


def test_tensor_prompts_and_bad_inputs(runtimes):
    target, model, full = runtimes["qwen3"]
    drafter = RuntimeDrafter(spec_drafter(target, 4), model)
    ids = torch.tensor([PROMPTS[0], PROMPTS[0]])  # (N, P) tensor
    res = generate_spec(model, drafter, ids, 5)
    assert res.sequences == [full[0][7:12]] * 2
    assert generate_spec(model, drafter.drafter, ids, 5).sequences == res.sequences  # a DFlashDrafter is wrapped
    with pytest.raises(DFlash2Error, match="empty"):
        generate_spec(model, drafter, [[1, 2], []], 5)
    with pytest.raises(DFlash2Error, match="no prompts"):
        generate_ar(model, [], 5)
    with pytest.raises(DFlash2Error, match="max_new_tokens"):
        generate_ar(model, ids, -1)
    with pytest.raises(DFlash2Error, match="temperature"):
        generate_spec(model, drafter, ids, 5, temperature=-1)


@pytest.mark.cuda
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_one_host_sync_per_step_on_the_gpu(runtimes, hf_targets, monkeypatch, temperature):
    """Between two reads of the loop's poll (poll.py: the prefill's pair, then each step's pair one step
    late), nothing may synchronise with the host: CUDA's sync debug mode raises on any synchronising call
    (item(), tolist(), nonzero, a copy into pageable memory, ...) while the steps are launched."""
    from dflash2.runtime.poll import LaggedPoll

    target, _, full = runtimes["qwen3_5"]
    model = load_model(hf_targets["qwen3_5"][1], device="cuda", target_layer_ids=TAPS)
    drafter = RuntimeDrafter(nontrivial_dflash2(spec_drafter(target, 8, v2=True, seed=2)).cuda(), model)
    reads, start, read = [], LaggedPoll.start, LaggedPoll._read

    def strict(fn):
        def wrapped(self, *args):
            torch.cuda.set_sync_debug_mode(0)  # the one read of a step
            out = fn(self, *args)
            reads.append(out)
            if out if isinstance(out, bool) else out[0]:  # a row is active: steps follow, none may sync
                torch.cuda.set_sync_debug_mode("error")
            return out

        return wrapped

    monkeypatch.setattr(LaggedPoll, "start", strict(start))
    monkeypatch.setattr(LaggedPoll, "_read", strict(read))
    try:
        res = generate_spec(model, drafter, PROMPTS, 30, temperature=temperature)
        spec_reads = len(reads)
        ar = generate_ar(model, PROMPTS, 30, temperature=temperature)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    # the prefill's pair, then one per step that had an active row (lag 1 on CUDA: the pair of the last of
    # them, read after one more step was launched, says that none is left); AR: 29 steps after the prefill
    assert spec_reads == 1 + max(res.steps) and len(reads) - spec_reads == 1 + 29
    if temperature == 0:
        assert res.sequences == ar == _expected(full, PROMPTS, 30)


def test_slot_keeps_phase_results_at_one_address():
    """Slot.keep: a T>0 phase's result (the warped p, the drafts' q) is copied into one buffer per
    name, so a captured consumer reads it at a fixed address whichever call produced it."""
    from dflash2.decoding.sampling import SamplingParams
    from dflash2.runtime.engine import Slot, _key

    s = Slot.__new__(Slot)
    s._kept = {}
    a, b = torch.rand(2, 3, 5), torch.rand(2, 3, 5)
    kept_a = s.keep("p", a)
    kept_b = s.keep("p", b)
    assert kept_a.data_ptr() == kept_b.data_ptr() and torch.equal(kept_b, b) and kept_b is not b
    assert s.keep("q_dense", None) is None
    other = s.keep("p", b[:, :1])  # another shape (e.g. a point-mass q): its own buffer, the first kept
    assert other.shape == (2, 1, 5) and other.data_ptr() != kept_a.data_ptr()
    assert s.keep("p", a).data_ptr() == kept_a.data_ptr() and torch.equal(kept_a, a)
    assert s.keep("p", b.double()).dtype == torch.float64
    # a graph bakes the sampling parameters in: they are part of the phase key
    assert _key(SamplingParams(0.0, 5, 0.5)) == _key(SamplingParams()) == ("greedy",)
    assert _key(SamplingParams(0.7, 5, 0.9)) != _key(SamplingParams(0.7, 5, 1.0))


def test_decode_loop_pauses_the_garbage_collector(runtimes):
    """With gc_pause the decode loop runs with the cyclic GC off (a collection longer than a step would idle
    the GPU) and restores it afterwards, even after an error; the default (off until measured) leaves it alone."""
    import gc

    from dflash2.runtime import Decoder
    from dflash2.runtime.engine import collector_paused

    _, model, full = runtimes["qwen3"]
    seen = []
    dec = Decoder(model, max_len=64, gc_pause=True)
    dec.on_step = lambda s: seen.append(gc.isenabled())
    assert gc.isenabled()
    assert dec.generate_ar(PROMPTS[:1], 4) == _expected(full[:1], PROMPTS[:1], 4)
    assert seen and not any(seen) and gc.isenabled()  # off in every step, back on after
    seen.clear()
    dec = Decoder(model, max_len=64)
    dec.on_step = lambda s: seen.append(gc.isenabled())
    dec.generate_ar(PROMPTS[:1], 4)
    assert seen and all(seen)
    with pytest.raises(RuntimeError), collector_paused():
        assert not gc.isenabled()
        raise RuntimeError("a failing step")
    assert gc.isenabled()
    gc.disable()  # a caller that keeps the collector off has it off after the loop too
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def in_a_collected_generation(objects) -> bool:
    """Whether any of `objects` sits in a generation the collector scans (frozen ones sit in none)."""
    import gc

    wanted = {id(o) for o in objects}
    return any(id(o) in wanted for o in gc.get_objects())


def test_heap_frozen_freezes_inside_and_keeps_a_callers_freeze():
    """From an unfrozen heap: frozen inside, thawed after. From a frozen one (a caller's freeze, or the
    interpreter's, as on the H200 image): what is new is frozen too, and nothing is thawed after."""
    import gc

    from dflash2.runtime.engine import heap_frozen

    base = gc.get_freeze_count()  # 0 on the CPU machines; an image may start with a frozen heap
    if base == 0:
        with heap_frozen() as frozen:
            assert frozen > 1000 and gc.get_freeze_count() > 1000  # (objects dying inside leave the count)
        assert gc.get_freeze_count() == 0
    with heap_frozen(False) as frozen:
        assert frozen == 0 and gc.get_freeze_count() == base
    made_before = [[i] for i in range(100)]  # tracked objects the earlier freeze holds
    if base == 0:
        gc.freeze()  # a heap frozen before: the block still freezes what is new, and thaws nothing after
    try:
        made_after = [[i] for i in range(2000)]  # new tracked objects the earlier freeze does not hold
        with heap_frozen() as frozen:
            assert frozen > 0  # (a count; frozen objects dying meanwhile leave it, so no exact figure)
            assert not in_a_collected_generation(made_after)
        # The earlier freeze and this block's both survive it. (The freeze count alone cannot say so:
        # frozen objects that other code lets die leave it, so it may end a little under its start.)
        assert not in_a_collected_generation(made_after)
        assert base != 0 or not in_a_collected_generation(made_before)
        del made_after
    finally:
        if base == 0:  # only what this test froze is thawed (a frozen heap it found stays as it was)
            gc.unfreeze()
