"""`python -m eval.speedup` on the CPU: the whole command on micro models, its files and fields.

Speed is never asserted here (CPU timings of micro models mean nothing); what is checked is
that the command measures all three methods at every batch size, reports the fields the
benchmark page is built from, and that speculative output equals the runtime's AR output
(the lossless flag), and how a divergence would be reported.
"""

import gc
import importlib
import json
import math
import sys

import pytest
import torch

from dflash2.drafter import save_drafter
from dflash2.eval import speedup_cli
from dflash2.eval.speedup import first_divergence, row_divergences, weight_bytes
from dflash2.tokenizer import train_bpe_tokenizer

FAST = [
    "device=cpu",
    "dtype=float32",
    "runs=1",
    "copy_bytes=1048576",
    "hydra/job_logging=none",
    "hydra/hydra_logging=none",
]


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory, make_spec_target, make_spec_drafter):
    """A random hybrid (GDN) target with a BPE tokenizer and a DFlash2 drafter (B=4), saved as folders."""
    from dflash2.corpus import load_documents

    root = tmp_path_factory.mktemp("speedup")
    docs = load_documents([{"kind": "stdlib"}], "train", max_documents=10)
    tokenizer = train_bpe_tokenizer(docs, vocab_size=300, max_train_bytes=100_000)
    target = make_spec_target("qwen3_5", vocab_size=320)
    target.model.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    save_drafter(make_spec_drafter(target, 4, v2=True), root / "drafter")
    prompts = root / "prompts.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):"}\n{"prompt": "import os\\nimport sys"}\n')
    return root, prompts


def _cli(monkeypatch, *overrides):
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    monkeypatch.setattr(sys, "argv", ["eval.speedup", *overrides, *FAST])
    speedup_cli.main()


def _check(res, batches):
    assert res["copy_bandwidth_GBps"] > 0 and res["weight_bytes"] > 0 and res["bound_ms_per_step"] > 0
    P = res["num_prompts"]
    for N in batches:
        row = res["batches"][str(N)]
        # the runtime decodes every prompt in batches of N (cycled to N rows if fewer); HF the first batch.
        # Random weights: one batch of the first N prompts
        P = N if res["random_weights"] else P
        every = {"prompts": P, "rows": max(P, N), "batches": [N] * (max(P, N) // N)}
        assert row["ar"]["decoded"] == row["spec"]["decoded"] == every, (P, N)
        assert row["hf"]["decoded"] == {"prompts": min(P, N), "rows": N, "batches": [N]}
        for key in ("hf", "ar", "spec"):
            assert row[key]["ms_per_step"]["median"] > 0 and row[key]["tokens_per_s"]["median"] > 0
            assert "sequences" not in row[key]
        for key in ("ar", "spec"):  # per generation: its wall time, the part outside the decode steps
            r = row[key]
            outside, whole, mean = (r[k]["median"] for k in ("outside_steps_ms", "generation_ms", "mean_step_ms"))
            assert all(math.isfinite(v) for v in (outside, whole, mean)), r
            # the steps lie inside the generation's wall time, and it has steps: the rest is less than all of it
            assert 0 <= outside < whole and 0 < mean < whole
            assert r["outside_steps_ms"]["n"] == r["ms_per_step"]["n"]  # one figure per run
            spread = r["step_spread"]  # over every timed generation's steps (step_spread.py)
            pct = [spread["percentiles_ms"][k] for k in ("p10", "p50", "p90", "p99", "max")]
            assert pct == sorted(pct) and pct[0] > 0 and len(spread["mean_ms_by_quarter"]) == 4
            per_run = spread["per_run_ms"]  # one entry per timed run: a slow run shows apart from slow steps
            # (a mean may fall below p10 when a tenth of the steps are much faster: not an order to assert)
            assert len(per_run) == r["ms_per_step"]["n"] and all(0 < x["mean"] <= x["max"] for x in per_run)
            assert all(x["p10"] <= x["p50"] <= x["p90"] <= x["p99"] <= x["max"] for x in per_run)
            # spec: every verify step after a row's first falls in one group of the previous step's count
            groups = spread.get("mean_ms_by_previous_emitted")
            assert (groups is None) == (key == "ar")
            if groups:
                assert {int(n) for n in groups} <= set(range(1, res["block_size"] + 1))  # JSON keys: str
                assert all(g["steps"] > 0 for g in groups.values())
        assert set(row["spec"]["phases_ms"]) == {"draft", "verify", "accept", "commit", "gap"}
        assert {"verify", "accept", "commit"} <= set(row["ar"]["phases_ms"])
        assert row["spec"]["tau"] >= 1 and row["lossless"] is True and row["divergence"] is None
        assert row["ar_fraction_of_bound"] > 0 and row["verify_over_ar_step"] > 0
        assert all(row["hf_prefix_equals_ar"])  # fp32 on the CPU: HF greedy == runtime AR


def test_trained_pair_command_writes_results_and_is_lossless(pair_dirs, tmp_path, monkeypatch, caplog):
    from dflash2.eval import prompts as prompt_sets

    seen = []
    real_prompt_set = prompt_sets.prompt_set
    monkeypatch.setattr(prompt_sets, "prompt_set", lambda *a, **kw: seen.append(kw) or real_prompt_set(*a, **kw))
    assert importlib.import_module("eval.speedup").main is speedup_cli.main  # the `python -m` shim
    root, prompts = pair_dirs
    out = tmp_path / "out"
    _cli(
        monkeypatch,
        f"target={root / 'target'}",
        f"drafter={root / 'drafter'}",
        f"prompts={prompts}",
        "batch_sizes=[1,2]",
        "max_new_tokens=12",
        "hf_new_tokens=4",
        "hf_check_tokens=6",  # HF greedy of both prompts (one left-padded batch of 2) against every row
        "gdn_modes=reference",  # one mode, given as a plain value; the Triton modes: test_eval_speedup_gdn.py
        "prompts_per_document=2",  # reaches the prompt loader (held-out sets only; a file takes it and ignores it)
        f"paths.output_dir={out}",
    )
    res = json.loads((out / "results.json").read_text())
    _check(res, [1, 2])
    assert res["random_weights"] is False and res["block_size"] == 4 and res["num_prompts"] == 2
    assert res["prefill_graph_tokens"] == 0  # the default, resolved: eager prefill on the CPU
    assert "prompts: 2 of 16 prompts asked" in caplog.text  # the config's num_prompts, a 2-prompt file: said
    assert seen and all(kw["prompts_per_document"] == 2 for kw in seen)  # the override reaches the loader
    assert all(row["predicted"] == [] for row in res["batches"].values())  # a trained pair: measured only
    assert res["gdn"]["applicable"] and res["gdn"]["modes"] == ["reference"]  # the target is a hybrid
    assert all(row["gdn_mode"] == "reference" and "other_gdn_modes" not in row for row in res["batches"].values())
    check = res["hf_check"]  # fp32 on the CPU: HF greedy == runtime AR == runtime spec on every row
    assert (check["new_tokens"], check["batch_size"], check["prompts"]) == (6, 2, 2)
    for N in ("1", "2"):
        got = check["batches"][N]
        assert got["rows"] == got["ar_rows_equal"] == got["spec_rows_equal"] == 2, N
        assert got["ar_divergences"] == got["spec_divergences"] == []
        assert res["batches"][N]["hf_check_lossless"] is True
    md = (out / "results.md").read_text()
    assert "- batch 2: HF greedy vs runtime AR: 2/2 rows equal over 6 tokens; vs spec: 2/2" in md
    assert "| 2 | runtime spec (reference) | 2 prompts (1×2) |" in md and "lossless" in md
    assert "| 1 | runtime AR (reference) | 2 prompts (2×1) |" in md and "| 1 | HF generate | 1 prompt (1×1) |" in md
    assert "| mean step | outside steps / generation |" in md and "Prefill: eager." in md
    pytest.importorskip("matplotlib")
    assert (out / "step_breakdown.png").stat().st_size > 0


def test_random_shape_predicts_and_labels_it(tmp_path, monkeypatch):
    out = tmp_path / "out"
    overrides = ["shape=tiny", "batch_sizes=[1,2]", "max_new_tokens=10", "hf_new_tokens=3", "block_size=4"]
    more = ["drafter_layers=1", "prompt_tokens=6", "predict_taus=[2.5]", "hf_check_tokens=3"]
    _cli(monkeypatch, *overrides, *more, f"paths.output_dir={out}")
    res = json.loads((out / "results.json").read_text())
    _check(res, [1, 2])
    assert res["random_weights"] is True and "shape=tiny" in res["label"]
    assert res["num_prompts"] == 2  # max(batch_sizes) random prompts; batch 1 decoded only the first (_check)
    # the config's attention (default = triton) is recorded beside what ran: CPU tensors outside the
    # interpreter's on_cpu() run SDPA; no ablation row on the CPU
    assert res["attention_setting"] == "default" and res["attention"] == "sdpa"
    assert res["gemm_setting"] == "cublas" and res["gemm"] == "cublas"  # the default: F.linear
    assert "ablation_ar_batch1_no_fused_kernels" not in res
    (pred,) = res["batches"]["1"]["predicted"]
    assert pred["tau"] == 2.5 and pred["label"] == "prediction" and pred["speedup"] > 0
    md = (out / "results.md").read_text()
    assert "**prediction** at τ = 2.50" in md and ", attention sdpa;" in md
    # the HF greedy check is skipped on random weights, and says why
    assert res["hf_check"]["skipped"].startswith("random weights") and "HF greedy check (3 tokens): skipped" in md
    assert all(row["hf_check_lossless"] is None for row in res["batches"].values())
    # Qwen3 has no GDN layers: the config's modes are recorded as not applicable, the runtime runs once
    gdn = res["gdn"]
    assert gdn == {"applicable": False, "requested": ["replay", "native"], "reason": "the target has no GDN layers"}
    assert res["batches"]["1"]["gdn_mode"] is None and "other_gdn_modes" not in res["batches"]["1"]
    assert "| 1 | runtime spec |" in md and "not applicable" in md


def test_bucketed_prefill_is_passed_on_and_recorded(tmp_path, monkeypatch, capsys):
    """prefill_graph_tokens (and gc_pause) reach every Decoder (on the CPU: the padded prefill, eagerly), are
    recorded, and the run stays lossless; the per-batch line reports the time outside the steps."""
    from dflash2.runtime import Decoder

    made = []
    real_init = Decoder.__init__
    monkeypatch.setattr(Decoder, "__init__", lambda self, *a, **kw: made.append(kw) or real_init(self, *a, **kw))
    out = tmp_path / "out"
    frozen_before = gc.get_freeze_count() > 0  # the heap an image may start with (heap_frozen leaves it frozen)
    # 6-token prompts + 4 new + a block of 4 + 1 = 15 positions: the run must make room for the 16-wide bucket
    overrides = ["shape=tiny", "batch_sizes=[1]", "max_new_tokens=4", "hf_new_tokens=2", "block_size=4"]
    _cli(
        monkeypatch,
        *overrides,
        "drafter_layers=1",
        "prompt_tokens=6",
        "prefill_graph_tokens=16",
        "gc_pause=true",  # the collector switch rides along: it reaches every Decoder and the results
        "overlap_context=false",  # and so does the side stream's
        f"paths.output_dir={out}",
    )
    res = json.loads((out / "results.json").read_text())
    _check(res, [1])
    assert res["prefill_graph_tokens"] == 16 and made and all(kw["prefill_graph_tokens"] == 16 for kw in made)
    assert res["gc_pause"] is True and all(kw["gc_pause"] is True for kw in made)
    assert res["overlap_context"] is False and all(kw["overlap_context"] is False for kw in made)
    # frozen for the run; thawed after when the heap had nothing frozen before (else it stays frozen)
    assert res["gc_frozen_objects"] > 1000 and (gc.get_freeze_count() == 0 or frozen_before)
    # the collections during the run, counted and timed (the counting itself: tests/test_runtime_gc_watch.py),
    # reach results.json and the table's header
    stats = res["gc_collections"]
    assert set(stats) == {"gen0", "gen1", "gen2"} and all(s["max_ms"] <= s["total_ms"] for s in stats.values())
    g2 = stats["gen2"]
    assert f"gen 2: {g2['collections']} (longest {g2['max_ms']:.1f} ms" in (out / "results.md").read_text()
    md = (out / "results.md").read_text()
    assert res["batches"]["1"]["prefill_widths"] == [16]  # the bucketed prefill really ran, at width 16
    assert "Prefill: padded to a bucket for prompts ≤ 16 tokens, a CUDA graph on a GPU (longer: eager); " in md
    assert "bucket widths used: 16." in md and "Decode loops with Python's garbage collector paused." in md
    assert "The drafter's context K/V written in line after the last tapped target layer, not beside the rest." in md
    assert "Heap frozen after loading (" in md
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("batch 1"))
    assert "; outside steps AR " in line and " ms per generation" in line


def test_unknown_gdn_mode_is_one_line(pair_dirs, monkeypatch, capsys, tmp_path):
    root, prompts = pair_dirs
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        _cli(
            monkeypatch,
            f"target={root / 'target'}",
            f"drafter={root / 'drafter'}",
            f"prompts={prompts}",
            "batch_sizes=[1]",
            "gdn_modes=[replay,fastest]",
            f"paths.output_dir={out}",
        )
    err = capsys.readouterr().err  # checked before the pair loads: nothing else on stderr
    assert e.value.code == 2 and err.splitlines() == [
        "error: gdn_modes ['fastest'] not known; use some of ['auto', 'reference', 'replay', 'native']"
    ]
    assert not (out / "results.json").exists()


def test_unknown_attention_is_one_line(monkeypatch, capsys, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        _cli(monkeypatch, "shape=tiny", "attention=flash", f"paths.output_dir={out}")
    err = capsys.readouterr().err  # checked before the pair is built: nothing else on stderr
    assert e.value.code == 2 and err.splitlines() == [
        "error: attention=flash: attention backend 'flash' not known; use one of default, triton, sdpa, efficient"
    ]
    assert not (out / "results.json").exists()


def test_gemm_setting_and_what_ran_are_recorded(tmp_path, monkeypatch):
    from dflash2.runtime.gemm import gemm_backend

    out = tmp_path / "out"
    overrides = ["shape=tiny", "batch_sizes=[1]", "max_new_tokens=4", "hf_new_tokens=2", "block_size=4"]
    _cli(monkeypatch, *overrides, "gemm=skinny", "drafter_layers=1", "prompt_tokens=6", f"paths.output_dir={out}")
    res = json.loads((out / "results.json").read_text())
    # the setting beside what ran: CPU tensors outside the interpreter's on_cpu() run F.linear
    assert res["gemm_setting"] == "skinny" and res["gemm"] == "cublas"
    assert res["batches"]["1"]["lossless"] is True
    assert res["hf_check"] is None and res["batches"]["1"]["hf_check_lossless"] is None  # the default: off
    assert ", GEMM cublas, attention sdpa;" in (out / "results.md").read_text()
    assert gemm_backend() == "cublas"  # the command gives the process its setting back


def test_unknown_gemm_is_one_line(monkeypatch, capsys, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        _cli(monkeypatch, "shape=tiny", "gemm=cutlass", f"paths.output_dir={out}")
    assert e.value.code == 2 and capsys.readouterr().err.splitlines() == [
        "error: gemm=cutlass: GEMM backend 'cutlass' not known; use one of default, cublas, skinny"
    ]
    assert not (out / "results.json").exists()


def test_report_names_the_attention_that_ran():
    from dflash2.eval.speedup_report import markdown

    stat = {"median": 1.0, "min": 1.0, "max": 1.0}
    res = {
        "label": "x",
        "date": "d",
        "device": "H200",
        "dtype": "bfloat16",
        "block_size": 16,
        "weight_bytes": 1e9,
        "copy_bandwidth_GBps": 4000.0,
        "bound_ms_per_step": 0.5,
        "random_weights": True,
        "attention": "triton",
        "gemm": "skinny",
        "batches": {},
        "gdn": {"applicable": False, "requested": [], "reason": "the target has no GDN layers"},
        "ablation_ar_batch1_no_fused_kernels": {
            "ms_per_step": stat,
            "attention": "sdpa",
            "gdn_mode": None,
            "decoded": {"prompts": 1, "rows": 1, "batches": [1]},
        },
    }
    kernel = {"kernel": "_skinny_gemm_kernel", "us_per_step": 40.0, "calls_per_step": 10.0}
    prof = {"how": "graph replay", "kernels_per_step": 12.0, "kernel_us_per_step": 50.0, "gemm_us_per_step": 40.0}
    res["profile_spec_batch1"] = {"draft": {**prof, "top": [kernel]}}
    md = markdown(res)
    assert ", GEMM skinny (prefill > 128 rows: cuBLAS), attention triton (prefill: SDPA);" in md
    assert (
        "Profile of one speculative draft phase at batch 1 (graph replay): 12 kernels, 50 µs of kernel time, "
        "GEMM/GEMV 40 µs; top: `_skinny_gemm_kernel` 40.0 µs × 10." in md
    )
    assert (
        "without our Triton kernels (eager twins in the graphs, attention sdpa), decoded 1 prompt (1×1): "
        "1.000 [1.000–1.000]" in md
    )


def test_nothing_to_measure_is_one_line(monkeypatch, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        _cli(monkeypatch, f"paths.output_dir={tmp_path}")
    assert e.value.code == 2 and "shape=qwen3_8b" in capsys.readouterr().err


def test_divergence_names_both_tokens_and_their_margin(hf_targets):
    from dflash2.runtime import load_model

    model = load_model(hf_targets["qwen3"][1])
    prompts = [[5, 9, 2]]
    ref, got = [[7, 8, 9, 10]], [[7, 8, 11, 10]]
    d = first_divergence(model, prompts, ref, got)
    logits = model(torch.tensor([[5, 9, 2, 7, 8]]), model.new_state(1, 8)).logits[0, -1]
    assert (d["row"], d["position"], d["ar_token"], d["spec_token"]) == (0, 2, 9, 11)
    assert d["margin"] == pytest.approx(float(logits[9] - logits[11]), abs=1e-5)
    assert first_divergence(model, prompts, ref, ref) is None
    assert first_divergence(model, prompts, ref, [[7, 8]])["lengths"] == [4, 2]
    total = sum(p.numel() for p in model.parameters()) * 4
    assert weight_bytes(model) == total - model.embed.weight.numel() * 4  # untied: the table is not read


def test_row_divergences_names_every_differing_row(hf_targets):
    """Unlike first_divergence, every differing row (HF's check reports them all), its tokens named ref/got."""
    from dflash2.runtime import load_model

    model = load_model(hf_targets["qwen3"][1])
    prompts = [[5, 9, 2], [4, 4], [5, 9, 2]]  # row 2 repeats prompt 0
    ref = [[7, 8, 9, 10], [1, 2, 3], [7, 8, 9, 10]]
    got = [[7, 8, 11, 10], [1, 2, 3], [6, 8, 9, 10]]
    found = row_divergences(model, prompts, ref, got, prompt_index=[0, 1, 0])
    where = [(d["row"], d["prompt"], d["position"], d["ref_token"], d["got_token"]) for d in found]
    assert where == [(0, 0, 2, 9, 11), (2, 0, 0, 7, 6)]  # the equal row 1: none
    assert all(math.isfinite(d["margin"]) and math.isfinite(d["top2_margin"]) for d in found)
    assert all(d["dtype"] == "float32" and "ar_token" not in d and "spec_token" not in d for d in found)
    first = first_divergence(model, prompts, ref, got)  # the same logits as the first row's
    assert (found[0]["margin"], found[0]["logit_ref_token"]) == (first["margin"], first["logit_ar_token"])
    assert row_divergences(model, prompts, ref, ref) == []
    short = row_divergences(model, prompts[:1], ref[:1], [[7, 8]])  # a prefix: its lengths, no tokens
    assert short == [{"row": 0, "prompt": 0, "position": 2, "lengths": [4, 2]}]


def test_profile_counts_attention_apart_from_gemms():
    from dflash2.eval.speedup import is_gemm

    assert is_gemm("nvjet_sm90_tst_192x8_64x8_2x1_v_bz_TNT") and is_gemm("void cublasLt::splitKreduce_kernel<32>")
    assert not is_gemm("fmha_cutlassF_bf16_aligned_64x128_rf_sm80(PyTorchMemEffAttention::AttentionKernel)")
    assert not is_gemm("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x")
    assert not is_gemm("_add_rms_norm_kernel")
    assert is_gemm("_skinny_gemm_kernel") and is_gemm("_splitk_reduce_kernel")  # gemm=skinny's two kernels
