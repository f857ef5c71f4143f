"""The runtime's engine with the Triton GDN modes (ReplaySSM and native rollback) on a hybrid target.

Speculative decoding of the random Qwen3.5 hybrid (3 GDN : 1 attention, 2 key heads for 4
value heads) with ``gdn_mode="replay"`` and ``"native"`` must emit HF's greedy tokens
token for token: a scripted row that accepts every draft (each step commits B tokens)
beside one that accepts a random count, none included (that step commits exactly the
one corrected token), with ragged prompts; and a random DFlash2 drafter. A higher τ with
different text would be a state bug, not a win. The interpreted kernels make these slow,
so budgets are short; the ``cuda`` test runs 300 tokens. (Kernel-level checks:
test_runtime_gdn_kernels.py.) Also: the default ``gdn_mode="auto"`` picks ReplaySSM for CUDA
states and the plain-PyTorch reference on the CPU, and an unknown mode fails at load.
"""

import pytest
import torch
from conftest import nontrivial_dflash2, spec_drafter
from test_runtime_engine import PROMPTS, ScriptedProposer

from dflash2.decoding import greedy_generate
from dflash2.runtime import load_model
from dflash2.runtime.drafter import RuntimeDrafter
from dflash2.runtime.engine import Decoder, generate_ar, generate_spec
from dflash2.runtime.gdn_state import GDNState, resolve_gdn_mode
from dflash2.runtime.kernels.triton_util import interpreting
from dflash2.runtime.models import from_hf_model
from dflash2.target import TargetModel

TAPS = [0, 1]
N_NEW = 13  # interpreted kernels are slow: a few steps, the last one cut by the budget
B = 4
CPU = pytest.param("cpu", marks=pytest.mark.skipif(not interpreting(), reason="CPU tensors need TRITON_INTERPRET=1"))
DEVICES = [CPU, pytest.param("cuda", marks=pytest.mark.cuda)]


@pytest.fixture(scope="module")
def hybrid(hf_targets):
    """(reference TargetModel, HF folder, prompts, prompt + HF greedy continuation per prompt)."""
    hf, folder = hf_targets["qwen3_5"]
    target = TargetModel(hf, target_layer_ids=TAPS)
    prompts = PROMPTS[:3]  # lengths 7, 12, 3
    gen = greedy_generate(target, prompts, N_NEW + B)
    return target, folder, prompts, [p + g for p, g in zip(prompts, gen)]


@pytest.fixture(scope="module")
def scripted(hybrid):
    """scripted(mode, defer=True) -> (result, GDN state of the slot, its pending fold after each step): an
    oracle row (B tokens per step) beside a ragged one (0..B-1 drafts accepted) through a Decoder with the
    slot's deferral as given (on: what generate_spec runs). Each (mode, defer) generates once per module:
    interpreted, a generation takes ~10 s, and ReplaySSM's deferred one serves two tests below."""
    _, folder, prompts, full = hybrid
    runs = {}

    def run(mode: str, defer: bool = True):
        if (mode, defer) not in runs:
            model = load_model(folder, target_layer_ids=TAPS, gdn_mode=mode)
            assert model.new_state(1, 8).gdn.mode == mode
            proposer = ScriptedProposer(full[:2], ["oracle", "partial"], B, model.vocab_size)  # same draws each run
            dec = Decoder(model, proposer, max_len=64, graphs=False)
            gdn = dec.slot(2).state.gdn
            gdn.defer = defer
            pending = []
            dec.on_step = lambda s: pending.append(s.state.gdn._deferred)
            runs[mode, defer] = (dec.generate_spec(prompts[:2], N_NEW), gdn, pending)
        return runs[mode, defer]

    return run


def _greedy(full, prompts, n=N_NEW):
    return [f[len(p) :][:n] for f, p in zip(full, prompts)]


def test_auto_is_the_default_and_follows_the_state_device(hf_targets):
    """'auto' stays on the model and is resolved per state: the CPU gets the plain loop (the kernels
    would run interpreted there), CUDA gets ReplaySSM; explicit modes win over it."""
    hf, folder = hf_targets["qwen3_5"]
    for model in (load_model(folder), from_hf_model(hf)):
        assert model.gdn_mode == "auto"
        assert model.new_state(1, 8).gdn.mode == "reference"  # CPU, even with TRITON_INTERPRET=1
        assert model.new_state(1, 8, gdn_mode="native").gdn.mode == "native"
    assert load_model(folder, gdn_mode="replay").new_state(1, 8).gdn.mode == "replay"
    assert resolve_gdn_mode("auto", "cuda") == "replay" and resolve_gdn_mode("auto", "cpu") == "reference"
    assert resolve_gdn_mode("native", "cpu") == "native"


def test_unknown_mode_is_refused_where_it_is_written(hf_targets):
    hf, folder = hf_targets["qwen3_5"]
    for make in (lambda: load_model(folder, gdn_mode="fast"), lambda: from_hf_model(hf, gdn_mode="fast")):
        with pytest.raises(ValueError, match=r"'fast'.*'auto', 'reference', 'replay', 'native'"):
            make()
    dims = dict(conv_dim=8, conv_kernel=4, num_k_heads=1, num_v_heads=1, head_k_dim=2, head_v_dim=2)
    with pytest.raises(ValueError, match="GDN mode 'Replay'"):
        GDNState(1, 1, dtype=torch.float32, device="cpu", mode="Replay", **dims)


@pytest.mark.cuda
def test_auto_runs_replayssm_on_the_gpu(hf_targets):
    _, folder = hf_targets["qwen3_5"]
    assert load_model(folder, device="cuda").new_state(1, 8).gdn.mode == "replay"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["replay", "native"])
def test_scripted_acceptance_equals_greedy(hybrid, scripted, mode):
    """An oracle row (every draft accepted: B tokens per step) beside a row accepting a random
    0..B-1 per step (0: the one corrected token), in the same steps."""
    _, _, prompts, full = hybrid
    res, _, _ = scripted(mode)
    assert res.sequences == _greedy(full[:2], prompts[:2])
    oracle, partial = res.accepted_drafts
    assert oracle == [B - 1] * -(-(N_NEW - 1) // B)  # full acceptance commits B per step
    assert {0, B - 1} <= set(partial)  # zero accepted (commits exactly 1) and full, in the ragged row
    for acc, emitted in zip(res.accepted_drafts, res.emitted):  # accepted + 1 per step but a budget-cut last
        assert emitted[:-1] == [a + 1 for a in acc[:-1]]


@pytest.mark.slow
def test_deferred_commit_in_the_engine_equals_greedy_and_the_eager_fold(hybrid, scripted):
    """ReplaySSM in the engine: the slot's reserved logs make every decode commit deferred into the next
    verify. An oracle row (B tokens per step) beside a ragged one (0..B-1 drafts accepted), the oracle
    finishing first (its later commits are 0): the tokens are HF's greedy tokens, the commits were
    deferred (seen after every step), nothing is pending once generate_spec returns, and the final GDN
    states equal bit for bit those of the same run with deferral off (the commit kernel folding at once)."""
    _, _, prompts, full = hybrid
    states, pending = {}, {}
    for defer in (True, False):
        res, gdn, pending[defer] = scripted("replay", defer)
        assert res.sequences == _greedy(full[:2], prompts[:2]), defer
        oracle, partial = res.accepted_drafts
        assert len(oracle) < len(partial) and {0, B - 1} <= set(partial)  # commits of 0, 1 and B tokens
        assert gdn._deferred is None  # flushed at the end of the generation
        states[defer] = (gdn.conv.clone(), gdn.rec.clone())
    assert set(pending[True]) == {B} and set(pending[False]) == {None}
    assert all(torch.equal(a, b) for a, b in zip(states[True], states[False]))


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_random_drafter_and_ar_equal_greedy(hybrid, device):
    """A DFlash2 drafter off its init, ReplaySSM, ragged batch; AR decode (T = 1 verify) too."""
    target, folder, prompts, full = hybrid
    model = load_model(folder, target_layer_ids=TAPS, gdn_mode="replay", device=device)
    drafter = RuntimeDrafter(nontrivial_dflash2(spec_drafter(target, B, v2=True, seed=3)).to(device), model)
    assert generate_spec(model, drafter, prompts[1:], 8).sequences == _greedy(full[1:], prompts[1:], 8)
    assert generate_ar(model, prompts[1:], 4) == _greedy(full[1:], prompts[1:], 4)


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["replay", "native"])
def test_long_generation_on_the_gpu_equals_reference_mode(hf_targets, mode, monkeypatch):
    """fp32 on the GPU, 300 tokens: the Triton modes emit what the plain-PyTorch GDN path emits,
    eager and as CUDA graphs (the kernels captured, logs at the state's reserved addresses)."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # the reference conv in full fp32
    hf, folder = hf_targets["qwen3_5"]
    target = TargetModel(hf, target_layer_ids=TAPS)
    drafter = nontrivial_dflash2(spec_drafter(target, 8, v2=True, seed=4)).cuda()
    out = {}
    for m in ("reference", mode):
        model = load_model(folder, target_layer_ids=TAPS, gdn_mode=m, device="cuda")
        out[m] = generate_spec(model, RuntimeDrafter(drafter, model), PROMPTS, 300).sequences
        assert out[m] == generate_ar(model, PROMPTS, 300), m
    assert out[mode] == out["reference"]
    model = load_model(folder, target_layer_ids=TAPS, gdn_mode=mode, device="cuda")
    assert generate_spec(model, RuntimeDrafter(drafter, model), PROMPTS, 300, graphs=True).sequences == out[mode]


@pytest.mark.cuda
def test_graphed_generations_leave_materialised_states(hf_targets, monkeypatch):
    """CUDA graphs replay ReplaySSM's deferred commits without running any Python, so the flush at the
    end of a generation must find them on its own: after each generation of a graphed Decoder (two
    speculative ones, the second replaying everything, and an AR one in the same slot) the GDN states
    are those an eager Decoder leaves, and nothing is left pending."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    hf, folder = hf_targets["qwen3_5"]
    drafter = nontrivial_dflash2(spec_drafter(TargetModel(hf, target_layer_ids=TAPS), B, v2=True, seed=5)).cuda()
    model = load_model(folder, target_layer_ids=TAPS, gdn_mode="replay", device="cuda")
    decoders = [Decoder(model, RuntimeDrafter(drafter, model), max_len=128, graphs=g, pad=True) for g in (False, True)]
    for run in ("spec", "spec", "ar"):
        states = []
        for dec in decoders:
            out = dec.generate_spec(PROMPTS[:3], 40).sequences if run == "spec" else dec.generate_ar(PROMPTS[:3], 20)
            gdn = dec.slot(3).state.gdn
            states.append((out, gdn.conv.clone(), gdn.rec.clone()))
            assert gdn._deferred is None and all(int(p.abs().sum()) == 0 for p in gdn._pend.values()), run
        (out_e, conv_e, rec_e), (out_g, conv_g, rec_g) = states
        assert out_e == out_g, run
        torch.testing.assert_close(conv_g, conv_e, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(rec_g, rec_e, rtol=1e-5, atol=1e-5)
    assert decoders[1].captures > 0
