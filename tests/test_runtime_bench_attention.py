"""Smoke test of the decode-attention benchmark (dflash2/runtime/bench_attention.py) on CPU.

The times mean nothing here (Triton's interpreter, tiny shapes); what is checked: the script
runs end to end for the three backends, every backend's output agrees with the fp32 twin,
the K/V byte count follows the shapes, and the JSON has a row per configuration and backend.
"""

import json

import pytest

from dflash2.runtime.bench_attention import AttnShape, main
from dflash2.runtime.kernels.triton_util import interpreting


@pytest.mark.skipif(not interpreting(), reason="CPU tensors need TRITON_INTERPRET=1")
def test_bench_runs_on_cpu(tmp_path, capsys):
    out = tmp_path / "attn.json"
    args = ["--device", "cpu", "--tiny", "--batch", "1", "2", "--block", "1", "3", "--cached", "5", "--iters", "1"]
    rows = main([*args, "--warmup", "0", "--dtype", "float32", "--out", str(out)])
    configs = [(b, t) for b in (1, 2) for t in (1, 3)]
    assert [(r.batch, r.T, r.backend) for r in rows] == [
        (b, t, k) for b, t in configs for k in ("sdpa", "efficient", "triton")
    ]
    tiny = AttnShape.tiny()
    for r in rows:
        assert r.us_per_call > 0 and r.max_abs_diff < 1e-5
        assert r.kv_len == 256  # 5 + T rounded up to the engine's graph bucket
        assert r.kv_bytes == 2 * r.batch * tiny.num_kv_heads * (5 + r.T) * tiny.head_dim * 4
        assert bool(r.options) == (r.backend == "triton")
    printed = capsys.readouterr().out
    assert "| 2 | 3 | 5 | 256 | triton |" in printed and "sdpa ÷ triton" in printed
    assert len(json.loads(out.read_text())["rows"]) == len(rows)
