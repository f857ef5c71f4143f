"""The notebooks of notebooks/ run end to end on CPU and produce what they claim (issue 5).

Each notebook is executed in memory with nbclient (the files in notebooks/ are never
rewritten), in a fresh python3 kernel whose cwd is the repo root and whose PYTHONPATH
starts with it, so the kernel imports this checkout's dflash2. The checks read the
outputs: the ``SUMMARY {json}`` line the last cell prints, and the image/png outputs
of the cells tagged ``plot``.
"""

from __future__ import annotations

import json
import os
import shutil
from itertools import pairwise
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"


def execute(name: str):
    """Run notebooks/<name> in a fresh kernel; returns the executed notebook (in memory only)."""
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "WANDB_MODE": "offline",
        "MPLBACKEND": "module://matplotlib_inline.backend_inline",
    }
    # kernel_name="python3": ipykernel ships this kernelspec (and jupyter_client falls back to the
    # running interpreter's ipykernel for it), so no `ipykernel install` is needed on a clean machine.
    client = nbclient.NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
    )
    try:
        client.execute(env=env)
    finally:  # the notebook prints its temp working dir; remove it (runs, cache) once executed
        for cell in nb.cells:
            for line in stream_text(cell).splitlines() if cell.cell_type == "code" else []:
                if line.startswith("working dir: "):
                    shutil.rmtree(line.removeprefix("working dir: ").strip(), ignore_errors=True)
    return nb


def stream_text(cell) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", []) if o.get("output_type") == "stream")


def summary_of(nb) -> dict:
    last = [c for c in nb.cells if c.cell_type == "code"][-1]
    lines = [line for line in stream_text(last).splitlines() if line.startswith("SUMMARY ")]
    assert len(lines) == 1, f"the last cell must print one SUMMARY line, got: {stream_text(last)!r}"
    return json.loads(lines[0].removeprefix("SUMMARY "))


def check_common(nb):
    codes = [c for c in nb.cells if c.cell_type == "code"]
    assert "torch.set_num_threads(1)" in codes[0].source
    # the kernel imported this checkout's package, not another installed copy
    assert str(ROOT / "dflash2") in stream_text(codes[0])
    for cell in codes:
        errors = [o for o in cell.outputs if o.get("output_type") == "error"]
        assert not errors, f"cell failed: {errors}"
    plots = [c for c in codes if "plot" in c.metadata.get("tags", [])]
    assert plots, "no cell tagged 'plot'"
    for cell in plots:
        images = [
            o
            for o in cell.outputs
            if o.get("output_type") in ("display_data", "execute_result") and "image/png" in o.get("data", {})
        ]
        assert images, f"plot cell produced no image/png:\n{cell.source[:200]}"


def test_train_and_measure_tau_notebook():
    nb = execute("01_train_and_measure_tau.ipynb")
    check_common(nb)
    s = summary_of(nb)
    B = s["block_size"]
    assert B >= 2
    assert 1.0 <= s["tau"] <= B
    assert s["lossless"] is True
    assert s["steps"] == 6  # trainer.max_steps of the notebook's micro run
    rates = s["per_position_acceptance"]
    assert len(rates) == B - 1 and all(0.0 <= r <= 1.0 for r in rates)
    assert all(a >= b for a, b in pairwise(rates)), "per-position acceptance must be non-increasing"
    assert s["mean_accepted_drafts"] == pytest.approx(sum(rates))
    assert s["tau"] <= 1.0 + sum(rates) + 1e-9  # τ counts emitted tokens: a cut last step emits fewer
    assert s["verify_steps"] > 0
    assert 1.0 <= s["train_tau_measured"] <= B and s["train_tau_lossless"] is True  # train.py's own result


def test_acceptance_analysis_notebook():
    nb = execute("02_acceptance_analysis.ipynb")
    check_common(nb)
    s = summary_of(nb)
    B = s["block_size"]
    assert len([c for c in nb.cells if "plot" in c.metadata.get("tags", [])]) >= 2  # curves + histograms
    for v in ("dflash", "dflash2"):
        r = s[v]
        assert 1.0 <= r["tau"] <= B
        assert r["lossless"] is True
        hist = r["accepted_drafts_histogram"]
        assert len(hist) == B and sum(hist) == r["steps"] > 0
        assert r["mean_accepted_drafts"] == pytest.approx(sum(a * n for a, n in enumerate(hist)) / r["steps"])
        assert r["tau"] <= 1.0 + r["mean_accepted_drafts"] + 1e-9
        cats = s["fail_categories"][v]
        assert set(cats) == {"whitespace", "identifier-like", "punctuation", "number", "other", "cut off"}
        assert all(n >= 0 for n in cats.values())
        rejecting_steps = r["steps"] - hist[B - 1]  # steps that did not accept all B-1 drafts
        assert sum(cats.values()) == rejecting_steps
