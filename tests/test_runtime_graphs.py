"""The reusable Decoder (dflash2.runtime.engine) and its CUDA graphs (dflash2.runtime.graphs).

CPU: one Decoder serves many generations (AR and speculative, several batch sizes, rows
padded to their batch bucket) and every one equals HF greedy; the phase timer reports
every phase. GPU: a graphed Decoder and an eager one step through the same generations
and agree on every loop buffer and cache after every step; graphs are captured once per
(bucket, phase, attended-length bucket) and only replayed by later generations; whole
generations through graphs equal eager ones and HF greedy for the three families.
"""

import pytest
import torch
from conftest import nontrivial_dflash2, spec_drafter

from dflash2.decoding import greedy_generate
from dflash2.runtime import Decoder, load_model
from dflash2.runtime.drafter import RuntimeDrafter
from dflash2.runtime.graphs import PhaseTimer, batch_bucket

TAPS = [0, 1]
PROMPTS = [[5, 9, 2, 7, 1, 3, 8], [4, 4, 6], [11, 2, 9, 30, 31, 7, 7, 1, 2, 3, 4, 5], [6]]


def test_batch_buckets():
    assert [batch_bucket(n) for n in (1, 2, 3, 5, 8, 9, 100, 129)] == [1, 2, 4, 8, 8, 16, 128, 129]


def _pair(hf_targets, kind, device="cpu", block=8):
    from dflash2.target import TargetModel

    hf, folder = hf_targets[kind]
    target = TargetModel(hf, target_layer_ids=TAPS)
    model = load_model(folder, device=device, target_layer_ids=TAPS)
    drafter = nontrivial_dflash2(spec_drafter(target, block, v2=True, seed=2)).to(device)
    return target, model, RuntimeDrafter(drafter, model)


def test_one_decoder_many_generations_cpu(hf_targets):
    """Slots are reused across generations and batch sizes; padded rows change nothing."""
    target, model, drafter = _pair(hf_targets, "qwen3_5")
    ref = greedy_generate(target, PROMPTS, 30)
    dec = Decoder(model, drafter, max_len=64, pad=True)
    dec.timer = PhaseTimer("cpu")
    assert dec.generate_spec(PROMPTS[:3], 30).sequences == ref[:3]  # 3 rows in the 4-row slot
    assert dec.generate_ar(PROMPTS, 30) == ref
    assert dec.generate_spec(PROMPTS[1:2], 30).sequences == ref[1:2]  # the 1-row slot
    assert dec.generate_spec(PROMPTS, 30).sequences == ref  # the 4-row slot again, reset
    assert sorted(dec.slots) == [1, 4] and dec.captures == 0
    times = dec.timer.summary()
    assert {"draft", "verify", "accept", "commit", "step", "gap"} <= set(times)
    assert all(t >= 0 for ts in times.values() for t in ts)
    with pytest.raises(Exception, match="max_len"):
        dec.generate_ar(PROMPTS, 60)


def _snapshot(s):
    parts = [s.state.lengths, s.count, s.active, s.token, s.out, s.poll_pair]  # the pair: written by the commit
    if s.state.gdn is not None:
        parts += [s.state.gdn.rec, s.state.gdn.conv]
    if s.ctx is not None:
        parts += [s.ctx.lengths]
    return [p.detach().clone().cpu() for p in parts]


def _graph_keys(dec) -> set:
    """Every captured graph's (batch bucket, phase key)."""
    return {(n, k) for n, s in dec.slots.items() for k in s.graphs.graphs}


def _replays_only(dec, rounds) -> None:
    """A second round may capture only prefill graphs (a prompt width's first prefill runs eagerly, its
    second captures: prefill.py); a third captures nothing."""
    before = _graph_keys(dec)
    rounds()
    assert all(k[1][0] == "prefill" for k in _graph_keys(dec) - before)
    captured = dec.captures
    rounds()
    assert dec.captures == captured


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_graph_replay_equals_eager_step_by_step(hf_targets, kind, monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # fp32 means fp32 (GDN conv)
    _, model, drafter = _pair(hf_targets, kind, "cuda")
    runs = {}
    for graphs in (False, True):
        dec = Decoder(model, drafter, max_len=128, graphs=graphs, pad=True)
        snaps = []
        dec.on_step = lambda s, snaps=snaps: snaps.append(_snapshot(s))
        dec.generate_spec(PROMPTS[:3], 40)
        dec.generate_ar(PROMPTS[:3], 20)
        runs[graphs] = (dec, snaps)
    (eager, ref), (graphed, got) = runs[False], runs[True]
    assert len(got) == len(ref) and eager.captures == 0
    for a, b in zip(got, ref):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
        assert a[5].tolist() == [int(a[2].any()), int(a[0].max())]  # the replayed commit's poll pair
    assert graphed.captures >= 7  # draft, verify, accept, commit(B); AR forward, accept, commit(1)
    # same bucket, same lengths: replays only (once the prompt width's prefill graph exists)
    _replays_only(graphed, lambda: (graphed.generate_spec(PROMPTS[:3], 40), graphed.generate_ar(PROMPTS[:3], 20)))


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["qwen3", "llama", "qwen3_5"])
def test_graphed_generation_equals_eager_and_hf(hf_targets, kind, monkeypatch):
    """fp32 on the GPU: AR and speculative decoding through graphs == eager == HF greedy (CPU)."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    target, model, drafter = _pair(hf_targets, kind, "cuda")
    ref = greedy_generate(target, PROMPTS, 40)
    graphed = Decoder(model, drafter, max_len=128)
    eager = Decoder(model, drafter, max_len=128, graphs=False)
    assert graphed.graphs and graphed.pad
    for _ in range(2):  # the second round replays what the first captured
        assert graphed.generate_ar(PROMPTS, 40) == eager.generate_ar(PROMPTS, 40) == ref
        assert graphed.generate_spec(PROMPTS, 40).sequences == ref
        assert graphed.generate_spec(PROMPTS[:1], 40).sequences == ref[:1]  # the 1-row bucket
    assert graphed.captures > 0


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_sampled_generation_in_graphs_equals_eager(hf_targets, kind, monkeypatch):
    """T>0 on the GPU: the sampling phases are captured (they draw from the Decoder's generator,
    registered with each graph), and a graphed generation equals an eager one of the same caller
    seed token for token, AR and speculative (selector draws, top-k / top-p warps, ragged rows);
    a second round only replays; T=0 and T>0 graphs of one Decoder do not mix."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    _, model, drafter = _pair(hf_targets, kind, "cuda")
    graphed = Decoder(model, drafter, max_len=128)
    eager = Decoder(model, drafter, max_len=128, graphs=False)
    warp = dict(temperature=0.9, top_k=20, top_p=0.95)

    def both(seed):
        out = {}
        for name, dec in (("graphed", graphed), ("eager", eager)):
            gen = torch.Generator(device="cuda").manual_seed(seed)
            spec = dec.generate_spec(PROMPTS, 40, generator=gen, **warp)
            ar = dec.generate_ar(PROMPTS, 30, generator=gen, **warp)
            out[name] = (spec.sequences, spec.accepted_drafts, ar)
        return out

    first = both(3)
    assert first["graphed"] == first["eager"]
    assert graphed.captures >= 7 and eager.captures == 0
    again = []
    _replays_only(graphed, lambda: again.append(both(3)))
    assert again == [first, first]  # the same caller seed, the same tokens: replays reseeded like eager calls
    other = both(4)
    assert other["graphed"] == other["eager"] and other["graphed"][2] != first["graphed"][2]
    greedy = graphed.generate_spec(PROMPTS, 40).sequences
    assert greedy == eager.generate_spec(PROMPTS, 40).sequences  # its own T=0 graphs, not the T>0 ones
    # argmax drafts verified as point masses (q with k = 1): their own accept graph and q buffers
    seeded = lambda: torch.Generator(device="cuda").manual_seed(5)
    point = [dec.generate_spec(PROMPTS, 40, generator=seeded(), argmax_drafts=True, **warp) for dec in (graphed, eager)]
    assert point[0].sequences == point[1].sequences
    assert both(3) == first  # the selector-sampled graphs still read their own buffers


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_context_written_beside_the_verify_equals_in_line(hf_targets, kind, monkeypatch):
    """The drafter's context K/V forked onto a side stream inside the captured verify (SideStream) give the
    same tokens and the same context cache as writing them in line after the target's layers, eager and graphed."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    _, model, drafter = _pair(hf_targets, kind, "cuda")
    runs = {}
    for overlap in (True, False):
        for graphs in (True, False):
            dec = Decoder(model, drafter, max_len=128, graphs=graphs, overlap_context=overlap)
            assert (dec.side.stream is not None) == overlap
            out = [dec.generate_spec(PROMPTS, 40) for _ in range(2)]  # graphed: the second round replays
            s = dec.slots[4]
            kv = (s.ctx.kv.k.clone(), s.ctx.kv.v.clone())
            runs[overlap, graphs] = ([o.sequences for o in out], [o.accepted_drafts for o in out], kv)
    ref = runs[False, False]
    for key, got in runs.items():
        assert got[0] == ref[0] and got[1] == ref[1], key
        for x, y in zip(got[2], ref[2]):
            torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_side_stream_on_the_cpu_calls_at_once():
    from dflash2.runtime.side_stream import SideStream

    side, calls = SideStream("cpu"), []
    side.fork(lambda: calls.append(1))
    assert calls == [1] and side.stream is None and not side.pending
    side.join()  # nothing to wait for
