"""The runtime's own target forwards (dflash2.runtime.models) against HF, through the static caches.

Random tiny Qwen3, Llama and Qwen3.5-hybrid targets are saved as HF folders once per
session; the runtime loads them from disk and must reproduce HF's logits and tapped
hidden states at every committed position, for batch 1 and for a ragged batch whose
rows have different prompt lengths and commit different numbers of tokens per step
(with junk tokens after each row's commit point, as rejected drafts leave them).
"""

import copy

import pytest
import torch
from conftest import RUNTIME_KINDS
from safetensors.torch import load_file, save_file

from dflash2.runtime import load_model

KINDS = RUNTIME_KINDS
# fp32 logits (|logit| ≤ ~3 here). Attention-only targets match HF to ~1e-6 (and to 1e-15 in fp64,
# test_fp64_attention_targets_match_hf_exactly). The hybrid's GDN runs in fp32 in both HF and here,
# HF's prefill sums in chunks where ours is recurrent, and the gated RMSNorm of the small early GDN
# outputs amplifies rounding: HF's own chunked prefill and its token-by-token decode of the same
# sequence differ by ~6e-6, ours differs from HF by ≤ ~2e-5. The GDN math itself is checked to
# rounding against HF's functions in test_runtime_gdn_state.py.
ATOL = {"qwen3": 1e-5, "llama": 1e-5, "qwen3_5": 5e-5}


def _hf_reference(model, seq: torch.Tensor, taps: list[int]):
    """seq (L,) -> logits (L, V), all HF hidden states [(L, d)] and the training-time taps (L, K·d).

    The taps oracle is dflash2.target.TargetModel (what drafters are trained on): the raw output
    of each tapped layer. It equals HF's hidden_states[i + 1] except for the last layer, where HF
    reports the output after the final norm.
    """
    from dflash2.target import TargetModel

    with torch.no_grad():
        out = model(seq[None], output_hidden_states=True)
    ref_taps = TargetModel(model, target_layer_ids=taps)(seq[None]).taps[0]
    return out.logits[0], [h[0] for h in out.hidden_states], ref_taps


def _run(model, seqs, prompt_lens, schedule, vocab, seed=0):
    """Drive the runtime like a speculative decoder; return per row {position: (logits, taps)}.

    seqs (N, L): each row's true tokens. Prefill pads the prompts to the longest one and commits
    each row's own length; then every step (T, n) feeds T tokens per row — the row's next true
    tokens for t < n[r], junk after — and commits n[r].
    """
    g = torch.Generator().manual_seed(seed)
    N = seqs.shape[0]
    state = model.new_state(N, 64)
    got = [{} for _ in range(N)]
    P = max(prompt_lens)
    out = model(seqs[:, :P], state)
    for r in range(N):
        for t in range(prompt_lens[r]):
            got[r][t] = (out.logits[r, t], out.taps[r, t])
    state.commit(torch.tensor(prompt_lens))
    pos = list(prompt_lens)
    for T, n in schedule:
        block = torch.randint(0, vocab, (N, T), generator=g)  # junk = rejected drafts
        for r in range(N):
            block[r, : n[r]] = seqs[r, pos[r] : pos[r] + n[r]]
        out = model(block, state)
        for r in range(N):
            for t in range(n[r]):
                got[r][pos[r] + t] = (out.logits[r, t], out.taps[r, t])
        state.commit(torch.tensor(n))
        pos = [p + k for p, k in zip(pos, n)]
    assert state.lengths.tolist() == pos
    return got


SCHEDULES = {
    # batch 1: prefill 7, four AR steps, then verify blocks committing 1 (all drafts rejected), 3 and 4 of 4
    "batch1": ([7], [(1, [1])] * 4 + [(4, [1]), (4, [3]), (4, [4])]),
    # ragged: prompts 5/11/2, AR steps, then blocks where every row commits its own count
    "ragged": ([5, 11, 2], [(1, [1, 1, 1])] * 3 + [(4, [1, 4, 2]), (4, [3, 1, 4]), (8, [8, 2, 1]), (1, [1, 1, 1])]),
}


@pytest.mark.parametrize("batch", list(SCHEDULES))
@pytest.mark.parametrize("kind", KINDS)
def test_logits_and_taps_match_hf(hf_targets, kind, batch):
    hf, folder = hf_targets[kind]
    taps = [0, 1]
    model = load_model(folder, target_layer_ids=taps)
    prompt_lens, schedule = SCHEDULES[batch]
    N, vocab = len(prompt_lens), hf.config.vocab_size
    seqs = torch.randint(0, vocab, (N, 40), generator=torch.Generator().manual_seed(1))
    got = _run(model, seqs, prompt_lens, schedule, vocab)
    d = model.hidden_size
    worst_logit = worst_tap = 0.0
    for r in range(N):
        L = max(got[r]) + 1
        assert sorted(got[r]) == list(range(L))
        ref_logits, ref_hidden, ref_taps = _hf_reference(hf, seqs[r, :L], taps)
        logits = torch.stack([got[r][t][0] for t in range(L)])
        tapped = torch.stack([got[r][t][1] for t in range(L)])  # (L, K·d)
        worst_logit = max(worst_logit, (logits - ref_logits).abs().max().item())
        worst_tap = max(worst_tap, (tapped - ref_taps).abs().max().item())
        for j, layer in enumerate(taps):
            if layer < model.num_layers - 1:
                # HF hidden_states[0] is the embedding output: layer i's output is hidden_states[i + 1]
                diff = (tapped[:, j * d : (j + 1) * d] - ref_hidden[layer + 1]).abs().max().item()
                worst_tap = max(worst_tap, diff)
    assert worst_logit < ATOL[kind], f"{kind} {batch}: max |Δlogit| {worst_logit:.2e}"
    assert worst_tap < ATOL[kind], f"{kind} {batch}: max |Δtap| {worst_tap:.2e}"


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_fp64_attention_targets_match_hf_exactly(hf_targets, kind):
    """In fp64 the attention path (RoPE, static cache, ragged masks, GQA folding) agrees with HF to
    ~1e-15: any real difference in the math would show far above that."""
    hf, folder = hf_targets[kind]
    hf64 = copy.deepcopy(hf).double()
    model = load_model(folder, dtype=torch.float64, target_layer_ids=[0])
    prompt_lens, schedule = SCHEDULES["ragged"]
    seqs = torch.randint(0, 128, (3, 40), generator=torch.Generator().manual_seed(5))
    got = _run(model, seqs, prompt_lens, schedule, 128)
    for r in range(3):
        L = max(got[r]) + 1
        with torch.no_grad():
            ref = hf64(seqs[r : r + 1, :L]).logits[0]
        logits = torch.stack([got[r][t][0] for t in range(L)])
        assert (logits - ref).abs().max().item() < 1e-12


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_taps_buffer_logits_index_and_kv_len(hf_targets, kind):
    """Taps land in a caller's strided buffer; logits_index picks one position per row; a
    bounded kv_len attends less of the cache and changes nothing."""
    _, folder = hf_targets[kind]
    model = load_model(folder, target_layer_ids=[1, 0])
    seqs = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(2))
    full = model(seqs, model.new_state(2, 64))
    buf = torch.full((2, 9, 3 * model.hidden_size), float("nan"))
    view = buf[:, :, model.hidden_size :]  # a non-contiguous (N, T, K·d) slice, like a context buffer
    last = torch.tensor([8, 4])
    part = model(seqs, model.new_state(2, 64), taps_out=view, logits_index=last, kv_len=16)
    assert part.taps is view
    torch.testing.assert_close(view, full.taps, rtol=0, atol=1e-6)
    assert torch.isnan(buf[:, :, : model.hidden_size]).all()
    torch.testing.assert_close(part.logits, full.logits[torch.arange(2), last], rtol=0, atol=1e-6)


def _spy_layers(model, monkeypatch):
    """Wrap every layer's forward: returns (outputs, events). outputs[i]: layer i's output as the separate add
    the taps used to be written by computes it, ``torch.add(h, delta)`` of the (h, delta) it returns; events:
    ("start", i) / ("end", i) around each layer (the forward's on_taps appends its own)."""
    outputs, events = {}, []
    for i, layer in enumerate(model.layers):

        def run(*args, _i=i, _forward=layer.forward, **kwargs):
            events.append(("start", _i))
            h, delta = _forward(*args, **kwargs)
            outputs[_i] = torch.add(h, delta)
            events.append(("end", _i))
            return h, delta

        monkeypatch.setattr(layer, "forward", run)
    return outputs, events


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", KINDS)
def test_taps_written_by_the_next_norm_are_the_layer_outputs_bit_for_bit(hf_targets, monkeypatch, kind, dtype):
    """A tapped layer's slice, stored by the norm that adds the layer's output next (the following layer's
    first norm, or the final norm: base._tap), equals ``torch.add(h, delta)`` of the layer's (h, delta) bit for
    bit (the separate add it replaces), into a strided caller's buffer, at a prefill with logits_index (whose
    final norm sees one position per row: the last layer's tap still covers all T) and in a verify block.
    Logits and caches are those of taps=False. on_taps fires once, with every slice written: after the first
    norm of the layer after the last tapped one (inside that layer's forward), or after the final norm."""
    model = load_model(hf_targets[kind][1], dtype=dtype)
    L, d = model.num_layers, model.hidden_size
    outputs, events = _spy_layers(model, monkeypatch)
    ids = torch.randint(0, 128, (2, 13), generator=torch.Generator().manual_seed(8))
    prompt, block, last_index = ids[:, :9], ids[:, 9:], torch.tensor([8, 5])
    for tap_ids in ([0], [L - 1, 0], list(range(L))[::-1], [L - 2]):
        model.set_taps(tap_ids)
        K = len(tap_ids)
        state, plain = model.new_state(2, 32), model.new_state(2, 32)
        for tokens, index, commit in ((prompt, last_index, [9, 6]), (block, None, [4, 2])):
            buf = torch.full((2, tokens.shape[1], (K + 2) * d), float("nan"), dtype=dtype)
            view = buf[..., d : (K + 1) * d]  # (N, T, K·d), rows (K + 2)·d apart: each slice is a strided view
            seen = []

            def on_taps(taps, seen=seen):
                events.append(("taps",))
                seen.append(taps.clone())

            events.clear()
            out = model(tokens, state, taps_out=view, logits_index=index, on_taps=on_taps)
            expected = torch.cat([outputs[i] for i in tap_ids], dim=-1)
            assert out.taps is view and torch.equal(view, expected), (tap_ids, index)
            assert torch.isnan(buf[..., :d]).all() and torch.isnan(buf[..., (K + 1) * d :]).all()
            assert len(seen) == 1 and torch.equal(seen[0], expected)  # every slice already written then
            at, last = events.index(("taps",)), max(tap_ids)
            if last + 1 < L:  # fired inside layer last + 1: after its first norm, before it returns
                assert events.index(("start", last + 1)) < at < events.index(("end", last + 1))
            else:  # the last layer tapped: after the final norm, i.e. after every layer
                assert at == len(events) - 1
            off = model(tokens, plain, logits_index=index, taps=False)
            assert off.taps is None and torch.equal(out.logits, off.logits)
            for s in (state, plain):
                s.commit(torch.tensor(commit))
        if state.kv is not None:
            assert torch.equal(state.kv.k, plain.kv.k) and torch.equal(state.kv.v, plain.kv.v)


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_checkpoint_loads_and_runs(hf_targets, tmp_path, kind):
    """Weights stored in bf16 load in bf16 (the stored dtype) and decode close to HF's own bf16 forward;
    dtype='float32' upcasts the same weights."""
    from transformers import AutoModelForCausalLM

    hf, _ = hf_targets[kind]
    folder = tmp_path / "bf16"
    copy.deepcopy(hf).to(torch.bfloat16).save_pretrained(folder)  # the session fixture stays fp32
    stored = load_file(next(folder.glob("*.safetensors")))
    assert {t.dtype for t in stored.values()} == {torch.bfloat16}
    model = load_model(folder)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.rotary.inv_freq.dtype == torch.float32
    seq = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(3))
    state = model.new_state(1, 32)
    logits = [model(seq[:, :8], state).logits]
    state.commit(torch.tensor([8]))
    for t in range(8, 12):
        logits.append(model(seq[:, t : t + 1], state).logits)
        state.commit(torch.tensor([1]))
    ours = torch.cat(logits, 1).float()
    hf_bf16 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        ref = hf_bf16(seq).logits.float()
    up = load_model(folder, dtype="float32")
    assert {p.dtype for p in up.parameters()} == {torch.float32}
    exact = up(seq, up.new_state(1, 32)).logits  # the same bf16 weights, computed in fp32
    ours_err, hf_err = (ours - exact).abs().max().item(), (ref - exact).abs().max().item()
    # bf16 rounding (8 mantissa bits) moves logits by ~0.02 (attention) to ~0.16 (hybrid: the gated
    # GDN norm amplifies it) from the fp32 computation in HF and here alike; the two bf16 forwards
    # stay within ~0.01 of each other (measured 0.009-0.018)
    assert (ours - ref).abs().max().item() < 0.05, f"{kind}: ours vs HF bf16"
    assert ours_err <= 1.25 * hf_err + 0.01, f"{kind}: bf16 error {ours_err:.3f} vs HF's {hf_err:.3f}"


def test_composite_qwen3_5_checkpoint(hf_targets, tmp_path):
    """A vision-language Qwen3.5 folder: nested text_config, text weights under model.language_model.,
    vision and MTP weights that the runtime skips. Same model, same logits as the plain folder."""
    import transformers

    hf, folder = hf_targets["qwen3_5"]
    composite = tmp_path / "vl"
    transformers.Qwen3_5Config(text_config=hf.config.to_dict()).save_pretrained(composite)
    weights = {k.replace("model.", "model.language_model.", 1): v for k, v in hf.state_dict().items()}
    weights |= {"model.visual.patch_embed.proj.weight": torch.zeros(2), "mtp.fc.weight": torch.zeros(2)}
    save_file({k: v.contiguous() for k, v in weights.items()}, composite / "model.safetensors")
    seq = torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(4))
    plain, vl = load_model(folder), load_model(composite)
    a = plain(seq, plain.new_state(1, 16)).logits
    b = vl(seq, vl.new_state(1, 16)).logits
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_unknown_checkpoint_key_fails_loudly(hf_targets, tmp_path):
    hf, _ = hf_targets["qwen3"]
    hf.save_pretrained(tmp_path)
    path = next(tmp_path.glob("*.safetensors"))
    weights = load_file(path) | {"model.layers.0.self_attn.extra.weight": torch.zeros(2)}
    save_file(weights, path)
    with pytest.raises(KeyError, match=r"unexpected \['model.layers.0.self_attn.extra.weight'\]"):
        load_model(tmp_path)


@pytest.mark.parametrize("kind", KINDS)
def test_the_states_rope_rows_are_the_computed_ones_bit_for_bit(hf_targets, kind):
    """new_state's RoPE rows (Rotary.table, gathered by every step) equal Rotary's per-step computation at
    any positions, in fp32 and bf16: the llama3 scaling, Qwen3.5's partial rotary and plain RoPE alike."""
    model = load_model(hf_targets[kind][1])
    positions = torch.tensor([[0, 1, 2, 3], [61, 62, 63, 5], [17, 40, 9, 33]])
    for dtype in (torch.float32, torch.bfloat16):
        table = model.rotary.table(64, dtype, "cpu")
        assert table[0].shape == (64, model.rotary.inv_freq.numel() * 2) and table[0].dtype == dtype
        got = model.rotary(positions, dtype, table)
        want = model.rotary(positions, dtype)
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape == (3, 1, 4, table[0].shape[1])
            bits = torch.int16 if dtype == torch.bfloat16 else torch.int32  # signed zeros count too
            assert torch.equal(g.contiguous().view(bits), w.contiguous().view(bits))
    state = model.new_state(2, 48)
    assert state.rope[0].shape[0] == 48 and state.rope[0].dtype == model.embed.weight.dtype


@pytest.mark.parametrize("kind", KINDS)
def test_taps_off_changes_nothing_but_the_taps(hf_targets, kind):
    """taps=False (the engine's plain AR step): no taps computed, the same logits and caches."""
    model = load_model(hf_targets[kind][1], target_layer_ids=[0, 1])
    ids = torch.randint(0, 100, (2, 5), generator=torch.Generator().manual_seed(6))
    outs = []
    for taps in (True, False):
        state = model.new_state(2, 16)
        out = model(ids, state, taps=taps)
        outs.append((out, state))
    assert outs[0][0].taps is not None and outs[1][0].taps is None
    assert torch.equal(outs[0][0].logits, outs[1][0].logits)
    if outs[0][1].kv is not None:
        assert torch.equal(outs[0][1].kv.k, outs[1][1].kv.k) and torch.equal(outs[0][1].kv.v, outs[1][1].kv.v)
