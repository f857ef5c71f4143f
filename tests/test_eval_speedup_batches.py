"""`eval.speedup` decodes every prompt at every batch size (dflash2/eval/speedup.py) on the CPU.

At batch size N the runtime rows run the prompts as consecutive batches of N (the last one holding
the rest, at its own size), or, with fewer prompts than N, one batch of the prompts cycled to N rows.
Checked on micro models: 3 prompts at batch 2 decode all 3 in 2 batches, τ and the verify steps are
those of the batches together, the progress bar counts batches, and a divergence in the second batch
(or in a repeated row) is reported with its row over all batches and its prompt. Speed is never
asserted.
"""

import dataclasses

import pytest
from conftest import nontrivial_dflash2, spec_drafter
from test_runtime_engine import TAPS, _prompt

from dflash2.decoding.decoder import SpecResult
from dflash2.eval import speedup
from dflash2.eval.speedup import _concat, prompt_rows, run_speedup, split_batches, time_runtime
from dflash2.eval.speedup_report import markdown
from dflash2.eval.speedup_setup import Pair
from dflash2.runtime import Decoder, RuntimeDrafter, load_model
from dflash2.target import TargetModel

B = 4
N_NEW = 9
PROMPTS = [_prompt(5, 1), _prompt(8, 2), _prompt(3, 3)]  # ragged: each batch pads to its own longest


def _pair(hf_targets, kind):
    """A runtime target of ``kind`` and a DFlash2 drafter off its init, as the Pair run_speedup measures."""
    hf, folder = hf_targets[kind]
    model = load_model(folder, target_layer_ids=TAPS)
    drafter = nontrivial_dflash2(spec_drafter(TargetModel(hf, target_layer_ids=TAPS), B, v2=True, seed=3))
    return Pair(None, model, RuntimeDrafter(drafter, model), PROMPTS, f"{kind}, 3 prompts", False)


@pytest.fixture(scope="module")
def dense(hf_targets):
    return _pair(hf_targets, "qwen3")


@pytest.fixture(scope="module")
def hybrid(hf_targets):
    return _pair(hf_targets, "qwen3_5")


def test_rows_and_batches_cover_every_prompt():
    assert split_batches(prompt_rows(3, 2), 2) == [[0, 1], [2]]  # the last batch holds the rest
    assert split_batches(prompt_rows(3, 1), 1) == [[0], [1], [2]]
    assert split_batches(prompt_rows(4, 2), 2) == [[0, 1], [2, 3]]
    assert split_batches(prompt_rows(3, 4), 4) == [[0, 1, 2, 0]]  # fewer prompts than N: cycled, one batch


def test_tau_of_several_batches_is_over_all_their_rows():
    """Tokens emitted by verify steps / verify steps of every row, not the mean of the batches' τ (the
    micro models' random drafters rarely get a draft accepted, so the runs below have τ = 1)."""
    fast = SpecResult([[7] * 9], [[3, 3]], [[4, 4]], 4)  # τ 4 over 2 steps
    slow = SpecResult([[7] * 5] * 2, [[0] * 4] * 2, [[1] * 4] * 2, 4)  # τ 1 over 8 steps
    both = _concat([fast, slow])
    assert both.mean_tau == pytest.approx((8 + 8) / (2 + 8)) and sum(both.steps) == 10
    assert both.sequences == fast.sequences + slow.sequences


class _Count:
    """A progress bar that counts its updates."""

    n = 0

    def update(self, k):
        self.n += k


def test_three_prompts_at_batch_two_decode_all_three_in_two_batches(dense):
    dec = Decoder(dense.target, dense.drafter, max_len=32)
    bar = _Count()
    spec = time_runtime(dec, PROMPTS, N_NEW, runs=2, spec=True, progress=bar, batch_size=2)
    ar = time_runtime(dec, PROMPTS, N_NEW, runs=1, spec=False, progress=bar, batch_size=2)
    assert bar.n == 2 * 2 + 1 * 2  # one per timed batch: 2 runs of spec, 1 of AR, 2 batches each
    assert spec["decoded"] == ar["decoded"] == {"prompts": 3, "rows": 3, "batches": [2, 1]}
    assert spec["sequences"] == ar["sequences"] == dec.generate_ar(PROMPTS, N_NEW)  # all rows, prompts' order
    assert all(len(s) == N_NEW for s in spec["sequences"])
    # τ and steps are the batches' together: tokens emitted by verify steps / verify steps over all rows
    first, second = dec.generate_spec(PROMPTS[:2], N_NEW), dec.generate_spec(PROMPTS[2:], N_NEW)
    steps = sum(first.steps) + sum(second.steps)
    emitted = sum(e for res in (first, second) for row in res.emitted for e in row)
    assert spec["steps"] == steps and spec["tau"] == pytest.approx(emitted / steps)
    assert spec["ms_per_step"]["median"] > 0 and spec["tokens_per_s"]["median"] > 0
    assert set(spec["phases_ms"]) == {"draft", "verify", "accept", "commit", "gap"}
    assert "tau" not in ar and ar["decoded"]["batches"] == [2, 1]


def _corrupting(size: int, row: int):
    """A Decoder whose speculative output is one token off at position 3 of ``row`` in every batch of ``size``
    rows: a lossless bug in one batch, at a known place."""

    class Corrupting(Decoder):
        def generate_spec(self, prompts, *args, **kw):
            res = super().generate_spec(prompts, *args, **kw)
            if len(prompts) == size:
                seq = res.sequences[row]
                seq[3] = (seq[3] + 1) % self.model.vocab_size
            return res

    return Corrupting


def _run(pair, N, tmp_path=None, hf_check_tokens=0):
    return run_speedup(
        pair,
        batch_sizes=[N] if isinstance(N, int) else N,
        max_new_tokens=N_NEW,
        hf_new_tokens=0,
        hf_check_tokens=hf_check_tokens,
        runs=1,
        copy_bytes=1 << 20,
        gdn_modes=["reference"],
        gdn_bench_iters=1,
        output_dir=tmp_path,
        log=lambda _: None,
    )


@pytest.mark.parametrize(
    "N, size, row, where, text",
    [
        (2, 1, 0, {"row": 2, "prompt": 2}, "3 prompts (2+1)"),  # the second batch's only row: prompt 2
        (4, 4, 3, {"row": 3, "prompt": 0}, "4 rows from 3 prompts (1×4)"),  # row 3 repeats prompt 0
    ],
)
def test_a_divergence_names_its_row_over_all_batches_and_its_prompt(
    hybrid, monkeypatch, tmp_path, N, size, row, where, text
):
    """On the hybrid in the reference GDN mode, so the cross-mode comparison (with the first mode's AR)
    sees the same divergence as the lossless flag."""
    monkeypatch.setattr(speedup, "Decoder", _corrupting(size, row))
    res = _run(hybrid, N, tmp_path)
    assert res["num_prompts"] == 3
    got = res["batches"][str(N)]
    assert got["spec"]["decoded"]["batches"] == got["ar"]["decoded"]["batches"]
    d = got["divergence"]
    assert got["lossless"] is False and {k: d[k] for k in where} == where and d["position"] == 3
    assert d["spec_token"] == (d["ar_token"] + 1) % hybrid.target.vocab_size
    x = got["first_mode"]
    assert x["ar_equals_first_mode_ar"] and not x["spec_equals_first_mode_ar"]
    assert x["spec_divergence"]["row"] == d["row"] and x["spec_divergence"]["prompt"] == d["prompt"]
    md = markdown(res)
    assert f"| {N} | runtime spec (reference) | {text} |" in md and "FALSE" in md
    assert (tmp_path / "results.md").read_text() == md


def test_every_row_equal_is_lossless(dense):
    """The same run without the corruption: lossless over both batches, on a target without GDN layers."""
    res = _run(dense, 2)
    got = res["batches"]["2"]
    assert got["lossless"] is True and got["divergence"] is None
    assert got["spec"]["decoded"] == {"prompts": 3, "rows": 3, "batches": [2, 1]}
    assert got["spec"]["tau"] >= 1 and got["spec"]["steps"] > 0


def test_hf_greedy_check_covers_every_row_of_every_batch_size(dense, hf_targets):
    """hf_check_tokens > 0: HF greedy of the 3 ragged prompts once (left-padded, one batch: max(batch_sizes)
    = 4) against every AR and spec row at batch 1 (3 batches), 2 (2+1) and 4 (cycled: row 3 is prompt 0);
    fp32 on the CPU, so all equal."""
    res = _run(dataclasses.replace(dense, hf=hf_targets["qwen3"][0]), [1, 2, 4], hf_check_tokens=6)
    check = res["hf_check"]
    assert (check["new_tokens"], check["batch_size"], check["prompts"]) == (6, 4, 3)
    for N, rows in (("1", 3), ("2", 3), ("4", 4)):
        got = check["batches"][N]
        assert got == {
            "rows": rows,
            "ar_rows_equal": rows,
            "spec_rows_equal": rows,
            "ar_divergences": [],
            "spec_divergences": [],
        }
        assert res["batches"][N]["hf_check_lossless"] is True
    assert "- batch 4: HF greedy vs runtime AR: 4/4 rows equal over 6 tokens; vs spec: 4/4" in markdown(res)


def test_hf_greedy_check_reports_a_divergent_row(dense, hf_targets, monkeypatch):
    """A spec row one token off at position 3 (the second row of a batch of 2): the check names that row
    and its prompt, HF's token beside the runtime's, with a finite margin; AR still equals HF. More tokens
    asked than decoded: compared over max_new_tokens."""
    monkeypatch.setattr(speedup, "Decoder", _corrupting(2, 1))
    res = _run(dataclasses.replace(dense, hf=hf_targets["qwen3"][0]), 2, hf_check_tokens=N_NEW + 5)
    check = res["hf_check"]
    got = check["batches"]["2"]
    assert check["new_tokens"] == N_NEW and got["rows"] == got["ar_rows_equal"] == 3 and got["ar_divergences"] == []
    (d,) = got["spec_divergences"]
    assert (d["row"], d["prompt"], d["position"]) == (1, 1, 3) and got["spec_rows_equal"] == 2
    assert d["got_token"] == (d["ref_token"] + 1) % dense.target.vocab_size and d["margin"] > 0
    assert res["batches"]["2"]["hf_check_lossless"] is False
    md = markdown(res)
    assert "- batch 2: HF greedy vs runtime AR: 3/3 rows equal over 9 tokens; vs spec: 2/3" in md
    assert f"  - spec row 1 (prompt 1): position 3, HF {d['ref_token']} vs {d['got_token']}, margin " in md
