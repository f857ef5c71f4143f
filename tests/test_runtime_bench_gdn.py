"""Smoke test of the GDN verify + rollback benchmark (dflash2/runtime/bench_gdn.py) on CPU.

The numbers mean nothing here (interpreted kernels, tiny shapes); what is checked: the
script runs end to end for ReplaySSM (deferred commit), ReplaySSM with the eager fold, native
and reference at two batch sizes, the speculative-state bytes it measures from the logs match
the shape formula, that formula gives the issue's memory target at the Qwen3.5-9B shape (≥ 20×
less than native), and the sweep's kernel options reach their kernels in every mode.
"""

import json

import pytest
import torch

from dflash2.runtime.bench_gdn import GDNShape, Row, main, measure, median_run, report, spec_bytes
from dflash2.runtime.kernels.triton_util import interpreting


@pytest.mark.skipif(not interpreting(), reason="CPU tensors need TRITON_INTERPRET=1")
def test_bench_runs_on_cpu(tmp_path, capsys):
    out = tmp_path / "gdn.json"
    args = ["--device", "cpu", "--tiny", "--batch", "1", "2", "--block", "3", "--iters", "1", "--warmup", "0"]
    modes = ("replay", "replay_eager", "native", "reference")
    rows = main([*args, "--dtype", "float32", "--modes", *modes, "--out", str(out)])
    assert [(r.batch, r.mode) for r in rows] == [(b, m) for b in (1, 2) for m in modes]
    tiny = GDNShape.tiny()
    for r in rows:
        assert r.total_us > 0 and r.total_us == pytest.approx(r.verify_us + r.commit_us)
        # the reference and the eager ReplaySSM log what ReplaySSM logs; the deferred commit adds its
        # pending counts and stash
        layout = "native" if r.mode == "native" else "replay"
        assert r.spec_bytes_per_request == spec_bytes(tiny, 3, layout, x_itemsize=4, deferred=r.mode == "replay")
    printed = capsys.readouterr().out
    assert "native ÷ replay" in printed and "| 2 | native |" in printed and "replay_eager ÷ replay" in printed
    assert out.exists()


def test_repeats_report_the_median_run_and_the_spread(capsys):
    args = ["--device", "cpu", "--tiny", "--batch", "1", "--block", "2", "--iters", "1", "--warmup", "0"]
    two = ["--options", "{}", "--options", '{"stages": 2}']
    rows = main([*args, "--modes", "replay", "--repeats", "3", *two])
    assert [(r.batch, r.mode, r.kernel_options) for r in rows] == [(1, "replay", {}), (1, "replay", {"stages": 2})]
    for r in rows:
        assert r.runs == 3 and r.total_min_us <= r.total_us <= r.total_max_us
    printed = capsys.readouterr().out
    assert printed.count(" over 3 runs |") == 2
    with pytest.raises(SystemExit):
        main([*args, "--repeats", "0"])
    with pytest.raises(SystemExit):
        main([*args, "--repeats", "2", "--sweep"])


def test_median_run_picks_the_middle_total():
    runs = [_row(t) for t in (5.0, 1.0, 3.0, 4.0)]
    m = median_run(runs)
    assert (m.total_us, m.runs, m.total_min_us, m.total_max_us) == (3.0, 4, 1.0, 5.0)  # the lower middle of 4
    assert median_run([_row(2.0)]).total_us == 2.0


def _row(total: float) -> Row:
    return Row(1, "replay", total - 0.5, 0.5, total, 1, 1, {})


def test_speculative_state_at_the_9b_shape():
    """24 GDN layers, 16 key / 32 value heads of 128, block 16, bf16 inputs: ~15 MiB vs ~774 MiB."""
    shape = GDNShape.qwen3_5_9b()
    assert (shape.num_layers, shape.num_k_heads, shape.num_v_heads, shape.head_k_dim, shape.head_v_dim) == (
        24,
        16,
        32,
        128,
        128,
    )
    replay, native = spec_bytes(shape, 16, "replay", deferred=True), spec_bytes(shape, 16, "native")
    assert native / replay >= 20
    # the deferred commit's own memory: counts of 32·128/16 programs per layer, each layer's k / g stash
    assert replay - spec_bytes(shape, 16, "replay") == 24 * (256 * 4 + 16 * (16 * 128 + 32) * 4)
    assert native == 24 * (16 * 32 * 128 * 128 * 4 + 16 * 8192 * 2)  # 16 fp32 states + x per layer


@pytest.mark.skipif(not interpreting(), reason="CPU tensors need TRITON_INTERPRET=1")
def test_every_kernel_option_of_the_sweep_reaches_its_kernel(monkeypatch):
    """The sweep's options (the recurrence tile and warps, the prep's warps and tokens per program, the
    one-launch form) run in every Triton mode: each kernel takes the ones it has (the commit kernel has no
    prep_warps); the chunked recurrence's own knobs reach its launch."""
    from dflash2.runtime.kernels.gdn_verify import one_launch

    one = []
    launch_one = one_launch.launch_one_launch
    monkeypatch.setattr(one_launch, "launch_one_launch", lambda *a, **kw: one.append(kw) or launch_one(*a, **kw))
    for options in (dict(block_v=2, num_warps=2, prep_warps=2, block_t=1), dict(one_launch=True, block_t=1)):
        for mode in ("replay", "replay_eager", "native"):
            one.clear()
            kw = dict(dtype=torch.float32, device="cpu", iters=1, warmup=0, kernel_options=options)
            row = measure(GDNShape.tiny(), 1, 2, mode, **kw)
            assert row.total_us > 0 and row.kernel_options == options, mode
            # one_launch: every verify is the one kernel, with the prep's chunks of block_t tokens
            assert bool(one) == ("one_launch" in options) and all(k["block_t"] == 1 for k in one), mode
    # the chunked recurrence's own knobs (a 2-token block: one-token verifies keep the sequential walk)
    from dflash2.runtime.kernels.gdn_verify import chunk_kernel

    launches = []
    launch = chunk_kernel.launch_chunk_recur
    monkeypatch.setattr(chunk_kernel, "launch_chunk_recur", lambda *a, **kw: launches.append(kw) or launch(*a, **kw))
    options = dict(chunked=True, chunk_block_v=8, chunk_warps=2, chunk_block_k=16)
    for mode in ("replay", "replay_eager"):
        launches.clear()
        row = measure(
            GDNShape.tiny(), 1, 2, mode, dtype=torch.float32, device="cpu", iters=1, warmup=0, kernel_options=options
        )
        assert row.total_us > 0 and row.kernel_options == options, mode
        assert launches and all(
            (kw["chunk_block_v"], kw["num_warps"], kw["block_k"]) == (8, 2, 16) for kw in launches
        ), mode


def test_targets_are_checked_on_each_modes_fastest_row():
    # two option sets per mode: the summary lines use the faster one, whatever the order of the rows
    def row(mode, total, options):
        return Row(1, mode, total - 1.0, 1.0, total, 100 if mode == "replay" else 5000, 10, options)

    rows = [row("replay", 20.0, {}), row("replay", 16.0, {"chunked": True}), row("native", 30.0, {})]
    text = report(rows, 16)
    assert "native ÷ replay time 1.88×" in text and "replay 16.0 µs per GDN layer" in text
    assert "fastest row" in text
    assert "fastest row" not in report(rows[1:], 16)  # one row per (batch, mode): nothing to say


@pytest.mark.skipif(not interpreting(), reason="CPU tensors need TRITON_INTERPRET=1")
def test_another_gdn_shape_from_json(capsys):
    dims = dict(num_layers=1, num_k_heads=2, num_v_heads=4, head_k_dim=6, head_v_dim=5, conv_kernel=3)
    args = ["--device", "cpu", "--batch", "1", "--block", "2", "--iters", "1", "--warmup", "0", "--dtype", "float32"]
    rows = main([*args, "--modes", "replay", "--shape", json.dumps(dims)])
    assert len(rows) == 1 and rows[0].spec_bytes_per_request == spec_bytes(
        GDNShape(**dims), 2, "replay", x_itemsize=4, deferred=True
    )
    assert "'num_v_heads': 4" in capsys.readouterr().out  # the shape printed is the one given
    with pytest.raises(SystemExit):
        main([*args, "--tiny", "--shape", json.dumps(dims)])
    with pytest.raises(SystemExit):  # a field missing: argparse's one-line error, not a traceback
        main([*args, "--shape", json.dumps({"num_layers": 1})])
    assert "--shape" in capsys.readouterr().err
