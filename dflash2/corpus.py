"""The embedded corpus: documents to train tokenizers, targets and drafters.

The default is the running interpreter's standard-library source (docs/CORPUS.md):
about 1,800 ``*.py`` files and 31 MB of real code that exist on every machine,
so nothing has to be downloaded. Extra folders (``kind: dir``) and HF datasets
(``kind: hf``: local json/jsonl/parquet/txt, or a hub id when online) can be
added in ``data.sources``.

Every document has a stable ``key``. Near-duplicate documents (generated
families such as the ``encodings/cp*.py`` codecs, copied files) are grouped
into clusters by content (:mod:`dflash2.near_duplicates`), and a whole cluster
goes to the split that ``split_of`` gives its smallest key: train, validation
or heldout. So no held-out document has a near-copy in train, and the split is
the same on every machine and in every process (docs/CORPUS.md).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import sys
import sysconfig
import tokenize
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from dflash2 import near_duplicates
from dflash2.errors import DFlash2Error

SPLITS = ("train", "validation", "heldout")
KINDS = ("stdlib", "dir", "hf")

# Keys each source kind accepts, with defaults; an unknown key is a typo we report.
_SOURCE_DEFAULTS = {
    "stdlib": {},
    "dir": {"path": None, "glob": "**/*.py", "name": None},
    "hf": {
        "path": None,
        "text_field": "text",
        "hf_split": "train",
        "format": None,
        "name": None,
        "sample_by": "document",
    },
}
# Vendored third-party code and bytecode caches are not "the standard library".
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_HF_SUFFIXES = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text"}
_PROGRESS_MIN_ITEMS = 200  # below this a progress bar is only noise
_FINGERPRINT_VERSION = 2  # bump when the way documents are read or split changes (2: near-duplicate clusters)
# Documents whose estimated shingle similarity exceeds this share a split (docs/CORPUS.md: the measured
# similarity distributions of the stdlib, and why 0.5).
NEAR_DUPLICATE_THRESHOLD = 0.5
# Recorded with every drafter (data split settings); change it when the split rule changes.
SPLIT_RULE = "near-duplicate clusters (MinHash of 8-byte shingles) by sha256 of the smallest key"
# In-process caches: clustering the stdlib reads 31 MB and hashes ~30 M shingles (about a second),
# and one run asks for its splits several times (target build, regeneration, prompts).
_SIGNATURES: dict[bytes, np.ndarray] = {}  # sha1 of a document's text -> its MinHash signature
_CLUSTERS: dict[str, dict[str, str]] = {}  # digest of (threshold, keys, contents) -> {key: cluster root key}


@dataclass(frozen=True)
class Document:
    """One training document.

    ``key`` is the stable id the split is computed from, e.g.
    ``"stdlib:json/decoder.py"``, ``"dir:<name>:<relpath>"`` or
    ``"hf:<name>:<sha1(text)[:16]>"``; ``source`` is ``"stdlib" | "dir" | "hf"``.
    """

    key: str
    text: str
    source: str


def split_of(key: str, validation_fraction: float = 0.02, heldout_fraction: float = 0.02) -> str:
    """The split that ``key`` hashes to: sha256(key) as a uniform u in [0, 1).

    A document's split is that of its near-duplicate cluster's smallest key
    (:func:`document_splits`), which is its own key when it has no near-duplicate.

    ``u < heldout_fraction`` is heldout, ``u < heldout + validation`` is
    validation, the rest is train. sha256 rather than ``hash()`` because Python
    salts ``hash()`` per process; this must agree across processes and machines.
    """
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    u = int.from_bytes(digest[:8], "big") / 2.0**64
    if u < heldout_fraction:
        return "heldout"
    if u < heldout_fraction + validation_fraction:
        return "validation"
    return "train"


def stdlib_dir() -> Path:
    """The running interpreter's standard-library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def site_packages_dir() -> Path:
    """The running interpreter's site-packages (pure-Python libraries) folder."""
    return Path(sysconfig.get_paths()["purelib"])


def decode_source(data: bytes) -> str:
    """Bytes of a source file as text, never failing.

    Most files are UTF-8. A few stdlib test fixtures are not: those declare
    their encoding in a PEP 263 cookie (``# -*- coding: latin-1 -*-``), which
    we honour so their text is real characters; bytes that still do not
    decode become U+FFFD rather than an exception.
    """
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        pass
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
        return data.decode(encoding, errors="replace")
    except (SyntaxError, LookupError):  # a bad or unknown coding cookie
        return data.decode("utf-8", errors="replace")


def iter_documents(
    sources,
    split: str | None = None,
    *,
    validation_fraction: float = 0.02,
    heldout_fraction: float = 0.02,
    near_duplicate_threshold: float = NEAR_DUPLICATE_THRESHOLD,
    max_file_bytes: int = 1_000_000,
    max_documents: int | None = None,
) -> Iterator[Document]:
    """Yield the documents of ``sources`` that fall in ``split`` (None: all splits).

    ``sources`` is a list of mappings (plain dicts or OmegaConf configs), each
    with a ``kind`` in :data:`KINDS`; see docs/CORPUS.md. Files (and HF rows)
    that are empty or larger than ``max_file_bytes`` are skipped. Documents
    come source by source, each source in key order; ``max_documents`` stops
    after that many documents of the split. Asking for one split reads every
    document once first, to find the near-duplicate clusters (cached per process).
    """
    _check_split_args(split, validation_fraction, heldout_fraction, near_duplicate_threshold)
    specs = _normalize_sources(sources)  # validate every source before reading any
    if max_documents is not None and max_documents <= 0:
        return
    roots = {} if split is None else _cluster_roots(specs, near_duplicate_threshold, max_file_bytes)

    def wanted(key: str) -> bool:
        return split is None or split_of(roots.get(key, key), validation_fraction, heldout_fraction) == split

    count = 0
    for spec in specs:
        reader = _hf_documents if spec["kind"] == "hf" else _file_documents
        for doc in reader(spec, wanted, max_file_bytes):
            yield doc
            count += 1
            if count == max_documents:
                return


def load_documents(
    sources,
    split: str | None = None,
    *,
    validation_fraction: float = 0.02,
    heldout_fraction: float = 0.02,
    near_duplicate_threshold: float = NEAR_DUPLICATE_THRESHOLD,
    max_file_bytes: int = 1_000_000,
    max_documents: int | None = None,
) -> list[Document]:
    """All of :func:`iter_documents` as a list sorted by key (same arguments)."""
    docs = iter_documents(
        sources,
        split,
        validation_fraction=validation_fraction,
        heldout_fraction=heldout_fraction,
        near_duplicate_threshold=near_duplicate_threshold,
        max_file_bytes=max_file_bytes,
        max_documents=max_documents,
    )
    return sorted(docs, key=lambda d: d.key)


def resolved_sources(sources) -> list[dict]:
    """``sources`` validated, with defaults filled and folders as absolute paths, as JSON-able dicts."""
    return [
        {k: (str(v) if k == "path" and v is not None else v) for k, v in spec.items()}
        for spec in _normalize_sources(sources)
    ]


def source_files(source: Mapping) -> list[tuple[str, Path]]:
    """(key, path) of every file a stdlib or dir source would read, sorted by key, without reading them."""
    (spec,) = _normalize_sources([source])
    if spec["kind"] == "hf":
        raise DFlash2Error("source_files lists the files of stdlib and dir sources; an hf source has rows, not files")
    return _list_files(spec)


def split_kwargs(data: Mapping) -> dict:
    """The split settings of a ``data`` config (a plain mapping), as keyword arguments of the
    functions here; a config written before near-duplicate grouping gets the default threshold."""
    return {
        "validation_fraction": float(data["validation_fraction"]),
        "heldout_fraction": float(data["heldout_fraction"]),
        "near_duplicate_threshold": float(data.get("near_duplicate_threshold", NEAR_DUPLICATE_THRESHOLD)),
    }


def cluster_keys(
    sources, *, near_duplicate_threshold: float = NEAR_DUPLICATE_THRESHOLD, max_file_bytes: int = 1_000_000
) -> dict[str, str]:
    """{key: the smallest key of its near-duplicate cluster} for every document of ``sources``."""
    _check_split_args(None, 0.0, 0.0, near_duplicate_threshold)
    return dict(_cluster_roots(_normalize_sources(sources), near_duplicate_threshold, max_file_bytes))


def document_splits(
    sources,
    *,
    validation_fraction: float = 0.02,
    heldout_fraction: float = 0.02,
    near_duplicate_threshold: float = NEAR_DUPLICATE_THRESHOLD,
    max_file_bytes: int = 1_000_000,
) -> dict[str, str]:
    """{key: split} for every document of ``sources``: the split of its cluster's smallest key."""
    _check_split_args(None, validation_fraction, heldout_fraction, near_duplicate_threshold)
    roots = cluster_keys(sources, near_duplicate_threshold=near_duplicate_threshold, max_file_bytes=max_file_bytes)
    return {key: split_of(root, validation_fraction, heldout_fraction) for key, root in roots.items()}


def corpus_fingerprint(
    sources,
    split: str | None = None,
    *,
    validation_fraction: float = 0.02,
    heldout_fraction: float = 0.02,
    near_duplicate_threshold: float = NEAR_DUPLICATE_THRESHOLD,
    max_file_bytes: int = 1_000_000,
    max_documents: int | None = None,
) -> str:
    """A short hex id of the corpus that ``iter_documents`` would read, for cache keys.

    Hashes the settings, each source and, for file sources, every file's key
    and size (it stats files and does not read them: < 0.1 s for the
    stdlib). Adding, removing, renaming or resizing a file changes the
    fingerprint; an edit that keeps a file's size does not. A hub dataset is
    identified by its id and split only (its revision is unknown offline).
    """
    _check_split_args(split, validation_fraction, heldout_fraction, near_duplicate_threshold)
    h = hashlib.sha256()
    settings = {
        "version": _FINGERPRINT_VERSION,
        "split": split,
        "validation_fraction": validation_fraction,
        "heldout_fraction": heldout_fraction,
        "near_duplicate_threshold": near_duplicate_threshold,
        "max_file_bytes": max_file_bytes,
        "max_documents": max_documents,
    }
    h.update(json.dumps(settings, sort_keys=True).encode())
    for spec in _normalize_sources(sources):
        h.update(json.dumps(spec, sort_keys=True, default=str).encode())
        if spec["kind"] == "stdlib":
            h.update(sys.version.encode())  # a patch release can change stdlib files
        for name, path in _fingerprint_files(spec):
            h.update(f"{name}\0{path.stat().st_size}\n".encode())
    return h.hexdigest()[:16]


def _fingerprint_files(spec: dict) -> list[tuple[str, Path]]:
    """(name, path) of the files a source reads; none for a hub id."""
    if spec["kind"] != "hf":
        return _list_files(spec)
    if not isinstance(spec["path"], Path):
        return []
    return [
        (p.relative_to(spec["path"]).as_posix() if p != spec["path"] else p.name, p) for p in _hf_local_files(spec)[1]
    ]


# ----------------------------------------------------------------------------
# sources


def _check_split_args(split, validation_fraction, heldout_fraction, near_duplicate_threshold) -> None:
    if split is not None and split not in SPLITS:
        raise DFlash2Error(f"unknown split {split!r}; use one of {', '.join(SPLITS)} (or None for all)")
    if not (validation_fraction >= 0 and heldout_fraction >= 0 and validation_fraction + heldout_fraction < 1):
        raise DFlash2Error(
            f"split fractions validation={validation_fraction}, heldout={heldout_fraction} "
            "must be >= 0 and sum to less than 1; fix data.validation_fraction / data.heldout_fraction"
        )
    if not 0 < near_duplicate_threshold <= 1:
        raise DFlash2Error(
            f"data.near_duplicate_threshold={near_duplicate_threshold} must be in (0, 1] "
            f"(the default {NEAR_DUPLICATE_THRESHOLD}; 1 turns near-duplicate grouping off)"
        )


# ----------------------------------------------------------------------------
# near-duplicate clusters


def document_signature(text: str) -> np.ndarray:
    """The MinHash signature of a document's text (:mod:`dflash2.near_duplicates`), cached by content."""
    return _SIGNATURES[_signature_digest(text)]


def _signature_digest(text: str) -> bytes:
    """sha1 of ``text``, with its signature computed into the cache if it is not there yet."""
    digest = hashlib.sha1(text.encode("utf-8", "replace")).digest()
    if digest not in _SIGNATURES:
        _SIGNATURES[digest] = near_duplicates.signature(text)
    return digest


def _cluster_roots(specs: list[dict], threshold: float, max_file_bytes: int) -> dict[str, str]:
    """{key: cluster root key} over every document of ``specs`` (normalized), cached per content."""
    keys, digests = [], []
    for spec in specs:
        reader = _hf_documents if spec["kind"] == "hf" else _file_documents
        for doc in reader(spec, lambda key: True, max_file_bytes):
            keys.append(doc.key)
            digests.append(_signature_digest(doc.text))
    cache_key = hashlib.sha256(repr((threshold, keys)).encode() + b"".join(digests)).hexdigest()
    if cache_key not in _CLUSTERS:
        empty = np.empty((0, near_duplicates.NUM_PERM), np.uint32)
        sigs = np.stack([_SIGNATURES[d] for d in digests]) if digests else empty
        roots = near_duplicates.cluster_roots(len(keys), near_duplicates.linked_pairs(sigs, threshold))
        # The root is the cluster's smallest index; keys are listed source by source, so take the smallest key.
        smallest: dict[int, str] = {}
        for key, root in zip(keys, roots.tolist()):
            smallest[root] = min(smallest.get(root, key), key)
        _CLUSTERS[cache_key] = {key: smallest[root] for key, root in zip(keys, roots.tolist())}
    return _CLUSTERS[cache_key]


def _normalize_sources(sources) -> list[dict]:
    """Plain dicts with defaults filled, paths resolved and names unique."""
    if isinstance(sources, Mapping):
        sources = [sources]
    if sources is None or isinstance(sources, (str, bytes)) or len(sources) == 0:
        raise DFlash2Error(f"data.sources must be a non-empty list such as [{{kind: stdlib}}], got {sources!r}")
    specs, names = [], set()
    for i, raw in enumerate(sources):
        if not isinstance(raw, Mapping):
            raise DFlash2Error(f"data.sources[{i}] must be a mapping with a 'kind', got {raw!r}")
        raw = {str(k): v for k, v in raw.items()}
        kind = raw.get("kind")
        if kind not in KINDS:
            raise DFlash2Error(f"data.sources[{i}] has unknown kind {kind!r}; valid kinds: {', '.join(KINDS)}")
        allowed = _SOURCE_DEFAULTS[kind]
        unknown = sorted(set(raw) - set(allowed) - {"kind"})
        if unknown:
            raise DFlash2Error(
                f"data.sources[{i}] (kind {kind}) has unknown keys {unknown}; allowed: {['kind', *allowed]}"
            )
        spec = {"kind": kind, **allowed, **{k: v for k, v in raw.items() if v is not None}}
        if kind == "dir":
            spec = _resolve_dir(spec, i)
        elif kind == "hf":
            spec = _resolve_hf(spec, i)
        name = (kind, spec.get("name"))
        if name in names:
            raise DFlash2Error(
                f"data.sources[{i}]: two {kind} sources are named {name[1]!r}; "
                "give one a distinct 'name' so their document keys differ"
            )
        names.add(name)
        specs.append(spec)
    return specs


def _resolve_dir(spec: dict, i: int) -> dict:
    if spec["path"] is None:
        raise DFlash2Error(f"data.sources[{i}] (kind dir) needs a 'path' (a folder or 'site-packages')")
    raw = str(spec["path"])
    path = site_packages_dir() if raw == "site-packages" else Path(raw).expanduser()
    if not path.is_dir():
        raise DFlash2Error(f"corpus directory '{path}' does not exist; fix data.sources[{i}].path")
    name = str(spec["name"]) if spec["name"] else ("site-packages" if raw == "site-packages" else path.name)
    return {**spec, "path": path.resolve(), "glob": str(spec["glob"]), "name": name}


def _resolve_hf(spec: dict, i: int) -> dict:
    if spec["path"] is None:
        raise DFlash2Error(f"data.sources[{i}] (kind hf) needs a 'path' (a local file/folder or a hub id)")
    raw = str(spec["path"])
    local = Path(raw).expanduser()
    looks_local = os.path.isabs(raw) or raw.startswith((".", "~")) or local.suffix in _HF_SUFFIXES
    if local.exists():
        path, default_name = local.resolve(), (local.stem if local.is_file() else local.name)
    elif looks_local:  # a typo'd path should not turn into a hub lookup
        raise DFlash2Error(f"dataset file '{raw}' does not exist; fix data.sources[{i}].path")
    else:
        path, default_name = raw, raw  # a hub id such as "owner/name"
    fmt = spec["format"]
    if fmt is not None and fmt not in set(_HF_SUFFIXES.values()):
        raise DFlash2Error(f"data.sources[{i}].format {fmt!r} is not one of json, parquet, text")
    return {**spec, "path": path, "name": str(spec["name"] or default_name)}


# ----------------------------------------------------------------------------
# file sources (stdlib, dir)


def _list_files(spec: dict) -> list[tuple[str, Path]]:
    """(key, path) of every candidate file of a stdlib/dir source, sorted by key."""
    if spec["kind"] == "stdlib":
        root, prefix = stdlib_dir(), "stdlib:"
        found = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]  # prune, don't descend
            found += [Path(dirpath, f) for f in filenames if f.endswith(".py")]
    else:
        root, prefix = spec["path"], f"dir:{spec['name']}:"
        found = [p for p in root.glob(spec["glob"]) if p.is_file() and not _hidden_or_excluded(p, root)]
        if not found:
            raise DFlash2Error(
                f"corpus directory '{root}' has no files matching {spec['glob']!r}; fix data.sources glob or path"
            )
    return sorted((prefix + p.relative_to(root).as_posix(), p) for p in found)


def _hidden_or_excluded(path: Path, root: Path) -> bool:
    """True under .git/.venv-style folders, bytecode caches or vendored packages."""
    parts = path.relative_to(root).parts[:-1]
    return any(part.startswith(".") or part in _EXCLUDED_DIRS for part in parts)


def _file_documents(spec: dict, wanted: Callable[[str], bool], max_file_bytes: int) -> Iterator[Document]:
    files = _list_files(spec)
    label = spec.get("name") or spec["kind"]
    for key, path in tqdm(files, desc=f"reading {label}", unit="file", disable=len(files) <= _PROGRESS_MIN_ITEMS):
        if not wanted(key):  # the key alone decides the split: skip before reading
            continue
        size = path.stat().st_size
        if size == 0 or size > max_file_bytes:
            continue
        yield Document(key=key, text=decode_source(path.read_bytes()), source=spec["kind"])


# ----------------------------------------------------------------------------
# HF datasets


def _hf_local_files(spec: dict) -> tuple[str, list[Path]]:
    """(datasets builder name, sorted data files) of a local hf source."""
    path, fmt = spec["path"], spec["format"]
    if path.is_file():
        fmt = fmt or _HF_SUFFIXES.get(path.suffix)
        if fmt is None:
            raise DFlash2Error(
                f"cannot tell the format of '{path}' from its suffix; set format: json | parquet | text in data.sources"
            )
        return fmt, [path]
    files = sorted(
        p
        for p in path.rglob("*")
        if p.is_file()
        and p.suffix in _HF_SUFFIXES
        and not _hidden_or_excluded(p, path)
        and (fmt is None or _HF_SUFFIXES[p.suffix] == fmt)
    )
    formats = sorted({_HF_SUFFIXES[p.suffix] for p in files})
    if not files:
        raise DFlash2Error(
            f"dataset folder '{path}' has no {fmt or 'json/jsonl/parquet/txt'} files; fix data.sources path or format"
        )
    if len(formats) > 1:
        raise DFlash2Error(f"dataset folder '{path}' mixes formats {formats}; set format in data.sources")
    return formats[0], files


def _validate_jsonl(path: Path) -> None:
    """Fail on the first malformed line with its number (datasets' error does not say)."""
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:  # e.lineno is always 1 here: we parse one line
                raise DFlash2Error(
                    f"malformed JSON in '{path}' at line {lineno}, column {e.colno} ({e.msg}); fix or remove that line"
                ) from None
            except UnicodeDecodeError:
                raise DFlash2Error(f"'{path}' line {lineno} is not valid UTF-8; re-save the file as UTF-8") from None
            if not isinstance(row, dict):
                raise DFlash2Error(
                    f"'{path}' line {lineno} is not a JSON object; each line must look like {{\"text\": ...}}"
                )


def _load_hf(spec: dict):
    """The source as a ``datasets.Dataset``; every failure becomes a DFlash2Error."""
    import datasets  # heavy (~1 s); only hf sources pay for it

    if isinstance(spec["path"], Path):
        fmt, files = _hf_local_files(spec)
        for p in files:
            if p.suffix == ".jsonl":
                _validate_jsonl(p)
        extra = {"sample_by": spec["sample_by"]} if fmt == "text" else {}
        try:  # local files form one split, named "train" by datasets
            return datasets.load_dataset(fmt, data_files=[str(p) for p in files], split="train", **extra)
        except Exception as e:
            raise DFlash2Error(
                f"could not read '{spec['path']}' as {fmt}: "
                f"{type(e).__name__}: {_first_line(e)}; "
                "fix the file or set format in data.sources"
            ) from None
    try:
        return datasets.load_dataset(spec["path"], split=spec["hf_split"])
    except Exception as e:
        raise DFlash2Error(
            f"could not load dataset {spec['path']!r} (split {spec['hf_split']!r}) from the hub: "
            f"{type(e).__name__}: {_first_line(e)}; the hub is unreachable here or the id is wrong - "
            "pass a local .jsonl/.json/.parquet/.txt file or folder as data.sources path"
        ) from None


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else ""


def _hf_documents(spec: dict, wanted: Callable[[str], bool], max_file_bytes: int) -> Iterator[Document]:
    rows = _load_hf(spec)
    field = spec["text_field"]
    if field not in rows.column_names:
        raise DFlash2Error(
            f"dataset '{spec['path']}' has no column {field!r}; set text_field to one of "
            f"{rows.column_names} in data.sources"
        )
    rows = rows.select_columns([field])
    seen = set()  # identical rows share a key; keep one so keys stay unique
    with tqdm(
        total=len(rows), desc=f"reading {spec['name']}", unit="row", disable=len(rows) <= _PROGRESS_MIN_ITEMS
    ) as bar:
        for batch in rows.iter(batch_size=1000):
            bar.update(len(batch[field]))
            for text in batch[field]:
                if text is None:
                    continue
                if not isinstance(text, str):
                    raise DFlash2Error(
                        f"dataset '{spec['path']}' column {field!r} holds "
                        f"{type(text).__name__}, not text; set text_field to a string column"
                    )
                data = text.encode("utf-8")
                # The key hashes the content, not the row index, so a row keeps
                # its split when rows are added, removed or reordered.
                key = f"hf:{spec['name']}:{hashlib.sha1(data).hexdigest()[:16]}"
                if not data or len(data) > max_file_bytes or key in seen or not wanted(key):
                    continue
                seen.add(key)
                yield Document(key=key, text=text, source="hf")


if __name__ == "__main__":  # python -m dflash2.corpus report ...
    from dflash2.corpus_report import main

    main()
