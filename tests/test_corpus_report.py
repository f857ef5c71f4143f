"""`python -m dflash2.corpus report`: split sizes and the held-out documents' nearest train documents."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import subprocess_env, write_near_copy_families

from dflash2 import corpus_report
from dflash2.corpus import split_of
from dflash2.data.split_record import training_data_record

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return root, write_near_copy_families(root)


def _args(root, *extra):
    return ["report", "--sources", f"[{{kind: dir, path: '{root}', name: fam}}]", "--heldout-fraction", "0.2", *extra]


def test_report_lists_every_heldout_document_and_passes(family_dir, tmp_path, capsys):
    root, families = family_dir
    corpus_report.main(_args(root, "--json", str(tmp_path / "r.json")))
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "r.json").read_text())
    sizes = report["splits"]
    assert sum(v["documents"] for v in sizes.values()) == 4 * len(families) + 100
    assert len(report["heldout"]) == sizes["heldout"]["documents"] > 0
    assert report["above_threshold"] == [] and "OK: no held-out document" in out
    assert report["clusters"]["with_several_documents"] == len(families)  # one cluster per family
    assert all(row["similarity"] <= 0.5 and 0 <= row["exact_jaccard"] < 0.5 for row in report["heldout"])
    assert all(row["key"] in out and row["nearest_train"] in out for row in report["heldout"])
    assert report["key_split_leaks"]["documents"] > 0  # splitting by key alone scatters the families


def test_histogram_separates_near_copies_from_unrelated_documents(family_dir):
    root, families = family_dir
    dist = corpus_report.split_report([{"kind": "dir", "path": str(root), "name": "fam"}], histogram=True)[
        "similarity_distribution"
    ]
    bins = dist["highest_similarity_histogram"]
    assert sum(b["documents"] for b in bins if b["from"] >= 0.5) == 4 * len(families)  # every copy has a sibling
    assert sum(b["documents"] for b in bins if b["to"] <= 0.2) == 100  # the unrelated files have none
    n = 4 * len(families) + 100
    assert dist["documents"] == n and dist["all_pairs"] == n * (n - 1) // 2
    assert dist["all_pairs_percentiles"]["50"] < 0.1


def test_report_flags_the_old_key_split(family_dir, monkeypatch, capsys):
    """With splits by key alone (the old rule) near-copies straddle: the report says so and exits 1."""
    root, _ = family_dir

    def key_split(sources, *, validation_fraction, heldout_fraction, **_):
        keys = corpus_report.cluster_keys(sources, near_duplicate_threshold=1.0)
        return {k: split_of(k, validation_fraction, heldout_fraction) for k in keys}

    monkeypatch.setattr(corpus_report, "document_splits", key_split)
    with pytest.raises(SystemExit) as exit_info:
        corpus_report.main(_args(root))
    assert exit_info.value.code == 1
    out = capsys.readouterr().out
    assert "ABOVE THRESHOLD" in out and "FAIL:" in out


def test_report_command_runs_and_bad_sources_are_one_line(family_dir, capsys):
    root, _ = family_dir
    run = subprocess.run(
        [sys.executable, "-m", "dflash2.corpus", *_args(root)],
        env=subprocess_env(),
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    assert "heldout" in run.stdout and "OK: no held-out document" in run.stdout
    with pytest.raises(SystemExit) as exit_info:
        corpus_report.main(["report", "--sources", "[{kind: dir, path: /no/such/dir}]"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: corpus directory '/no/such/dir' does not exist") and "\n" not in err


def test_report_of_a_drafter_uses_its_recorded_split(family_dir, tmp_path, capsys):
    root, families = family_dir
    record = training_data_record(
        {
            "sources": [{"kind": "dir", "path": str(root), "name": "fam"}],
            "validation_fraction": 0.1,
            "heldout_fraction": 0.3,
            "near_duplicate_threshold": 0.5,
        },
        seed=0,
    )
    (tmp_path / "config.json").write_text(json.dumps({"dflash2": {"training_data": record}}))
    corpus_report.main(["report", "--drafter", str(tmp_path), "--json", str(tmp_path / "r.json")])
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["sources"] == record["sources"] and report["settings"]["heldout_fraction"] == 0.3
    assert sum(v["documents"] for v in report["splits"].values()) == 4 * len(families) + 100
    assert "OK: no held-out document" in capsys.readouterr().out
