"""Where conversations come from, and which split each one belongs to (ARCHITECTURE.md §2.8).

``data.chat.conversations`` lists sources:

* ``{kind: embedded}``: instruction -> code conversations made from the documents of
  ``data.sources`` (:mod:`dflash2.data.chat_embedded`); each is in its document's split.
* ``{kind: dataset, path: FILE | FOLDER | HUB_ID, hf_split: train, name: null}``: ShareGPT or
  OpenAI rows (:mod:`dflash2.data.chat_format`) from local ``.jsonl`` / ``.json`` / ``.parquet``
  files, or a hub dataset through ``datasets`` when online. A conversation's key hashes its
  content; near-duplicate conversations (the corpus rule: MinHash of 8-byte shingles, threshold
  ``data.near_duplicate_threshold``) form clusters and a cluster goes whole to the split of its
  smallest key, as corpus documents do (docs/CORPUS.md). So no held-out prompt has a near-copy
  in train, and a row keeps its split when rows are added or reordered.

Unusable rows (malformed, an unknown role) are counted per split and skipped, never raised.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np

from dflash2 import near_duplicates
from dflash2.corpus import Document, load_documents, split_kwargs, split_of
from dflash2.data.chat_embedded import document_conversations
from dflash2.data.chat_format import BadRow, Conversation, RowCounts, canonical_text, conversation_messages
from dflash2.errors import DFlash2Error

_DEFAULTS = {"embedded": {}, "dataset": {"path": None, "hf_split": "train", "name": None}}
_SUFFIXES = (".jsonl", ".json", ".parquet")
EMBEDDED_VERSION = 1  # bump when chat_embedded makes other conversations (part of the cache key)
# Per process: a dataset is read, parsed and clustered once although a run asks for three splits.
_ENTRIES: dict[str, list[tuple[str, object, str]]] = {}


def normalize_chat_sources(sources) -> list[dict]:
    """``data.chat.conversations`` validated, defaults filled, local paths absolute (JSON-able dicts)."""
    if isinstance(sources, Mapping):
        sources = [sources]
    if not sources or isinstance(sources, (str, bytes)):
        raise DFlash2Error(
            f"data.chat.conversations must be a non-empty list such as [{{kind: embedded}}], got {sources!r}"
        )
    specs = []
    for i, raw in enumerate(sources):
        where = f"data.chat.conversations[{i}]"
        if not isinstance(raw, Mapping) or raw.get("kind") not in _DEFAULTS:
            raise DFlash2Error(f"{where} must be a mapping with kind embedded or dataset, got {raw!r}")
        kind = raw["kind"]
        unknown = sorted(set(raw) - set(_DEFAULTS[kind]) - {"kind"})
        if unknown:
            raise DFlash2Error(
                f"{where} (kind {kind}) has unknown keys {unknown}; allowed: {['kind', *_DEFAULTS[kind]]}"
            )
        spec = {"kind": kind, **_DEFAULTS[kind], **{k: v for k, v in raw.items() if v is not None}}
        if kind == "dataset":
            spec = _resolve_dataset(spec, where)
        specs.append(spec)
    names = [s["name"] for s in specs if s["kind"] == "dataset"]
    if len(names) != len(set(names)):
        raise DFlash2Error(f"two data.chat.conversations datasets share a name ({names}); give each a distinct name")
    return specs


def _resolve_dataset(spec: dict, where: str) -> dict:
    if not spec["path"]:
        raise DFlash2Error(f"{where} (kind dataset) needs a path: a .jsonl/.json/.parquet file, a folder or a hub id")
    raw = str(spec["path"])
    local = Path(raw).expanduser()
    if local.exists():
        if local.is_file() and local.suffix not in _SUFFIXES:
            raise DFlash2Error(f"{where}: {local} is not a .jsonl, .json or .parquet file")
        return {**spec, "path": str(local.resolve()), "name": str(spec["name"] or local.stem)}
    if os.path.isabs(raw) or raw.startswith((".", "~")) or local.suffix in _SUFFIXES:
        raise DFlash2Error(f"chat dataset '{raw}' does not exist; fix {where}.path")
    return {**spec, "name": str(spec["name"] or raw)}  # a hub id such as "owner/name"


def chat_fingerprint(sources) -> str:
    """A short id of the conversations the sources hold, for cache keys: the specs and every local
    file's name and size (not its bytes, as the corpus fingerprint); a hub id by id and split."""
    h = hashlib.sha256(json.dumps({"embedded_version": EMBEDDED_VERSION}).encode())
    for spec in normalize_chat_sources(sources):
        h.update(json.dumps(spec, sort_keys=True).encode())
        for f in _local_files(spec):
            h.update(f"{f.name}\0{f.stat().st_size}\n".encode())
    return h.hexdigest()[:16]


def iter_conversations(data: Mapping, split: str, seed: int, counts: RowCounts) -> Iterator[Conversation]:
    """The usable conversations of ``split`` in a seeded random order; skipped rows go into ``counts``.

    data: the plain ``data`` config (``chat.conversations``, ``sources`` and the split settings).
    Embedded conversations are made lazily, document by document, as the consumer asks for more.
    """
    kw = split_kwargs(data)
    units: list = []  # a corpus Document (-> its conversations) or one Conversation
    for spec in normalize_chat_sources(data["chat"]["conversations"]):
        if spec["kind"] == "embedded":
            units += load_documents(data["sources"], split, **kw)
            continue
        for key, item, row_split in _dataset_entries(spec, kw):
            if row_split != split:
                continue
            if isinstance(item, str):  # a BadRow reason
                counts.read += 1
                counts.skip(item)
            else:
                units.append(Conversation(key, item))
    for i in np.random.default_rng(seed).permutation(len(units)).tolist():
        unit = units[i]
        for conversation in [unit] if isinstance(unit, Conversation) else document_conversations(unit):
            counts.read += 1
            yield conversation


def conversation_documents(data: Mapping, split: str):
    """The conversations of a split's datasets as corpus-like documents (key, text = all turns), for
    the check that evaluation prompts are not train text; embedded ones are the corpus itself."""
    kw = split_kwargs(data)
    docs = []
    for spec in normalize_chat_sources(data["chat"]["conversations"]):
        if spec["kind"] == "dataset":
            for key, item, row_split in _dataset_entries(spec, kw):
                if row_split == split and not isinstance(item, str):
                    docs.append(Document(key, "\n".join(m["content"] for m in item), "chat"))
    return docs


# ------------------------------------------------------------------ datasets
def _dataset_entries(spec: dict, kw: dict) -> list[tuple[str, object, str]]:
    """(key, messages or a BadRow reason, split) for every row of a dataset source, cached per process."""
    files = [(str(f), f.stat().st_size) for f in _local_files(spec)]
    cache_key = json.dumps([spec, files, kw], sort_keys=True)
    if cache_key in _ENTRIES:
        return _ENTRIES[cache_key]
    good: dict[str, list[dict]] = {}
    bad: list[tuple[str, str]] = []
    for raw_text, row in _rows(spec):
        try:
            if isinstance(row, BadRow):
                raise row
            messages = conversation_messages(row)
        except BadRow as e:
            bad.append((f"chat:{spec['name']}:{_sha(raw_text)}", e.reason))
            continue
        # The key hashes the content: a row keeps its split when rows are added, removed or reordered;
        # identical conversations share a key and are kept once.
        good.setdefault(f"chat:{spec['name']}:{_sha(canonical_text(messages))}", messages)
    keys = sorted(good)
    texts = ["\n".join(m["content"] for m in good[k]) for k in keys]
    threshold = kw["near_duplicate_threshold"]
    sigs = np.stack([near_duplicates.signature(t) for t in texts]) if texts else np.zeros((0, near_duplicates.NUM_PERM))
    roots = near_duplicates.cluster_roots(len(keys), near_duplicates.linked_pairs(sigs.astype(np.uint32), threshold))
    smallest: dict[int, str] = {}
    for key, root in zip(keys, roots.tolist()):
        smallest.setdefault(root, key)  # keys are sorted: the first one seen is the smallest
    fractions = (kw["validation_fraction"], kw["heldout_fraction"])
    entries = [(k, good[k], split_of(smallest[r], *fractions)) for k, r in zip(keys, roots.tolist())]
    entries += [(k, reason, split_of(k, *fractions)) for k, reason in bad]
    _ENTRIES[cache_key] = entries
    return entries


def _sha(text: str) -> str:
    return hashlib.sha1(text.encode("utf-8", "replace")).hexdigest()[:16]


def _local_files(spec: dict) -> list[Path]:
    if spec["kind"] != "dataset":
        return []
    path = Path(spec["path"])
    if not path.exists():
        return []  # a hub id
    if path.is_file():
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in _SUFFIXES)
    if not files:
        raise DFlash2Error(f"chat dataset folder {path} has no .jsonl, .json or .parquet files")
    return files


def _rows(spec: dict) -> Iterator[tuple[str, object]]:
    """(raw text for a bad row's key, row or BadRow) of every row of a dataset source."""
    files = _local_files(spec)
    if not files:
        yield from _hub_rows(spec)
        return
    for f in files:
        if f.suffix == ".parquet":
            import pyarrow.parquet as pq

            for i, row in enumerate(pq.read_table(f).to_pylist()):
                yield f"{f.name}:{i}", row
            continue
        text = f.read_text(encoding="utf-8", errors="replace")
        if f.suffix == ".json":
            try:
                rows = json.loads(text)
            except json.JSONDecodeError:
                rows = None  # many ".json" chat files are really one object per line
            if isinstance(rows, list):
                for i, row in enumerate(rows):
                    yield f"{f.name}:{i}", row
                continue
        for line in text.splitlines():
            if not line.strip():
                continue
            try:
                yield line, json.loads(line)
            except json.JSONDecodeError as e:
                yield line, BadRow("malformed", f"invalid JSON ({e.msg})")


def _hub_rows(spec: dict) -> Iterator[tuple[str, object]]:
    import datasets

    try:
        rows = datasets.load_dataset(spec["path"], split=spec["hf_split"])
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise DFlash2Error(
            f"could not load chat dataset {spec['path']!r} (split {spec['hf_split']!r}) from the hub: "
            f"{type(e).__name__}: {first}; the hub is unreachable here or the id is wrong - "
            "pass a local .jsonl/.json/.parquet file or folder as data.chat.conversations path"
        ) from None
    for i, row in enumerate(rows):
        yield f"{spec['path']}:{i}", row
