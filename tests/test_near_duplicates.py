"""MinHash signatures, complete LSH banding and clusters (dflash2/near_duplicates.py)."""

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import subprocess_env

from dflash2.near_duplicates import (
    NUM_PERM,
    band_rows,
    cluster_roots,
    jaccard,
    linked_pairs,
    shingles,
    signature,
    signatures,
    similarity,
)

REPO = Path(__file__).resolve().parents[1]


def _text(rng: random.Random, lines: int = 40) -> str:
    return "\n".join(f"v{rng.getrandbits(40):x} = f({rng.getrandbits(30)})" for _ in range(lines))


def test_estimate_tracks_exact_jaccard():
    """Copies with a growing share of lines rewritten: the estimate stays within 4 standard errors."""
    rng = random.Random(0)
    base = _text(rng, 200).splitlines()
    for share in (0.0, 0.1, 0.3, 0.5, 0.7, 0.9):
        copy = "\n".join(_text(rng, 1) if rng.random() < share else line for line in base)
        exact = jaccard(shingles("\n".join(base)), shingles(copy))
        estimate = similarity(signature("\n".join(base))[None], signature(copy)[None])[0, 0]
        assert abs(estimate - exact) < 4 * np.sqrt(exact * (1 - exact) / NUM_PERM) + 1e-9, (share, exact, estimate)


def test_whitespace_is_normalized_and_short_texts_work():
    code = "def f(x):\n    return x + 1\n"
    reindented = "def f(x):\r\n\treturn   x + 1"
    assert (signature(code) == signature(reindented)).all()
    assert signature("x").shape == (NUM_PERM,) and (signature("x") == signature("x ")).all()
    assert not (signature("x = 1") == signature("y = 2")).all()


def test_signatures_agree_across_processes():
    texts = ["import os\nprint(os.getcwd())\n", "é" * 50, "a"]
    code = (
        "import json,sys; from dflash2.near_duplicates import signatures; "
        "print(json.dumps(signatures(json.loads(sys.argv[1])).tolist()))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(texts)],
        env=subprocess_env(PYTHONHASHSEED="7"),
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert json.loads(out) == signatures(texts).tolist()


@pytest.mark.parametrize("threshold", [0.3, 0.5, 0.6, 0.7, 0.8, 0.9])
def test_banding_never_misses_a_pair_above_the_threshold(threshold):
    """Adversarial pairs: the disagreeing values are spread one per band where possible."""
    r = band_rows(threshold)
    fewest = int(np.floor(threshold * NUM_PERM)) + 1  # agreeing values of the least similar linked pair
    rng = np.random.default_rng(0)
    a = rng.integers(0, 2**32, NUM_PERM, dtype=np.uint32)
    b = a.copy()
    spread = np.r_[np.arange(0, NUM_PERM, r), np.setdiff1d(np.arange(NUM_PERM), np.arange(0, NUM_PERM, r))]
    b[spread[: NUM_PERM - fewest]] ^= 1  # NUM_PERM - fewest values disagree
    assert (a == b).sum() == fewest
    assert linked_pairs(np.stack([a, b]), threshold).tolist() == [[0, 1]]
    b[spread[NUM_PERM - fewest]] ^= 1  # one more disagreement: at or below the threshold
    assert linked_pairs(np.stack([a, b]), threshold).tolist() == []


def test_clusters_equal_those_of_all_pairs():
    """Families of near-copies, exact copies and unrelated texts: LSH + union-find == brute force."""
    rng = random.Random(1)
    texts = []
    for _ in range(40):
        base = _text(rng).splitlines()
        for _ in range(rng.randint(1, 4)):
            share = rng.choice([0.05, 0.2, 0.4, 0.6])
            texts.append("\n".join(_text(rng, 1) if rng.random() < share else line for line in base))
    texts += texts[:5]  # exact copies
    sigs = signatures(texts)
    sims = similarity(sigs, sigs)
    np.fill_diagonal(sims, 0)
    brute = cluster_roots(len(texts), np.argwhere(np.triu(sims > 0.5)))
    assert (cluster_roots(len(texts), linked_pairs(sigs, 0.5)) == brute).all()
    assert 1 < len(set(brute.tolist())) < len(texts)  # some grouping, not one blob
    assert all(brute[len(texts) - 5 + i] == brute[i] for i in range(5))
    assert linked_pairs(sigs, 1.0).size == 0  # threshold 1: nothing exceeds it, not even a copy


def test_cluster_roots_is_the_smallest_index():
    roots = cluster_roots(6, np.array([[4, 2], [2, 5], [1, 3]]))
    assert roots.tolist() == [0, 1, 2, 1, 2, 2]
