"""The bucketed prefill (dflash2.runtime.prefill): prompts padded to a bucket width, graphed on CUDA.

CPU (graphs off, the same padded computation eagerly): for random Qwen3, Llama and Qwen3.5-hybrid
targets, a prefill padded to its bucket leaves bit for bit what the unpadded prefill leaves — the
last prompt token's logits, the lengths, the committed K/V, the GDN states and the drafter's context —
at batch 1 and for a ragged batch (rows padded to the slot's batch bucket too), and AR and speculative
generations after it equal the eager Decoder's token for token. GPU: the graphed prefill is captured
once per (slot, width bucket, AR or spec) and replayed by later prompts of that bucket, nothing in it
synchronises with the host, and graphed generations equal eager ones token for token.
"""

import pytest
import torch
from conftest import RUNTIME_KINDS, nontrivial_dflash2, spec_drafter

from dflash2.errors import DFlash2Error
from dflash2.runtime import Decoder, load_model
from dflash2.runtime.drafter import RuntimeDrafter
from dflash2.runtime.engine import DEFAULT_PREFILL_GRAPH_TOKENS, default_prefill_graph_tokens
from dflash2.runtime.kernels.triton_util import interpreting
from dflash2.runtime.prefill import MIN_BUCKET, pad_to_bucket, prefill_bucket

TAPS = [0, 1]
B = 8


def _prompt(length, seed):
    return torch.randint(0, 100, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


# ragged: widths 7 / 12 / 3 / 9, and 23 (over 16: a 32-wide bucket, and SDPA attention instead of the decode
# kernel's path on CUDA); batches of 3 fill a 4-row slot with one padding row
PROMPTS = [_prompt(7, 1), _prompt(12, 2), _prompt(3, 3), _prompt(9, 4), _prompt(23, 5)]
BATCHES = {"batch1": [PROMPTS[0]], "ragged": PROMPTS[:3], "ragged_wide": [PROMPTS[4], PROMPTS[2], PROMPTS[1]]}


@pytest.fixture(scope="module")
def pairs(hf_targets):
    """{kind: (runtime target, RuntimeDrafter of block B)} on the CPU, fp32."""
    from dflash2.target import TargetModel

    out = {}
    for kind in RUNTIME_KINDS:
        hf, folder = hf_targets[kind]
        model = load_model(folder, target_layer_ids=TAPS)
        drafter = nontrivial_dflash2(spec_drafter(TargetModel(hf, target_layer_ids=TAPS), B, v2=True, seed=2))
        out[kind] = (model, RuntimeDrafter(drafter, model))
    return out


def test_buckets_are_powers_of_two_from_16():
    assert [prefill_bucket(w) for w in (1, 7, 16, 17, 32, 33, 64, 65, 200)] == [16, 16, 16, 32, 32, 64, 64, 128, 256]
    assert MIN_BUCKET == 16 and prefill_bucket(3, minimum=4) == 4
    ids = torch.tensor([[5, 6, 7], [8, 0, 0]])
    assert torch.equal(pad_to_bucket(ids, 5, pad_id=9), torch.tensor([[5, 6, 7, 9, 9], [8, 0, 0, 9, 9]]))
    assert pad_to_bucket(ids, 3) is ids
    with pytest.raises(ValueError, match="narrower"):
        pad_to_bucket(ids, 2)
    with pytest.raises(ValueError, match="≥ 1"):
        prefill_bucket(0)


def test_which_prompts_are_bucketed(pairs):
    model, drafter = pairs["qwen3"]
    assert Decoder(model, drafter, max_len=64)._prefill_width(10) is None  # the default without graphs: off
    # with graphs the default buckets prompts up to DEFAULT_PREFILL_GRAPH_TOKENS; an explicit value wins either way
    assert default_prefill_graph_tokens(True) == DEFAULT_PREFILL_GRAPH_TOKENS == 64
    assert default_prefill_graph_tokens(False) == 0 and default_prefill_graph_tokens(True, 0) == 0
    assert Decoder(model, drafter, max_len=64, graphs=False, prefill_graph_tokens=None).prefill_graph_tokens == 0
    dec = Decoder(model, drafter, max_len=40, prefill_graph_tokens=32)
    assert [dec._prefill_width(P) for P in (1, 16, 17, 32, 33)] == [16, 16, 32, 32, None]  # limit: the width P
    assert Decoder(model, drafter, max_len=30, prefill_graph_tokens=32)._prefill_width(17) is None  # 32 > max_len
    with pytest.raises(DFlash2Error, match="prefill_graph_tokens"):
        Decoder(model, drafter, max_len=64, prefill_graph_tokens=-1)


def _committed(s):
    """What a prefill leaves in slot s that later steps read, per row up to its committed length."""
    lengths = s.state.lengths.tolist()
    out = {"lengths": s.state.lengths.clone(), "ctx_lengths": s.ctx.lengths.clone()}
    for name, cache in (("kv", s.state.kv), ("ctx_kv", s.ctx.kv)):
        if cache is not None:  # (L, Nb, Hkv, S, D): the committed positions of each row
            out[name] = [torch.cat([cache.k[:, r, :, :n], cache.v[:, r, :, :n]]) for r, n in enumerate(lengths)]
    if s.state.gdn is not None:
        s.state.flush()
        out["gdn"] = [s.state.gdn.rec.clone(), s.state.gdn.conv.clone()]
    return out


def _prefill_once(dec, prompts, spec):
    """Decoder._begin + _prefill as generate_* run them -> (logits (Nb, V), what the slot holds)."""
    s, ids, lengths, _ = dec._begin(prompts, 4, None, B)
    logits = dec._prefill(s, ids, lengths, spec=spec).clone()
    return logits, _committed(s)


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("kind", RUNTIME_KINDS)
def test_padded_prefill_equals_unpadded(pairs, kind, batch):
    """Bit for bit: the logits, the committed K/V (target and drafter context), GDN states and lengths."""
    model, drafter = pairs[kind]
    prompts = BATCHES[batch]
    plain = Decoder(model, drafter, max_len=64, pad=True)
    bucketed = Decoder(model, drafter, max_len=64, pad=True, prefill_graph_tokens=32)
    for spec in (False, True):
        ref_logits, ref = _prefill_once(plain, prompts, spec)
        logits, got = _prefill_once(bucketed, prompts, spec)
        assert torch.equal(logits, ref_logits), (kind, batch, spec)
        assert got.keys() == ref.keys()
        for name in ref:
            pairs_ = zip(got[name], ref[name]) if isinstance(ref[name], list) else [(got[name], ref[name])]
            assert all(torch.equal(a, b) for a, b in pairs_), (name, spec)
    s = bucketed.slot(len(prompts))
    width = prefill_bucket(max(map(len, prompts)))
    assert list(s.prefill._ids) == [width]  # the buffer the phase read
    assert plain.slot(len(prompts)).prefill is None


@pytest.mark.parametrize("kind", RUNTIME_KINDS)
def test_generation_after_a_padded_prefill_equals_eager(pairs, kind):
    """Greedy AR and speculative generations of a Decoder with the bucketed prefill == the plain Decoder's, for
    batch 1 and ragged batches, one Decoder reused across them (its slots and buffers reused, reset)."""
    model, drafter = pairs[kind]
    plain = Decoder(model, drafter, max_len=80, pad=True)
    bucketed = Decoder(model, drafter, max_len=80, pad=True, prefill_graph_tokens=32)
    for prompts in (*BATCHES.values(), PROMPTS[:1]):  # the 1-row slot again, with its buffers from before
        ref = plain.generate_ar(prompts, 30)
        assert bucketed.generate_ar(prompts, 30) == ref
        assert bucketed.generate_spec(prompts, 30).sequences == plain.generate_spec(prompts, 30).sequences == ref
    assert bucketed.captures == 0 and sorted(bucketed.slots) == [1, 4]


# ----------------------------------------------------------------------------- CUDA: graphed prefill
def _prefill_keys(dec):
    return sorted(k for s in dec.slots.values() for k in s.graphs.graphs if k[0] == "prefill")


@pytest.mark.cuda
@pytest.mark.parametrize("kind", RUNTIME_KINDS)
def test_graphed_prefill_equals_eager_and_replays(hf_targets, kind, monkeypatch):
    """fp32 on the GPU, T=0: three generations per (batch bucket, prompt bucket, AR / spec), the first running
    the prefill eagerly, the second capturing it and the third replaying it, each with other prompts of the
    same bucket, equal an eager Decoder's (no graphs; the same padding and buckets) token for token; the third captures
    nothing; the bucketed prefill never synchronises with the host (CUDA's sync debug mode raises if it does)."""
    from dflash2.runtime import engine
    from dflash2.target import TargetModel

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # fp32 means fp32 (GDN conv)
    hf, folder = hf_targets[kind]
    model = load_model(folder, device="cuda", target_layer_ids=TAPS)
    draft = nontrivial_dflash2(spec_drafter(TargetModel(hf, target_layer_ids=TAPS), B, v2=True, seed=2)).cuda()
    drafter = RuntimeDrafter(draft, model)
    real, checked = engine.bucketed_prefill, []

    def strict(slot, target, proposer, ids, lengths, width):
        key = ("prefill", width, proposer is not None)
        # eager first uses and replays run under the sync debug mode; a capture needs no check (any sync
        # inside it fails the capture), and torch.cuda.graph synchronises around it on purpose
        capture = key in slot.graphs.seen and key not in slot.graphs.graphs
        torch.cuda.set_sync_debug_mode(0 if capture else "error")
        checked.append(not capture)
        try:
            return real(slot, target, proposer, ids, lengths, width)
        finally:
            torch.cuda.set_sync_debug_mode(0)

    monkeypatch.setattr(engine, "bucketed_prefill", strict)
    graphed = Decoder(model, drafter, max_len=128, prefill_graph_tokens=64)
    # the reference pads alike (same bucket widths, same batch buckets), so every GEMM and attention call has the
    # graphed run's shapes: a difference can only come from the graphs, not from kernels picked per row count
    eager = Decoder(model, drafter, max_len=128, graphs=False, pad=True, prefill_graph_tokens=64)
    # per round, other prompts of the same buckets: batch 1 (16 wide), 3 rows in the 4-row slot (16 wide), 2 rows
    # (32 wide: SDPA attention instead of the decode kernel)
    rounds = [
        ([PROMPTS[0]], PROMPTS[:3], [PROMPTS[4], PROMPTS[2]]),
        ([PROMPTS[1]], PROMPTS[1:4], [PROMPTS[2], PROMPTS[4]]),
        ([PROMPTS[3]], [PROMPTS[3], PROMPTS[0], PROMPTS[1]], [PROMPTS[4], PROMPTS[0]]),
    ]
    for i, batches in enumerate(rounds):
        if i == 2:
            captured, keys = graphed.captures, _prefill_keys(graphed)
        for prompts in batches:
            ref = eager.generate_ar(prompts, 40)
            assert graphed.generate_ar(prompts, 40) == ref, (i, prompts)
            assert graphed.generate_spec(prompts, 40).sequences == eager.generate_spec(prompts, 40).sequences == ref
    assert graphed.captures == captured  # the third round only replayed
    # per slot (1 and 4 rows: 16 wide, 2 rows: 32 wide), AR and spec: one graph each
    per_slot = {1: 16, 4: 16, 2: 32}
    assert keys == sorted(("prefill", width, spec) for width in per_slot.values() for spec in (False, True))
    assert _prefill_keys(graphed) == keys and checked.count(True) == len(checked) - len(keys)


@pytest.mark.slow
@pytest.mark.skipif(not interpreting(), reason="the Triton GDN modes on CPU tensors need TRITON_INTERPRET=1")
@pytest.mark.parametrize("mode", ["replay", "native"])
def test_padded_prefill_equals_unpadded_in_the_triton_gdn_modes(hf_targets, mode):
    """The hybrid with the GDN kernels (interpreted): at block 16 a 16-wide bucket is a reserved verify length,
    whose verify folds a (zero) pending commit and, native, stores a state per position; still bit for bit
    (a ragged batch of widths 7 / 12 / 3 in the 4-row slot; interpreted kernels are slow: one batch)."""
    from dflash2.target import TargetModel

    hf, folder = hf_targets["qwen3_5"]
    model = load_model(folder, target_layer_ids=TAPS, gdn_mode=mode)
    drafter = RuntimeDrafter(spec_drafter(TargetModel(hf, target_layer_ids=TAPS), 16, seed=2), model)
    plain = Decoder(model, drafter, max_len=48, pad=True)
    bucketed = Decoder(model, drafter, max_len=48, pad=True, prefill_graph_tokens=16)
    ref_logits, ref = _prefill_once(plain, BATCHES["ragged"], True)
    logits, got = _prefill_once(bucketed, BATCHES["ragged"], True)
    assert torch.equal(logits, ref_logits)
    assert bucketed._prefill_width(12) == drafter.block_size  # the reserved length
    for name in ("gdn", "kv", "ctx_kv"):
        assert all(torch.equal(a, b) for a, b in zip(got[name], ref[name])), name


def test_min_bucket_is_the_attention_and_native_gdn_limit():
    """The minimum bucket is chosen to coincide with the decode-attention kernel's block limit and native GDN's
    per-position states (prefill.py): padding never moves a prompt across either. If one moves, so must it."""
    from dflash2.runtime.cache import TRITON_MAX_T
    from dflash2.runtime.gdn_state import NATIVE_MAX_TOKENS
    from dflash2.runtime.prefill import MIN_BUCKET

    assert MIN_BUCKET == TRITON_MAX_T == NATIVE_MAX_TOKENS
