"""The drafter-training throughput benchmark (issue 15, item 6): the tiny CPU run end to end, the
model-FLOP counter against hand computations and against the matmuls a real step executes, and a
variant that runs out of memory."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dflash2.drafter.config import DrafterConfig
from dflash2.drafter.masks import dense_block_mask
from dflash2.training import bench_throughput as bt
from dflash2.training.throughput_flops import (
    attended_pairs,
    drafter_attention_flops,
    drafter_linear_flops,
    lm_head_flops,
    step_flops,
    target_forward_flops,
)
from dflash2.training.throughput_setup import random_target, synthetic_rows

TINY = ["--shape", "tiny", "--device", "cpu", "--threads", "1"]


def toy_config(**kw) -> DrafterConfig:
    """d 32, 4 query / 2 K/V heads of 8, MLP 48, 2 layers, 3 taps of 32, block 4, conv groups of 8
    (G = 4, kernel 2), selector rank 16, vocab 100."""
    fields = dict(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=100,
        target_hidden_size=32,
        target_layer_ids=[0, 1, 2],
        block_size=4,
        mask_token_id=99,
        use_local_conv=True,
        conv_kernel_size=2,
        conv_group_size=8,
        use_selector=True,
        selector_rank=16,
        selector_top_k=4,
        max_position_embeddings=64,
        rope_theta=10000.0,
    )
    return DrafterConfig(**{**fields, **kw})


# ------------------------------------------------------------------------------------ FLOP counter
def test_flop_counter_matches_a_hand_computation():
    """2 rows, L = 20, 2 anchor slots each: anchors [3, 10] and [5, (padding)]."""
    config = toy_config()
    anchors = torch.tensor([[3, 10], [5, 1]])
    valid = torch.tensor([[True, True], [True, False]])
    # rows multiplied: context 2·20 = 40; block tokens 2·2·4 = 16; drafted positions M = 2·2·3 = 12
    # per layer: k,v 6·(2·32·2·8 = 1024)·(40+16) = 344,064; q,o,MLP 6·(2·32·4·8 + 3·32·48 = 6656)·16 = 638,976;
    #            conv projections 6·2·(32·2·2·4 = 512)·16 = 98,304  -> 1,081,344, two layers 2,162,688
    # fc 4·(3·32·32 = 3072)·40 = 491,520; selector 4·(32·16 = 512)·12 = 24,576
    assert drafter_linear_flops(config, rows=2, context_len=20, anchor_slots=2) == 2_678_784
    # pairs: row 0: 4·(4+3) + 4·(4+10) = 84; row 1: 4·(4+5) + 4·(4+0, padding) = 52 -> 136
    assert attended_pairs(anchors, valid, 4) == 136
    assert drafter_attention_flops(config, 136) == 12 * 4 * 8 * 136 * 2 == 104_448
    assert lm_head_flops(32, 100, 12) == 4 * 32 * 100 * 12 == 153_600
    # target: weights/layer 2·32·32 + 2·32·16 + 3·32·48 = 7680; linear 2·7680·40 = 614,400;
    # causal attention 4·4·8·(2·20·21/2 = 420) = 53,760; 3 layers -> 3·668,160
    text = SimpleNamespace(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=48,
        num_hidden_layers=3,
    )
    assert target_forward_flops(text, rows=2, seq=20) == 2_004_480
    online = step_flops(config, rows=2, context_len=20, anchors=anchors, anchor_valid=valid, target_text_config=text)
    assert (online.drafter_linear, online.drafter_attention, online.lm_head) == (2_678_784, 104_448, 153_600)
    assert online.target_forward == 2_004_480
    assert online.excluding_target == 2_936_832 and online.total == 4_941_312
    assert step_flops(config, rows=2, context_len=20, anchors=anchors, anchor_valid=valid).target_forward == 0


def test_flop_counter_without_the_dflash2_additions():
    """v1 (no conv, no selector): only the conv and selector terms go."""
    config = toy_config(use_local_conv=False, use_selector=False)
    # 2,678,784 - 2 layers·98,304 (conv) - 24,576 (selector)
    assert drafter_linear_flops(config, rows=2, context_len=20, anchor_slots=2) == 2_457_600


def test_attended_pairs_count_the_dense_mask():
    g = torch.Generator().manual_seed(0)
    anchors = torch.randint(0, 40, (3, 7), generator=g)
    valid = torch.rand(3, 7, generator=g) > 0.3
    assert attended_pairs(anchors, valid, 5) == int(dense_block_mask(anchors, valid, 48, 5).sum())


def test_linear_count_equals_the_matmuls_a_training_step_runs():
    """The counter's drafter linear FLOPs = the aten.mm FLOPs of one real training step + backward
    (tiny shape, dense, plain CE, offline taps), less the selector's greedy path for the metrics
    (a no-grad hidden_projection of every drafted position: 2·d·r·M), which is not counted."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import flop_registry

    class Matmuls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.flops = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func._overloadpacket in flop_registry:
                self.flops[str(func._overloadpacket)] += flop_registry[func._overloadpacket](
                    *args, **(kwargs or {}), out_val=out
                )
            return out

    a = bt.parse_args(TINY)
    bench = bt.build_bench(a, torch.device("cpu"))
    runner = bt.StepRunner(bench, bt.Variant("dense", "plain", "offline"), total_steps=4)
    keys = torch.tensor([[0, r] for r in range(bench.rows)])
    counted = Matmuls()
    with pytest.warns(UserWarning, match="self.log"), counted:
        runner.module.training_step({**bench.batches["offline"], "anchor_keys": keys}, 0).backward()
    config = bench.drafter.config
    linear = drafter_linear_flops(config, rows=bench.rows, context_len=bench.seq, anchor_slots=a.anchors)
    greedy = 2 * config.hidden_size * config.selector_rank * bench.rows * a.anchors * (config.block_size - 1)
    assert counted.flops["aten.mm"] + counted.flops["aten.addmm"] == linear + greedy


def test_target_count_equals_the_matmuls_of_its_forward():
    """tap_features' linear layers: 2 x decoder linear weights x tokens, the causal attention apart."""
    target = random_target("tiny", torch.device("cpu"), seed=0)
    text = target.text_config
    ids = torch.randint(0, 200, (2, 16))
    with torch.utils.flop_counter.FlopCounterMode(display=False) as fc:
        target.tap_features(ids)
    mm = sum(v for k, v in fc.get_flop_counts()["Global"].items() if str(k) in ("aten.mm", "aten.addmm"))
    h = text.head_dim
    attention = text.num_hidden_layers * 4 * text.num_attention_heads * h * (2 * 16 * 17 // 2)
    assert mm == target_forward_flops(text, rows=2, seq=16) - attention
    weights = sum(m.weight.numel() for m in target.language_model.layers.modules() if isinstance(m, torch.nn.Linear))
    assert mm == 2 * weights * 2 * 16


# ---------------------------------------------------------------------------------- the tiny run
@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    trace = out.parent / "step_trace.json"
    profile = ["--profile", "--profile-top", "12", "--profile-trace", str(trace)]
    results = bt.run([*TINY, "--peak-tflops", "0.01", *profile, "--out", str(out)])
    return results, json.loads(out.read_text())


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_tiny_run_writes_every_row_and_the_environment(tiny_run, capsys):
    results, saved = tiny_run
    assert saved["rows"] == json.loads(json.dumps(results["rows"]))
    assert saved["command"].startswith("python -m dflash2.training.bench_throughput --shape tiny")
    assert saved["date"] and saved["mfu_formula"].startswith("MFU = model FLOPs per step")
    env = saved["environment"]
    assert env["torch"] == torch.__version__ and "triton" in env and env["device"] == "cpu"
    s = saved["settings"]
    assert (s["rows"], s["seq"], s["block_size"], s["anchors"], s["drafter_layers"]) == (2, 64, 4, 8, 5)
    assert s["taps"] and s["loss_chunk_positions"] == 1024 and s["target_dtype"] == "float32"
    assert saved["peak_flops"] == pytest.approx(0.01e12)
    names = [r["variant"] for r in saved["rows"]]
    assert names[0] == "flex / chunked CE / offline" and len(set(names)) == 8  # the headline row first


def test_tiny_run_skips_flex_on_the_cpu_and_measures_the_rest(tiny_run):
    _, saved = tiny_run
    by_status = Counter(r["status"] for r in saved["rows"])
    assert by_status == {"skipped": 4, "ok": 4}
    for r in saved["rows"]:
        if r["attention"] == "flex":
            assert r["status"] == "skipped" and r["note"] == bt.FLEX_ON_CPU
            continue
        ms = r["step_ms"]
        assert all(_positive(ms[k]) for k in ("median", "min", "max")) and ms["min"] <= ms["median"] <= ms["max"]
        assert len(r["step_ms_samples"]) == 2 and len(r["warmup_step_ms"]) == 1
        # every anchor valid: 2 rows x 8 anchors x (B-1 = 3); 2 rows x 64 sequence tokens
        assert r["drafted_tokens_per_step"] == 48 and r["sequence_tokens_per_step"] == 128
        assert r["drafted_tokens_per_s"] == pytest.approx(48 / (ms["median"] / 1e3))
        assert r["sequence_tokens_per_s"] == pytest.approx(128 / (ms["median"] / 1e3))
        assert r["peak_memory_gib"] is None  # no CUDA allocator on the CPU
        f = r["flops_per_step"]
        assert all(_positive(f[k]) for k in ("drafter_linear", "drafter_attention", "lm_head", "total"))
        assert f["total"] == f["excluding_target"] + f["target_forward"]
        assert _positive(r["mfu"]) and _positive(r["mfu_excl_target"]) and _positive(r["model_tflops_per_s"])
        assert r["mfu"] == pytest.approx(f["total"] / (ms["median"] / 1e3) / 0.01e12)
        if r["features"] == "offline":
            assert f["target_forward"] == 0 and r["mfu"] == r["mfu_excl_target"]
        else:
            assert f["target_forward"] > 0 and r["mfu"] > r["mfu_excl_target"]
        assert r["loss_chunk_positions"] == (1024 if r["ce"] == "chunked" else 0)


def test_tiny_run_profiles_one_step(tiny_run):
    _, saved = tiny_run
    prof = saved["profile"]
    assert prof["variant"] == "dense / chunked CE / offline"  # the headline (flex) cannot run on the CPU
    assert len(prof["rows"]) == 12 and _positive(prof["step_ms"]) and _positive(prof["total_ms"])  # --profile-top 12
    times = [r["ms"] for r in prof["rows"]]
    assert times == sorted(times, reverse=True) and all(r["calls"] >= 1 for r in prof["rows"])
    assert "aten::mm" in {r["name"] for r in prof["rows"]}
    assert "ops" not in prof  # the operator view needs kernels: a GPU's
    trace = json.loads(Path(prof["trace"]).read_text())  # --profile-trace: the step's Chrome trace
    assert any(e.get("name") == "aten::mm" for e in trace["traceEvents"])
    assert f"Chrome trace of the step: {prof['trace']}" in bt.report_text(tiny_run[0])


def test_tiny_run_prints_the_table(tiny_run):
    results, _ = tiny_run
    text = bt.report_text(results)
    assert (
        "| variant | step ms | drafted tok/s | seq tok/s | peak GiB | TFLOP/s | MFU | MFU excl. target | status |"
        in text
    )
    assert "| dense / plain CE / online |" in text and "MFU = model FLOPs per step" in text
    assert "Top " in text and "`aten::mm`" in text


# ------------------------------------------------------------------------------------------ OOM
def test_a_variant_out_of_memory_is_a_row_and_the_next_one_runs(monkeypatch, tmp_path):
    real = bt.measure

    def measure(bench, variant, *args, **kw):
        if variant.ce == "chunked":
            # half-way through a step: gradients exist on the shared drafter when it fails
            runner = bt.StepRunner(bench, variant, total_steps=2)
            runner.step(0)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 37.00 GiB")
        return real(bench, variant, *args, **kw)

    monkeypatch.setattr(bt, "measure", measure)
    freed, real_free = [], bt.free_memory

    def free_memory(bench):
        real_free(bench)
        freed.append(bench)

    monkeypatch.setattr(bt, "free_memory", free_memory)
    out = tmp_path / "oom.json"
    results = bt.run([*TINY, "--attention", "dense", "--features", "offline", "--out", str(out)])
    rows = {r["ce"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["chunked"]["status"] == "OOM" and "Tried to allocate 37.00 GiB" in rows["chunked"]["note"]
    assert rows["plain"]["status"] == "ok" and _positive(rows["plain"]["step_ms"]["median"])
    assert len(freed) == 1 and all(p.grad is None for p in freed[0].drafter.parameters())
    assert "| dense / chunked CE / offline |  |" in bt.report_text(results)
    assert "| OOM: CUDA out of memory. Tried to allocate 37.00 GiB |" in bt.report_text(results)


def test_bad_choices_are_one_line_errors():
    with pytest.raises(bt.DFlash2Error, match="--attention='sparse'"):
        bt.parse_args([*TINY, "--attention", "sparse"])
    with pytest.raises(bt.DFlash2Error, match="--prompt-tokens=63"):
        synthetic_rows(1, 64, 63, 100, 99, 0)


def test_profile_options_are_checked():
    from dflash2.errors import DFlash2Error

    with pytest.raises(DFlash2Error, match="--profile-top=0 must be >= 1"):
        bt.parse_args([*TINY, "--profile", "--profile-top", "0"])
    with pytest.raises(DFlash2Error, match="add --profile"):
        bt.parse_args([*TINY, "--profile-trace", "t.json"])
