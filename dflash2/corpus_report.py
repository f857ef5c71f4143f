"""``python -m dflash2.corpus report``: is the held-out split clean?

    python -m dflash2.corpus report [--sources YAML] [--drafter DIR] [--validation-fraction F]
        [--heldout-fraction F] [--threshold T] [--max-file-bytes N] [--histogram] [--json PATH]

Prints the size of each split, the largest near-duplicate clusters and, for every
held-out document, the most similar train document with the estimated similarity
(the MinHash estimate the split rule uses) and the exact Jaccard index of their
shingle sets; then how many held-out documents the old key-only split would have
left with a train near-duplicate, and with ``--histogram`` the distribution of
every document's highest similarity to any other (the data behind the threshold,
docs/CORPUS.md). ``--sources`` is a YAML list like the ``data.sources`` config
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
KEY_SPLIT_EXAMPLES = 5
HISTOGRAM_BIN = 0.05
HISTOGRAM_MAX_DOCUMENTS = 20_000  # all pairs of a seeded sample of this many documents (O(n^2))


def split_report(
    sources,
    *,
    validation_fraction: float = 0.02,
    heldout_fraction: float = 0.02,
    near_duplicate_threshold: float = NEAR_DUPLICATE_THRESHOLD,
    max_file_bytes: int = 1_000_000,
    histogram: bool = False,
) -> dict:
    """Split sizes, clusters and each held-out document's most similar train document, as a JSON-able dict.

    Also what the old key-only split would have leaked, and with ``histogram`` the distribution
    of every document's highest similarity to any other (the data behind the threshold).
    """
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
    by_key = {
        name: [d for d in docs if split_of(d.key, validation_fraction, heldout_fraction) == name] for name in SPLITS
    }
    key_split_leaks = [
        row
        for row in _nearest_train(by_key["heldout"], by_key["train"])
        if row["similarity"] > near_duplicate_threshold
    ]
    report = {
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
        "key_split_leaks": {"documents": len(key_split_leaks), "examples": key_split_leaks[:KEY_SPLIT_EXAMPLES]},
    }
    if histogram:
        report["similarity_distribution"] = similarity_distribution(docs)
    return report


def similarity_distribution(docs) -> dict:
    """Histogram of each document's highest similarity to any other, and percentiles over all pairs."""
    if len(docs) > HISTOGRAM_MAX_DOCUMENTS:
        pick = np.random.default_rng(0).choice(len(docs), HISTOGRAM_MAX_DOCUMENTS, replace=False)
        docs = [docs[i] for i in sorted(pick)]
    sigs = np.stack([document_signature(d.text) for d in docs])
    n, num_perm = sigs.shape
    highest = np.zeros(n)
    pair_counts = np.zeros(num_perm + 1, dtype=np.int64)  # estimates are multiples of 1 / num_perm: count each
    for start in range(0, n, 512):  # blocks of rows keep memory at 512 x n
        block = similarity(sigs[start : start + 512], sigs)
        rows = start + np.arange(len(block))
        block[np.arange(len(block)), rows] = -1.0  # not the document itself
        highest[rows] = block.max(axis=1)
        later = block[np.arange(n)[None, :] > rows[:, None]]  # each pair once
        pair_counts += np.bincount(np.rint(later * num_perm).astype(np.int64), minlength=num_perm + 1)
    edges = np.round(np.arange(0.0, 1.0 + HISTOGRAM_BIN, HISTOGRAM_BIN), 2)
    counts, _ = np.histogram(highest, bins=edges)
    cumulative = np.cumsum(pair_counts) / max(pair_counts.sum(), 1)
    return {
        "documents": n,
        "highest_similarity_histogram": [
            {"from": float(lo), "to": float(hi), "documents": int(c)} for lo, hi, c in zip(edges, edges[1:], counts)
        ],
        "all_pairs": int(pair_counts.sum()),
        "all_pairs_percentiles": {
            str(q): round(int(np.searchsorted(cumulative, q / 100)) / num_perm, 4) for q in (50, 90, 99, 99.9)
        },
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
    leaks = report["key_split_leaks"]
    examples = ", ".join(f"{r['key']} -> {r['nearest_train']} {r['similarity']:.2f}" for r in leaks["examples"])
    lines.append(
        f"the key-only split (before near-duplicate grouping) would leave {leaks['documents']} held-out documents "
        f"above the threshold{': ' + examples if examples else ''}"
    )
    if "similarity_distribution" in report:
        lines += _format_distribution(report["similarity_distribution"])
    lines.append(
        f"FAIL: {len(bad)} held-out documents are more similar than {threshold} to a train document"
        if bad
        else f"OK: no held-out document is more similar than {threshold} to any train document"
    )
    return "\n".join(lines)


def _format_distribution(dist: dict) -> list[str]:
    lines = ["", f"each document's highest similarity to any other ({dist['documents']:,} documents):"]
    bins = dist["highest_similarity_histogram"]
    closing = [")"] * (len(bins) - 1) + ["]"]  # numpy's last bin includes its upper edge
    lines += [f"  [{b['from']:.2f}, {b['to']:.2f}{c}  {b['documents']:>6,}" for b, c in zip(bins, closing)]
    pct = ", ".join(f"p{q} {v:.3f}" for q, v in dist["all_pairs_percentiles"].items())
    lines.append(f"all {dist['all_pairs']:,} pairs: {pct}")
    return lines


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
    rep.add_argument("--histogram", action="store_true", help="also the distribution of nearest-document similarity")
    rep.add_argument("--json", help="also write the report as JSON to this file")
    args = parser.parse_args(argv)
    try:
        settings = _settings(args)
        report = split_report(settings.pop("sources"), **settings, histogram=args.histogram)
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
