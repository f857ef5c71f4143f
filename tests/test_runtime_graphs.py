"""CUDA graphs of the runtime's fixed-shape steps (dflash2.runtime.graphs) against eager execution.

On a GPU: a graphed target and an eager one drive two identical states through the same
AR (T=1) and verify (T=B) steps with ragged commits; logits, taps, lengths and GDN states
must agree after every step, and whole generations through the graphed target must equal
eager ones token for token (and HF greedy). On the CPU the wrapper is a pass-through,
checked once through the engine so its delegation stays correct.
"""

import pytest
import torch
from conftest import nontrivial_dflash2, spec_drafter

from dflash2.decoding import greedy_generate
from dflash2.runtime import load_model
from dflash2.runtime.drafter import RuntimeDrafter
from dflash2.runtime.engine import generate_ar, generate_spec
from dflash2.runtime.graphs import GraphedTarget, batch_bucket

TAPS = [0, 1]
PROMPTS = [[5, 9, 2, 7, 1, 3, 8], [4, 4, 6], [11, 2, 9, 30, 31, 7, 7, 1, 2, 3, 4, 5], [6]]


def test_batch_buckets():
    assert [batch_bucket(n) for n in (1, 2, 3, 5, 8, 9, 100, 129)] == [1, 2, 4, 8, 8, 16, 128, 129]


def test_cpu_is_a_pass_through_in_the_engine(hf_targets):
    from dflash2.target import TargetModel

    hf, folder = hf_targets["qwen3"]
    model = load_model(folder, target_layer_ids=TAPS)
    graphed = GraphedTarget(model)
    drafter = spec_drafter(TargetModel(hf, target_layer_ids=TAPS), 4)
    assert generate_ar(graphed, PROMPTS, 20) == generate_ar(model, PROMPTS, 20)
    spec = generate_spec(graphed, RuntimeDrafter(drafter, graphed), PROMPTS, 20)
    assert spec.sequences == generate_ar(model, PROMPTS, 20) and graphed.captures == 0


def _pair_of_states(model, N, max_len=64):
    """Two states with the same ragged prefill (eager)."""
    ids = torch.randint(0, 120, (N, 9), generator=torch.Generator().manual_seed(0)).cuda()
    lengths = torch.tensor([9, 4, 7, 2][:N]).cuda()
    states = [model.new_state(N, max_len) for _ in range(2)]
    for s in states:
        model(ids, s, logits_index=lengths - 1)
        s.commit(lengths)
    return states


@pytest.mark.cuda
@pytest.mark.parametrize("N", [1, 4])
@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_graph_replay_equals_eager_steps(hf_targets, kind, N):
    model = load_model(hf_targets[kind][1], device="cuda", target_layer_ids=TAPS)
    graphed = GraphedTarget(model)
    eager_state, graph_state = _pair_of_states(model, N)
    g = torch.Generator().manual_seed(1)
    taps_buf = torch.zeros(N, 8, 2 * model.hidden_size, device="cuda")  # a drafter-context-like buffer
    # (T, kv_len, commit per row): AR steps, verify steps with ragged commits, a second kv_len bucket
    schedule = [(1, 64, [1, 1, 1, 1]), (8, 64, [3, 8, 1, 5]), (1, 64, [1, 1, 1, 1]), (8, 64, [1, 2, 8, 4])] * 2
    schedule += [(8, 48, [2, 1, 1, 3]), (1, 48, [1, 1, 1, 1])]
    for T, kv_len, n in schedule:
        tokens = torch.randint(0, 120, (N, T), generator=g).cuda()
        buf = taps_buf[:, :T] if T == 8 else None
        ref = model(tokens, eager_state, kv_len=kv_len)
        got = graphed(tokens, graph_state, taps_out=buf, kv_len=kv_len)
        torch.testing.assert_close(got.logits, ref.logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.taps, ref.taps, rtol=1e-5, atol=1e-5)
        if buf is not None:
            assert got.taps.data_ptr() == buf.data_ptr()  # written straight into the caller's buffer
        commit = torch.tensor(n[:N]).cuda()
        eager_state.commit(commit)
        graph_state.commit(commit)
        assert torch.equal(eager_state.lengths, graph_state.lengths)
        if kind == "qwen3_5":
            torch.testing.assert_close(graph_state.gdn.rec, eager_state.gdn.rec, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(graph_state.gdn.conv, eager_state.gdn.conv, rtol=1e-5, atol=1e-5)
    assert graphed.num_graphs == 4  # (T=1, 64), (T=8, 64, buffer), (T=8, 48, buffer), (T=1, 48)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["qwen3", "llama", "qwen3_5"])
def test_graphed_generation_equals_eager_and_hf(hf_targets, kind, monkeypatch):
    """fp32 on the GPU: AR and speculative decoding through graphs == eager == HF greedy (CPU)."""
    # fp32 means fp32: cuDNN may run the GDN conv in TF32 by default, rounding far above fp32
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    from dflash2.target import TargetModel

    hf, folder = hf_targets[kind]
    target = TargetModel(hf, target_layer_ids=TAPS)
    ref = greedy_generate(target, PROMPTS, 40)
    model = load_model(folder, device="cuda", target_layer_ids=TAPS)
    graphed = GraphedTarget(model)
    drafter = nontrivial_dflash2(spec_drafter(target, 8, v2=True, seed=2)).cuda()
    assert generate_ar(graphed, PROMPTS, 40) == generate_ar(model, PROMPTS, 40) == ref
    spec = generate_spec(graphed, RuntimeDrafter(drafter, graphed), PROMPTS, 40)
    assert spec.sequences == ref
    assert graphed.captures == 2  # the AR step and the verify step (one kv_len bucket each)
    assert graphed.num_graphs == 0  # each generation's state is gone, and its graphs with it
