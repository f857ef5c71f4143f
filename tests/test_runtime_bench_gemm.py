"""Smoke test of the skinny GEMM benchmark (dflash2/runtime/bench_gemm.py) on CPU.

The times mean nothing here (Triton's interpreter, tiny shapes); what is checked: the script runs
end to end for cuBLAS's two layouts (here: PyTorch's CPU matmul), the kernel's default plan and a
two-entry sweep (a split-K with the fused reduction among them), every output agrees with the fp32
twin, the kernel's rows are batch invariant, and the JSON has a row per shape, method and M.
"""

import json

import pytest

from dflash2.runtime.bench_gemm import QUICK_SWEEP, TINY, main
from dflash2.runtime.kernels.triton_util import interpreting


@pytest.mark.skipif(not interpreting(), reason="CPU tensors need TRITON_INTERPRET=1")
def test_bench_runs_on_cpu(tmp_path, capsys):
    out = tmp_path / "gemm.json"
    rows = main(["--device", "cpu", "--quick", "--iters", "1", "--warmup", "0", "--out", str(out)])
    methods = ["cublas", "cublas_t", "skinny"] + [
        "skinny:" + ",".join(f"{k}={v}" for k, v in c.items()) for c in QUICK_SWEEP
    ]
    assert [(r.shape, r.method, r.M) for r in rows] == [(s, m, M) for s in TINY for m in methods for M in (1, 3)]
    for r in rows:
        assert r.us > 0 and r.weight_bytes == r.N * r.K * 2
        assert r.max_abs_diff < 0.05  # bf16 outputs of magnitude ~1 vs the fp32 twin
        assert bool(r.plan) == r.method.startswith("skinny")
        if r.method.startswith("skinny"):
            assert r.batch_invariant
    printed = capsys.readouterr().out
    assert "| tiny_a | 45 x 83 | 3 |" in printed and "best options" in printed
    assert len(json.loads(out.read_text())["rows"]) == len(rows)
