"""Near-duplicate documents: MinHash signatures, LSH candidate pairs, clusters (numpy only).

A document's *shingles* are all its 8-byte windows after whitespace runs are
collapsed to one space (so re-indenting or re-wrapping a copy does not hide it).
Two documents' similarity is the Jaccard index of their shingle sets, estimated
from 128-value one-permutation MinHash signatures: the fraction of the 128
values that agree (standard error ≤ 0.045). Documents whose estimated
similarity exceeds a threshold are linked, and the connected components
(union-find) are the clusters that the corpus split keeps together
(docs/CORPUS.md gives the measured distributions behind the default 0.5).

LSH banding finds the candidate pairs without comparing all pairs, and is
*complete* for the chosen threshold: bands of ``r`` values are used with ``r``
small enough that any pair agreeing in more than ``threshold`` of the values
must agree on a whole band (pigeonhole), so no linked pair is ever missed and
the clusters equal those of an all-pairs comparison.

Everything is deterministic: fixed hash constants, explicit little-endian
byte order, no process-salted ``hash()``; signatures are the same on every
machine.
"""

from __future__ import annotations

import numpy as np

NUM_PERM = 128  # signature length: one-permutation MinHash bins
SHINGLE_BYTES = 8  # a shingle is 8 bytes: packs exactly into one uint64
_BIN_SHIFT = np.uint64(64 - 7)  # the top 7 hash bits pick one of the 128 bins
_LOW32 = np.uint64(0xFFFFFFFF)
_EMPTY = np.uint32(0xFFFFFFFF)  # a bin no shingle fell into (densified away)
_DENSIFY_STEP = np.uint32(0x9E3779B9)  # odd: an empty bin's borrowed value differs per distance
_FMIX = (np.uint64(33), np.uint64(0xFF51AFD7ED558CCD), np.uint64(0xC4CEB9FE1A85EC53))  # murmur3 fmix64


def normalize(text: str) -> bytes:
    """UTF-8 bytes of ``text`` with every whitespace run collapsed to one space."""
    return " ".join(text.split()).encode("utf-8", "replace")


def shingles(text: str) -> np.ndarray:
    """The sorted unique 8-byte shingles of ``text`` as uint64 (for exact Jaccard)."""
    return np.unique(np.concatenate(list(_shingle_views(normalize(text)))))


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """Exact Jaccard index of two sorted unique shingle arrays."""
    inter = np.intersect1d(a, b, assume_unique=True).size
    union = a.size + b.size - inter
    return inter / union if union else 1.0


def signature(text: str) -> np.ndarray:
    """The (NUM_PERM,) uint32 MinHash signature of ``text``.

    One hash per shingle (one-permutation hashing): the top 7 bits choose a bin,
    the low 32 bits are the value kept if it is the bin's minimum. Bins that no
    shingle reached borrow the next filled bin's value (rotation densification),
    so short documents still get full, comparable signatures.
    """
    sig = np.full(NUM_PERM, _EMPTY, dtype=np.uint32)
    for x in _shingle_views(normalize(text)):
        h = _fmix64(x)
        np.minimum.at(sig, (h >> _BIN_SHIFT).astype(np.intp), (h & _LOW32).astype(np.uint32))
    return _densify(sig)


def signatures(texts) -> np.ndarray:
    """(n, NUM_PERM) uint32 signatures of an iterable of texts."""
    rows = [signature(t) for t in texts]
    return np.stack(rows) if rows else np.empty((0, NUM_PERM), dtype=np.uint32)


def similarity(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Estimated Jaccard of every row of ``a`` (m, P) with every row of ``b`` (n, P): an (m, n) float array."""
    out = np.empty((len(a), len(b)), dtype=np.float64)
    for i in range(len(a)):  # row by row: memory stays O(n * P)
        out[i] = (a[i] == b).mean(axis=1)
    return out


def band_rows(threshold: float, num_perm: int = NUM_PERM) -> int:
    """The largest band size r whose banding catches every pair with similarity > threshold.

    A pair whose signatures agree in m values disagree in num_perm - m; when that is
    fewer than the number of bands (num_perm // r), some band has no disagreeing
    value, so the pair shares that band's bucket.
    """
    fewest_agreeing = int(np.floor(threshold * num_perm)) + 1  # the smallest m with m / num_perm > threshold
    r = 1
    while r + 1 <= num_perm and num_perm - fewest_agreeing < num_perm // (r + 1):
        r += 1
    return r


def linked_pairs(sigs: np.ndarray, threshold: float) -> np.ndarray:
    """(k, 2) index pairs i < j whose union-find closure is that of all pairs with similarity > ``threshold``.

    Rows with identical signatures are linked to their first copy and only one copy
    goes through LSH (a thousand copies of one file would otherwise make a million
    candidate pairs); every returned pair does exceed the threshold.
    """
    n, num_perm = sigs.shape
    if n < 2:
        return np.empty((0, 2), dtype=np.int64)
    rows = np.ascontiguousarray(sigs).view(np.dtype((np.void, 4 * num_perm))).ravel()
    _, first, inverse = np.unique(rows, return_index=True, return_inverse=True)
    copies = np.flatnonzero(first[inverse] != np.arange(n))
    duplicate_pairs = np.stack([first[inverse[copies]], copies], axis=1)
    if threshold >= 1.0:  # nothing exceeds 1, not even an exact copy
        duplicate_pairs = duplicate_pairs[:0]
    unique = sigs[first]
    r = band_rows(threshold, num_perm)
    candidates = [np.empty((0, 2), dtype=np.int64)]
    for start in range(0, (num_perm // r) * r, r):
        band = np.ascontiguousarray(unique[:, start : start + r]).view(np.dtype((np.void, 4 * r))).ravel()
        candidates.append(_same_bucket_pairs(band))
    pairs = np.unique(np.concatenate(candidates), axis=0)
    agree = np.empty(len(pairs), dtype=np.int64)
    for lo in range(0, len(pairs), 65536):  # chunks bound the (chunk, P) temporaries
        i, j = pairs[lo : lo + 65536, 0], pairs[lo : lo + 65536, 1]
        agree[lo : lo + 65536] = (unique[i] == unique[j]).sum(axis=1)
    similar = first[pairs[agree > threshold * num_perm]].reshape(-1, 2)
    return np.sort(np.concatenate([duplicate_pairs, similar]), axis=1).astype(np.int64)  # each pair as i < j


def cluster_roots(n: int, pairs: np.ndarray) -> np.ndarray:
    """Union-find over ``n`` items linked by ``pairs``: each item's root, the smallest index of its cluster."""
    parent = np.arange(n)

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]  # path halving
            i = parent[i]
        return i

    for i, j in pairs.tolist():
        a, b = find(i), find(j)
        if a != b:
            parent[max(a, b)] = min(a, b)  # the smaller index stays root
    return np.array([find(i) for i in range(n)], dtype=np.int64)


# ---------------------------------------------------------------------------- internals


def _shingle_views(data: bytes):
    """All 8-byte windows of ``data`` as uint64, without copying: windows starting at
    offsets ≡ o (mod 8) are the buffer read as little-endian uint64 from offset o.
    (The set of shingles is what matters, not their order.) Data shorter than 8
    bytes is zero-padded to one shingle."""
    if len(data) < SHINGLE_BYTES:
        data = data.ljust(SHINGLE_BYTES, b"\0")
    for offset in range(min(SHINGLE_BYTES, len(data) - SHINGLE_BYTES + 1)):
        count = (len(data) - offset) // SHINGLE_BYTES
        yield np.frombuffer(data, dtype="<u8", count=count, offset=offset)


def _fmix64(x: np.ndarray) -> np.ndarray:
    """murmur3's 64-bit finaliser: every output bit depends on every input bit."""
    shift, c1, c2 = _FMIX
    h = x.astype(np.uint64)  # native order, and a writable copy for the in-place steps
    h ^= h >> shift
    h *= c1
    h ^= h >> shift
    h *= c2
    h ^= h >> shift
    return h


def _densify(sig: np.ndarray) -> np.ndarray:
    """Fill each empty bin from the next filled bin to its right (circularly), offset by the distance."""
    filled = np.flatnonzero(sig != _EMPTY)
    if len(filled) == len(sig) or len(filled) == 0:
        return sig
    idx = np.arange(len(sig))
    pos = np.searchsorted(filled, idx) % len(filled)  # the next filled bin, wrapping around
    distance = ((filled[pos] - idx) % len(sig)).astype(np.uint32)
    out = sig[filled[pos]] + distance * _DENSIFY_STEP  # uint32 arithmetic wraps
    return out.astype(np.uint32)


def _same_bucket_pairs(band: np.ndarray) -> np.ndarray:
    """(k, 2) pairs i < j of rows with equal band values."""
    order = np.argsort(band, kind="stable")
    sorted_band = band[order]
    starts = np.flatnonzero(np.r_[True, sorted_band[1:] != sorted_band[:-1]])
    sizes = np.diff(np.r_[starts, len(band)])
    out = []
    for start, size in zip(starts[sizes > 1].tolist(), sizes[sizes > 1].tolist()):
        members = np.sort(order[start : start + size])
        i, j = np.triu_indices(size, k=1)
        out.append(np.stack([members[i], members[j]], axis=1))
    return np.concatenate(out) if out else np.empty((0, 2), dtype=np.int64)
