"""The training kernels' micro-benchmark (dflash2/training/bench_kernels.py) on tiny shapes: every operation
and path gets a row with positive times, a tile sweep leaves the module's tile as it was, and bad arguments are
one-line errors. Under the interpreter on the CPU (the ``interpret`` fixture): the figures mean nothing there."""

from __future__ import annotations

import json

import pytest

from dflash2.errors import DFlash2Error
from dflash2.training import bench_kernels as bk

TINY = ["--device", "cpu", "--positions", "64", "--hidden", "32", "--heads", "2", "--head-dim", "16", "--iters", "1"]


def test_every_operation_and_path_gets_a_row(tmp_path, interpret, monkeypatch):
    from dflash2.drafter import conv_kernels as ck

    monkeypatch.setattr(bk, "WARMUP", 0)  # interpreted kernels: one timed call each is enough here
    kept = (ck.BLOCK_ROWS, ck.BLOCK_CHANNELS, ck.WARPS)
    out = tmp_path / "kernels.json"
    results = bk.run([*TINY, "--conv-tiles", "8x64x4,16x32x4", "--out", str(out)])
    assert kept == (ck.BLOCK_ROWS, ck.BLOCK_CHANNELS, ck.WARPS)  # the sweep put the tile back
    assert json.loads(out.read_text())["rows"] == results["rows"]
    paths = {(r["op"], r["x"], r["path"]) for r in results["rows"]}
    for x in ("float32", "bfloat16"):
        assert {("conv side", x, p) for p in ("torch", "kernels 8x64x4", "kernels 16x32x4")} <= paths
    norms = [r for r in results["rows"] if r["op"] == "rms norm"]
    assert len(norms) == 6 and {r["path"] for r in norms} == {"torch", "kernels"}
    assert all(r["forward_us"] > 0 and r["forward_backward_us"] > 0 for r in results["rows"])
    text = bk.table(results)
    assert (
        "| conv side | float32 | kernels 8x64x4 |" in text and "| rms norm | (64, 2, 16) bfloat16 | kernels |" in text
    )


def test_bad_arguments_are_one_line_errors():
    with pytest.raises(DFlash2Error, match="expected ROWSxCHANNELSxWARPS"):
        bk.run([*TINY, "--conv-tiles", "8x64"])
    with pytest.raises(DFlash2Error, match="powers of two"):
        bk.run([*TINY, "--conv-tiles", "8x48x4"])
    with pytest.raises(DFlash2Error, match="--positions must be a multiple of 32"):
        bk.parse_args([*TINY[:2], "--positions", "40"])
    assert len(bk.SWEEP) == 24
