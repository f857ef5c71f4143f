"""``python -m dflash2.corpus report``: is the held-out split clean?

    python -m dflash2.corpus report [--sources YAML] [--drafter DIR] [--validation-fraction F]
                                    [--heldout-fraction F] [--threshold T] [--max-file-bytes N] [--json PATH]

Prints the size of each split, the largest near-duplicate clusters and, for every
held-out document, the most similar train document with the estimated similarity
(the MinHash estimate the split rule uses) and the exact Jaccard index of their
shingle sets. ``--sources`` is a YAML list like the ``data.sources`` config
(default: the stdlib); ``--drafter`` takes sources and settings from the data
split a trained drafter recorded. Exit status 1 when a held-out document is more
similar than the threshold to a train document (the split rule rules that out:
this is the check), 2 on a user error.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

from dflash2.corpus import (
    NEAR_DUPLICATE_THRESHOLD,
    SPLITS,
    cluster_keys,
    document_signature,
    document_splits,
    load_documents,
    resolved_sources,
    split_of,
)
from dflash2.errors import DFlash2Error
from dflash2.near_duplicates import jaccard, shingles, similarity

LARGEST_CLUSTERS = 5


def split_report(
    sources,
    *,
    validation_fraction: float = 0.02,
    heldout_fraction: float = 0.02,
    near_duplicate_threshold: float = NEAR_DUPLICATE_THRESHOLD,
    max_file_bytes: int = 1_000_000,
) -> dict:
    """Split sizes, clusters and each held-out document's most similar train document, as a JSON-able dict."""
    settings = {
        "validation_fraction": validation_fraction,
        "heldout_fraction": heldout_fraction,
        "near_duplicate_threshold": near_duplicate_threshold,
        "max_file_bytes": max_file_bytes,
    }
    start = time.perf_counter()
    splits = document_splits(sources, **settings)
    seconds = time.perf_counter() - start
    docs = load_documents(sources, None, max_file_bytes=max_file_bytes)
    by_split = {name: [d for d in docs if splits[d.key] == name] for name in SPLITS}
    roots = cluster_keys(sources, near_duplicate_threshold=near_duplicate_threshold, max_file_bytes=max_file_bytes)
    sizes = Counter(roots.values())
    largest = sorted(((n, root) for root, n in sizes.items() if n > 1), key=lambda x: (-x[0], x[1]))
    heldout = _nearest_train(by_split["heldout"], by_split["train"])
    validation = _nearest_train(by_split["validation"], by_split["train"])
    return {
        "sources": resolved_sources(sources),
        "settings": settings,
        "seconds_to_split": round(seconds, 2),
        "splits": {
            name: {"documents": len(ds), "mb": round(sum(len(d.text.encode("utf-8", "replace")) for d in ds) / 1e6, 2)}
            for name, ds in by_split.items()
        },
        "clusters": {
            "with_several_documents": len(largest),
            "documents_in_them": sum(n for n, _ in largest),
            "largest": [
                {"documents": n, "smallest_key": root, "split": split_of(root, validation_fraction, heldout_fraction)}
                for n, root in largest[:LARGEST_CLUSTERS]
            ],
        },
        "heldout": heldout,
        "validation_highest": validation[0] if validation else None,
        "above_threshold": [row for row in heldout if row["similarity"] > near_duplicate_threshold],
    }


def _nearest_train(docs, train) -> list[dict]:
    """For each document: the most similar train document (estimate), and their exact Jaccard; most similar first."""
    if not docs or not train:
        return []
    sims = similarity(
        np.stack([document_signature(d.text) for d in docs]), np.stack([document_signature(d.text) for d in train])
    )
    rows = []
    for doc, row in zip(docs, sims):
        best = int(row.argmax())
        rows.append(
            {
                "key": doc.key,
                "nearest_train": train[best].key,
                "similarity": round(float(row[best]), 4),
                "exact_jaccard": round(jaccard(shingles(doc.text), shingles(train[best].text)), 4),
            }
        )
    return sorted(rows, key=lambda r: (-r["similarity"], r["key"]))


def format_report(report: dict) -> str:
    s = report["settings"]
    lines = [
        f"corpus: {report['sources']}",
        f"split: near-duplicate threshold {s['near_duplicate_threshold']}, validation {s['validation_fraction']}, "
        f"heldout {s['heldout_fraction']} ({report['seconds_to_split']:.1f} s)",
        "",
        f"{'split':<12}{'documents':>10}{'MB':>9}",
    ]
    lines += [f"{name:<12}{v['documents']:>10,}{v['mb']:>9.2f}" for name, v in report["splits"].items()]
    c = report["clusters"]
    largest = ", ".join(f"{x['documents']} ({x['smallest_key']}, {x['split']})" for x in c["largest"])
    lines += [
        "",
        f"near-duplicate clusters of 2+ documents: {c['with_several_documents']} "
        f"({c['documents_in_them']} documents); largest: {largest or 'none'}",
        "",
        "held-out document -> most similar train document (estimated similarity / exact Jaccard):",
    ]
    threshold = s["near_duplicate_threshold"]
    for r in report["heldout"]:
        flag = "  ABOVE THRESHOLD" if r["similarity"] > threshold else ""
        lines.append(f"  {r['similarity']:.2f} / {r['exact_jaccard']:.2f}  {r['key']} -> {r['nearest_train']}{flag}")
    v = report["validation_highest"]
    if v:
        lines.append(
            f"validation: highest similarity to train {v['similarity']:.2f} ({v['key']} -> {v['nearest_train']})"
        )
    bad = report["above_threshold"]
    lines.append(
        f"FAIL: {len(bad)} held-out documents are more similar than {threshold} to a train document"
        if bad
        else f"OK: no held-out document is more similar than {threshold} to any train document"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dflash2.corpus", description=__doc__.split("\n\n")[2])
    sub = parser.add_subparsers(dest="command", required=True)
    rep = sub.add_parser("report", help="split sizes and each held-out document's most similar train document")
    rep.add_argument("--sources", help="YAML list like data.sources, e.g. '[{kind: stdlib}]' (default: the stdlib)")
    rep.add_argument("--drafter", help="a trained drafter folder: use the data split it recorded")
    rep.add_argument("--validation-fraction", type=float)
    rep.add_argument("--heldout-fraction", type=float)
    rep.add_argument("--threshold", type=float, help=f"near-duplicate threshold (default {NEAR_DUPLICATE_THRESHOLD})")
    rep.add_argument("--max-file-bytes", type=int)
    rep.add_argument("--json", help="also write the report as JSON to this file")
    args = parser.parse_args(argv)
    try:
        settings = _settings(args)
        report = split_report(settings.pop("sources"), **settings)
    except DFlash2Error as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    if report["above_threshold"]:
        sys.exit(1)


def _settings(args) -> dict:
    """Sources and split settings: the drafter's record, the defaults, then any explicit flag."""
    from dflash2.data.split_record import DEFAULT_RECORD, read_training_data

    record = read_training_data(args.drafter) if args.drafter else dict(DEFAULT_RECORD)
    if args.sources is not None:
        import yaml

        try:
            record["sources"] = yaml.safe_load(args.sources)
        except yaml.YAMLError as e:
            raise DFlash2Error(f"--sources is not valid YAML ({str(e).splitlines()[0]})") from None
    for flag, key in (
        ("validation_fraction", "validation_fraction"),
        ("heldout_fraction", "heldout_fraction"),
        ("threshold", "near_duplicate_threshold"),
        ("max_file_bytes", "max_file_bytes"),
    ):
        if getattr(args, flag) is not None:
            record[key] = getattr(args, flag)
    return {
        "sources": record["sources"],
        "validation_fraction": float(record["validation_fraction"]),
        "heldout_fraction": float(record["heldout_fraction"]),
        "near_duplicate_threshold": float(record["near_duplicate_threshold"]),
        "max_file_bytes": int(record["max_file_bytes"]),
    }
