"""`python -m eval.speedup temperature=...`: T>0 speed on the CPU path (no speed asserted here).

At T>0 every method samples, so tokens of two methods are not compared: the lossless flag is
n/a, and the runtime's T>0 distribution is the chi-square tests' job (test_runtime_sampling.py).
What is checked: the sampling settings reach every method and the results, sampled runs are
reproducible from the seed, and bad settings are a one-line error.
"""

import json

import pytest
import torch
from test_eval_speedup import _cli

from dflash2.eval.speedup import time_runtime
from dflash2.eval.speedup_setup import random_pair
from dflash2.runtime import Decoder

SAMPLED = {"temperature": 0.8, "top_k": 20, "top_p": 0.9}


def test_sampled_run_reports_speed_and_tau_without_a_token_comparison(tmp_path, monkeypatch):
    out = tmp_path / "out"
    overrides = ["shape=tiny", "batch_sizes=[1]", "max_new_tokens=10", "hf_new_tokens=3", "block_size=4"]
    sampling = [f"{k}={v}" for k, v in SAMPLED.items()]
    _cli(monkeypatch, *overrides, *sampling, "drafter_layers=1", "prompt_tokens=6", "seed=3", f"paths.output_dir={out}")
    res = json.loads((out / "results.json").read_text())
    assert res["sampling"] == SAMPLED
    row = res["batches"]["1"]
    for key in ("hf", "ar", "spec"):
        assert row[key]["tokens_per_s"]["median"] > 0
    assert row["spec"]["tau"] >= 1
    assert row["lossless"] is None and row["divergence"] is None and "hf_prefix_equals_ar" not in row
    assert "n/a (sampled)" in (out / "results.md").read_text()


def test_a_sampled_generation_is_reproducible_from_the_seed_and_differs_across_seeds():
    pair = random_pair(
        "tiny",
        dtype=torch.float32,
        device=torch.device("cpu"),
        block_size=4,
        drafter_layers=1,
        batch=2,
        prompt_tokens=6,
        seed=0,
    )
    dec = Decoder(pair.target, pair.drafter, max_len=64)
    runs = {}
    for seed in (1, 1, 2):
        res = time_runtime(dec, pair.prompts, 24, runs=1, spec=True, sampling=SAMPLED, seed=seed)
        runs.setdefault(seed, []).append(res["sequences"])
    assert runs[1][0] == runs[1][1]
    assert runs[1][0] != runs[2][0]


@pytest.mark.parametrize("bad", ["temperature=-1", "top_p=0", "top_k=-2"])
def test_bad_sampling_settings_are_one_line(bad, monkeypatch, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        _cli(monkeypatch, "shape=tiny", bad, f"paths.output_dir={tmp_path}")
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "temperature" in err[0]
