"""eval.speedup's step-time spread (dflash2/eval/step_spread.py) on hand-made step series."""

import math

from dflash2.eval.step_spread import by_previous_emitted, by_quarter, markdown_lines, percentiles, spread


def test_percentiles_pick_ranks_of_the_sorted_steps():
    ms = [float(v) for v in range(100, 0, -1)]  # 1..100 in reverse: the order must not matter
    assert percentiles(ms) == {"p10": 11.0, "p50": 51.0, "p90": 90.0, "p99": 99.0, "max": 100.0}
    assert percentiles([]) == {}
    assert percentiles([2.5]) == {"p10": 2.5, "p50": 2.5, "p90": 2.5, "p99": 2.5, "max": 2.5}


def test_quarters_follow_each_generation_own_length():
    # two generations of 8 and 4 steps whose step time is their quarter's number: every quarter is exact
    first = [1.0, 1.0, 2.0, 2.0, 3.0, 3.0, 4.0, 4.0]
    second = [1.0, 2.0, 3.0, 4.0]
    assert by_quarter([first, second]) == [1.0, 2.0, 3.0, 4.0]
    short = by_quarter([[5.0, 7.0]])  # 2 steps: quarters 1 and 3, the others empty
    assert short[0] == 5.0 and short[2] == 7.0 and math.isnan(short[1]) and math.isnan(short[3])


def test_steps_grouped_by_the_previous_steps_emitted_count():
    # batch of 2 rows: row 0 has 3 verify steps, row 1 has 2; the series has one lag step after the last
    steps = [10.0, 11.0, 12.0, 99.0]
    emitted = [[3, 1, 2], [1, 4]]
    # step 1: previous counts (3, 1) -> 3; step 2: (1, 4) -> 4; step 3 is the lag step (no row decoding): out
    assert by_previous_emitted([steps], [emitted]) == {
        3: {"mean_ms": 11.0, "steps": 1},
        4: {"mean_ms": 12.0, "steps": 1},
    }
    # batch 1: each step after the first keyed by its own row's previous count; groups pool over generations
    groups = by_previous_emitted([[5.0, 6.0, 8.0, 1.0], [5.0, 6.0, 1.0]], [[[1, 2, 1]], [[2, 2]]])
    assert groups == {1: {"mean_ms": 6.0, "steps": 1}, 2: {"mean_ms": 7.0, "steps": 2}}  # 8.0 and 6.0


def test_spread_and_its_markdown():
    ar = spread([[1.0, 1.0, 1.0, 2.0]])
    assert "mean_ms_by_previous_emitted" not in ar and ar["percentiles_ms"]["max"] == 2.0
    spec = spread([[3.0, 4.0, 5.0, 9.0]], [[[1, 2, 1]]])
    assert spec["mean_ms_by_previous_emitted"] == {1: {"mean_ms": 4.0, "steps": 1}, 2: {"mean_ms": 5.0, "steps": 1}}
    lines = markdown_lines({"batches": {"1": {"ar": {"step_spread": ar}, "spec": {"step_spread": spec}}}})
    table = [line for line in lines if line.startswith("| 1 |")]
    assert len(table) == 2 and "1: 4.000 (1), 2: 5.000 (1)" in table[1] and table[0].endswith("| — |")
    assert markdown_lines({"batches": {"1": {"ar": {}}}}) == []
