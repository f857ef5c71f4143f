"""`eval.speedup` with GDN modes (dflash2/eval/speedup_gdn.py) on the CPU.

A tiny random Qwen3.5 hybrid (3 GDN : 1 attention; 1 key head for 2 value heads in the interpreted
run) is measured in the plain-PyTorch reference mode and in Triton ReplaySSM (interpreted:
TRITON_INTERPRET=1, set by conftest without a GPU).
The drafter is scripted from the target's greedy continuation (an oracle row beside one that
accepts none, all or a random count per step), so commits of 1..B tokens really happen and
every anchor is checked against greedy decoding on the way. What is asserted: each mode's
own lossless flag, the cross-mode check against the first mode's AR output, the per-GDN-layer
bench at the target's own shape (timed under the interpreter, bytes matching the shape
formula), and that native's speculative state is larger than ReplaySSM's at this shape.
On the GPU (``cuda``): the three modes through CUDA graphs, 300 tokens, a random DFlash2 drafter.
Speed is never asserted.
"""

import json

import pytest
import torch
from conftest import build_runtime_hf, nontrivial_dflash2, spec_drafter
from test_runtime_engine import PROMPTS, ScriptedProposer, _prompt

from dflash2.decoding import greedy_generate
from dflash2.errors import DFlash2Error
from dflash2.eval import speedup_gdn
from dflash2.eval.speedup import cross_mode, run_speedup
from dflash2.eval.speedup_setup import Pair
from dflash2.runtime import RuntimeDrafter, load_model
from dflash2.runtime.bench_gdn import GDNShape, spec_bytes
from dflash2.runtime.kernels.triton_util import interpreting
from dflash2.target import TargetModel

TAPS = [0, 1]
B = 4
N_NEW = 6  # interpreted kernels are slow: two or three steps per row (the oracle row's second cut by the budget)


def _pair(hf, folder):
    """(HF hybrid, runtime model in the default mode, two equal-length prompts, prompt + greedy continuation)."""
    prompts = [_prompt(7, 1), _prompt(7, 5)]  # equal lengths: HF generate runs unpadded
    gen = greedy_generate(TargetModel(hf, target_layer_ids=TAPS), prompts, N_NEW + B)
    return hf, load_model(folder, target_layer_ids=TAPS), prompts, [p + g for p, g in zip(prompts, gen)]


@pytest.fixture(scope="module")
def hybrid(hf_targets):
    return _pair(*hf_targets["qwen3_5"])


@pytest.fixture(scope="module")
def narrow_hybrid(tmp_path_factory):
    """The same hybrid with 1 key head for 2 value heads (hf_targets': 2 for 4), for the interpreted run:
    the interpreter's time is per (row, head) program, and what this file checks, the harness around the
    GDN modes, is the same at any head count (the kernels' heads: test_runtime_gdn_*.py)."""
    hf = build_runtime_hf("qwen3_5", linear_num_key_heads=1, linear_num_value_heads=2)
    folder = tmp_path_factory.mktemp("rt_qwen3_5_narrow")
    hf.save_pretrained(folder)
    return _pair(hf, folder)


def _run(pair, modes, out=None):
    return run_speedup(
        pair,
        batch_sizes=[2],
        max_new_tokens=N_NEW,
        hf_new_tokens=N_NEW,
        runs=1,
        copy_bytes=1 << 20,
        gdn_modes=modes,
        output_dir=out,
        log=lambda _: None,
        warmup_passes=0,  # interpreted kernels: no timing to warm up for, half the decodes
    )


@pytest.mark.slow
@pytest.mark.skipif(not interpreting(), reason="CPU tensors need TRITON_INTERPRET=1")
def test_modes_are_lossless_and_agree_with_each_other(narrow_hybrid, tmp_path):
    hf, model, prompts, full = narrow_hybrid
    drafter = ScriptedProposer(full, ["oracle", "partial"], B, model.vocab_size)
    pair = Pair(hf, model, drafter, prompts, "tiny hybrid, scripted drafter", False)
    res = _run(pair, ["reference", "replay"], tmp_path)
    assert model.gdn_mode == "auto"  # the run restores the target's own mode
    assert res["warmup_passes"] == 0  # the override is recorded with the figures

    shape = GDNShape.of_model(model)
    assert res["gdn"]["applicable"] and res["gdn"]["modes"] == ["reference", "replay"]
    assert res["gdn"]["shape"]["num_layers"] == 3 and res["gdn"]["block_size"] == B
    row = res["batches"]["2"]
    assert row["gdn_mode"] == "reference" and list(row["other_gdn_modes"]) == ["replay"]
    assert all(row["hf_prefix_equals_ar"])  # the headline AR is HF's greedy output
    for mode, sub in speedup_gdn.mode_rows(row):
        assert sub["lossless"] is True and sub["divergence"] is None, mode  # its spec == its AR
        x = sub["first_mode"]
        assert x["ar_equals_first_mode_ar"] and x["spec_equals_first_mode_ar"], mode  # == the reference AR
        assert x["ar_divergence"] is None and x["spec_divergence"] is None
        assert sub["spec"]["tau"] > 1  # the scripted rows accepted drafts: multi-token commits happened
        assert "sequences" not in sub["ar"] and "sequences" not in sub["spec"]
        cost = sub["gdn_layer"]
        assert cost["timed"] and cost["total_us"] == pytest.approx(cost["verify_us"] + cost["commit_us"])
        # logs as replay's; the deferred commit (replay mode) adds its counts and stash
        assert cost["spec_bytes_per_request"] == spec_bytes(shape, B, "replay", x_itemsize=4, deferred=mode == "replay")
        # the options the states ran are recorded (on the CPU nothing is resolved: none given, none picked)
        assert cost["kernel_options_ran"] == {} and sub["gdn_kernel_options_ran"] == {"2": {}}

    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["batches"]["2"]["other_gdn_modes"]["replay"]["lossless"] is True
    md = (tmp_path / "results.md").read_text()
    assert "| 2 | runtime spec (replay) |" in md and "| 2 | runtime AR (reference) |" in md
    assert "| 2 | replay |" in md and "yes/yes" in md  # the GDN table with the cross-mode column
    pytest.importorskip("matplotlib")
    assert (tmp_path / "step_breakdown.png").stat().st_size > 0


def test_native_keeps_more_speculative_state_than_replay(hybrid, monkeypatch):
    """Bytes from the shapes, without running a kernel (the CPU path without Triton's interpreter)."""
    _, model, _, _ = hybrid
    monkeypatch.setattr(speedup_gdn, "_interpreting", lambda: False)
    shape = GDNShape.of_model(model)
    assert (shape.num_layers, shape.num_k_heads, shape.num_v_heads, shape.head_k_dim, shape.head_v_dim) == (
        3,
        2,
        4,
        8,
        8,
    )
    assert shape.conv_dim == model.gdn_dims["conv_dim"]
    rep = speedup_gdn.layer_cost(model, "replay", 1, B)
    nat = speedup_gdn.layer_cost(model, "native", 1, B)
    assert not rep["timed"] and rep["total_us"] is None  # no µs on the CPU without the interpreter
    assert rep["spec_bytes_per_request"] < nat["spec_bytes_per_request"]
    # per layer and token: replay logs k (2·8) + u (4·8) + g (4) fp32, native one (4, 8, 8) fp32 state; the
    # deferred commit adds an int32 count per recurrence program (4 heads × 1 value slice) per layer and
    # each layer's stash of k (2·8) and g (4) per token
    x = B * shape.conv_dim * 4
    assert rep["spec_bytes_per_request"] == 3 * (4 * B * (16 + 32 + 4) + x) + 3 * 4 * 4 + 3 * 4 * B * (16 + 4)
    assert nat["spec_bytes_per_request"] == 3 * (4 * B * 256 + x)
    assert rep["state_bytes_per_request"] == nat["state_bytes_per_request"] == 3 * (4 * 256 + shape.conv_dim * 3 * 4)
    long_block = speedup_gdn.layer_cost(model, "native", 1, 32)  # past NATIVE_MAX_TOKENS native logs for a fold
    assert long_block["spec_layout"] == "replay" and long_block["spec_bytes_per_request"] == spec_bytes(
        shape, 32, "replay", x_itemsize=4
    )


def test_modes_are_checked_before_anything_runs(hybrid, hf_targets, monkeypatch):
    _, model, _, _ = hybrid
    # a CPU target: the Triton modes are allowed through the interpreter (set on CPU machines, not on a GPU one)
    monkeypatch.setattr(speedup_gdn, "_interpreting", lambda: True)
    assert speedup_gdn.plan_modes(model, ["auto", "native"]) == ["reference", "native"]  # auto: CPU's default
    with pytest.raises(DFlash2Error, match="not known"):
        speedup_gdn.plan_modes(model, ["replay", "fast"])
    with pytest.raises(DFlash2Error, match="twice"):
        speedup_gdn.plan_modes(model, ["auto", "reference"])
    with pytest.raises(DFlash2Error, match="empty"):
        speedup_gdn.plan_modes(model, [])
    monkeypatch.setattr(speedup_gdn, "_interpreting", lambda: False)
    with pytest.raises(DFlash2Error, match=r"gdn_modes=\[reference\] on the CPU"):
        speedup_gdn.plan_modes(model, ["replay", "native"])
    assert speedup_gdn.plan_modes(model, ["reference"]) == ["reference"]
    attention_only = load_model(hf_targets["qwen3"][1])
    assert speedup_gdn.plan_modes(attention_only, ["replay", "native"]) == []  # nothing to choose: no error
    with pytest.raises(DFlash2Error, match="not known"):
        speedup_gdn.plan_modes(attention_only, ["Replay"])  # a typo is still one


def test_kernel_options_reach_the_states(hybrid):
    """gdn_kernel_options (eval.speedup's config key, e.g. {chunked: true}) reach every GDNState the target
    makes inside gdn_mode(...), and the target's own are restored after."""
    _, model, _, _ = hybrid
    assert model.gdn_kernel_options == {}
    with speedup_gdn.gdn_mode(model, "replay", {"chunked": True}):
        state = model.new_state(1, 8)
        assert state.gdn.mode == "replay" and state.gdn.kernel_options == {"chunked": True}
    assert model.gdn_kernel_options == {} and model.new_state(1, 8).gdn.kernel_options == {}


def test_cross_mode_check_names_the_first_divergence(hybrid):
    """A mode whose output differs from the first mode's AR is flagged with both tokens and the margin."""
    _, model, prompts, full = hybrid
    ref = [f[len(p) :][:6] for f, p in zip(full, prompts)]
    bad = [list(ref[0]), [*ref[1][:3], (ref[1][3] + 1) % model.vocab_size, *ref[1][4:]]]
    x = cross_mode(model, prompts, ref, {"ar": {"sequences": ref}, "spec": {"sequences": bad}})
    assert x["ar_equals_first_mode_ar"] and x["ar_divergence"] is None
    d = x["spec_divergence"]
    assert not x["spec_equals_first_mode_ar"] and (d["row"], d["position"]) == (1, 3)
    assert d["ar_token"] == ref[1][3] and d["spec_token"] == bad[1][3]
    assert d["margin"] > 0  # the greedy token is the argmax: the other one's logit is lower


@pytest.mark.cuda
def test_three_modes_on_the_gpu_agree(hf_targets, monkeypatch, tmp_path):
    """fp32, CUDA graphs, ragged batch of 4 and batch 1, 300 tokens: ReplaySSM (headline), native and the
    plain-PyTorch reference emit the same tokens, spec == AR in each; the per-layer bench is timed. Attention:
    the Triton decode kernel (the default backend), SDPA in the no-Triton-kernels ablation."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # the reference conv in full fp32
    hf, folder = hf_targets["qwen3_5"]
    model = load_model(folder, target_layer_ids=TAPS, device="cuda")
    drafter = nontrivial_dflash2(spec_drafter(TargetModel(hf, target_layer_ids=TAPS), 8, v2=True, seed=4)).cuda()
    pair = Pair(None, model, RuntimeDrafter(drafter, model), PROMPTS, "tiny hybrid on the GPU", False)
    res = run_speedup(
        pair,
        batch_sizes=[1, 4],
        max_new_tokens=300,
        hf_new_tokens=0,
        runs=2,
        copy_bytes=1 << 24,
        gdn_modes=["replay", "native", "reference"],
        gdn_bench_iters=5,
        output_dir=tmp_path,
        log=lambda _: None,
    )
    assert res["gdn"]["modes"] == ["replay", "native", "reference"]
    assert res["ablation_ar_batch1_no_fused_kernels"]["gdn_mode"] == "replay" and "profile_ar_batch1" in res
    # the draft and verify graphs of batch 1, replayed alone: kernels and their time
    spec_prof = res["profile_spec_batch1"]
    assert set(spec_prof) == {"draft", "verify"}
    assert all(p["how"] == "graph replay" and p["kernels_per_step"] > 0 for p in spec_prof.values())
    assert "Profile of one speculative draft phase at batch 1" in (tmp_path / "results.md").read_text()
    # the default attention on CUDA is the Triton kernel; the ablation (no Triton kernels) runs SDPA
    assert res["attention"] == "triton" and res["ablation_ar_batch1_no_fused_kernels"]["attention"] == "sdpa"
    for N in ("1", "4"):
        row = res["batches"][N]
        assert row["gdn_mode"] == "replay" and list(row["other_gdn_modes"]) == ["native", "reference"]
        for mode, sub in speedup_gdn.mode_rows(row):
            x = sub["first_mode"]
            assert sub["lossless"] and x["ar_equals_first_mode_ar"] and x["spec_equals_first_mode_ar"], (N, mode)
            assert sub["gdn_layer"]["timed"] and sub["gdn_layer"]["total_us"] > 0
        assert (
            row["gdn_layer"]["spec_bytes_per_request"]
            < row["other_gdn_modes"]["native"]["gdn_layer"]["spec_bytes_per_request"]
        )
