"""The embedded corpus: deterministic splits, file decoding, source errors."""

import json
import subprocess
import sys
from hashlib import sha256
from pathlib import Path

import numpy as np
import pytest
from conftest import subprocess_env, write_near_copy_families

from dflash2.corpus import (
    NEAR_DUPLICATE_THRESHOLD,
    SPLITS,
    corpus_fingerprint,
    document_signature,
    document_splits,
    iter_documents,
    load_documents,
    site_packages_dir,
    split_of,
    stdlib_dir,
)
from dflash2.errors import DFlash2Error
from dflash2.near_duplicates import similarity

STDLIB = [{"kind": "stdlib"}]
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def stdlib_docs():
    """Every stdlib document, read once (~1,800 files, < 1 s)."""
    return load_documents(STDLIB, None)


def _write(root: Path, rel: str, text: str) -> Path:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


# ---- split_of ---------------------------------------------------------------


def test_split_of_is_deterministic_and_respects_fractions():
    keys = [f"dir:x:file{i}.py" for i in range(20_000)]
    splits = [split_of(k) for k in keys]
    assert splits == [split_of(k) for k in keys]
    for name, want in (("heldout", 0.02), ("validation", 0.02)):
        assert abs(splits.count(name) / len(keys) - want) < 0.005
    assert {split_of(k, 0.0, 0.0) for k in keys} == {"train"}
    assert {split_of(k, 0.0, 0.999999) for k in keys[:100]} == {"heldout"}


def test_split_of_agrees_across_processes():
    """sha256, not hash(): a fresh interpreter with another hash seed agrees."""
    keys = [f"stdlib:mod{i}.py" for i in range(300)]
    code = (
        "import json,sys; from dflash2.corpus import split_of; "
        "print(json.dumps([split_of(k) for k in json.loads(sys.argv[1])]))"
    )
    env = subprocess_env(PYTHONHASHSEED="12345")
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(keys)], env=env, cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    assert json.loads(out) == [split_of(k) for k in keys]


# ---- the stdlib default ------------------------------------------------------


def test_stdlib_splits_are_disjoint_and_cover_everything(stdlib_docs):
    keys = [d.key for d in stdlib_docs]
    assert (
        len(keys) == len(set(keys)) > 500
    )  # ~1,800 files in a full CPython 3.11 stdlib, 574 on the GPU image's Ubuntu 3.12
    assert keys == sorted(keys)
    by_split = {s: {d.key for d in load_documents(STDLIB, s)} for s in SPLITS}
    assert set().union(*by_split.values()) == set(keys)
    assert sum(len(v) for v in by_split.values()) == len(keys)  # pairwise disjoint
    splits = document_splits(STDLIB)
    assert all(splits[k] == s for s, ks in by_split.items() for k in ks)
    for small in ("validation", "heldout"):
        assert 0.005 < len(by_split[small]) / len(keys) < 0.05
    assert "stdlib:json/decoder.py" in keys
    assert all(d.source == "stdlib" and d.text for d in stdlib_docs)


def test_stdlib_excludes_site_packages_and_caches(stdlib_docs):
    site = site_packages_dir()
    if site.is_relative_to(stdlib_dir()):  # e.g. lib/python3.11/site-packages
        prefix = "stdlib:" + site.relative_to(stdlib_dir()).as_posix() + "/"
        assert not [d.key for d in stdlib_docs if d.key.startswith(prefix)]
    for d in stdlib_docs:
        parts = d.key.split(":", 1)[1].split("/")
        assert not {"site-packages", "dist-packages", "__pycache__"} & set(parts), d.key
        assert d.key.endswith(".py")


def test_stdlib_non_utf8_files_decode_through_their_coding_cookie(stdlib_docs):
    by_key = {d.key: d.text for d in stdlib_docs}
    koi8 = "stdlib:test/encoded_modules/module_koi8_r.py"
    if koi8 not in by_key:
        pytest.skip("this Python has no koi8-r test module")
    assert "Познание" in by_key[koi8]  # decoded as koi8-r, not as U+FFFD soup


def test_max_documents_and_max_file_bytes():
    few = list(iter_documents(STDLIB, "train", max_documents=5))
    splits = document_splits(STDLIB)
    assert len(few) == 5 and all(splits[d.key] == "train" for d in few)
    small = load_documents(STDLIB, "heldout", max_file_bytes=2_000)
    assert small and all(len(d.text.encode("utf-8", "replace")) <= 2_000 for d in small)


# ---- near-duplicates share a split ------------------------------------------------


def test_near_copies_never_straddle_splits(tmp_path):
    families = write_near_copy_families(tmp_path)
    source = [{"kind": "dir", "path": str(tmp_path), "name": "fam"}]
    fractions = {"validation_fraction": 0.2, "heldout_fraction": 0.2}  # large: a key split would scatter families
    straddled_by_key = [f for f in families if len({split_of(k, 0.2, 0.2) for k in f}) > 1]
    assert len(straddled_by_key) > 10  # what the old path-hash split did
    splits = document_splits(source, **fractions)
    assert all(len({splits[k] for k in family}) == 1 for family in families)
    by_split = {s: {d.key for d in load_documents(source, s, **fractions)} for s in SPLITS}
    assert all(any(set(family) <= keys for keys in by_split.values()) for family in families)
    assert all(by_split[s] for s in SPLITS) and sum(map(len, by_split.values())) == len(splits)
    # a family's split is that of its smallest key; an unrelated document keeps its own key's split
    assert all(splits[f[0]] == split_of(min(f), 0.2, 0.2) for f in families)
    solos = [k for k in splits if ":solo/" in k]
    assert len(solos) == 100 and all(splits[k] == split_of(k, 0.2, 0.2) for k in solos)


def test_near_duplicate_threshold_one_turns_grouping_off(tmp_path):
    families = write_near_copy_families(tmp_path, families=10)
    source = [{"kind": "dir", "path": str(tmp_path), "name": "fam"}]
    splits = document_splits(source, validation_fraction=0.2, heldout_fraction=0.2, near_duplicate_threshold=1.0)
    assert all(splits[k] == split_of(k, 0.2, 0.2) for f in families for k in f)
    with pytest.raises(DFlash2Error, match=r"near_duplicate_threshold=0 must be in \(0, 1\]"):
        load_documents(source, "train", near_duplicate_threshold=0)


def test_stdlib_generated_families_share_a_split_and_heldout_is_clean():
    splits = document_splits(STDLIB)
    families = [
        ["cp861", "cp869", "cp865", "cp437", "cp860", "cp863"],  # gencodec.py charmap codecs
        ["mac_greek", "mac_roman", "mac_iceland", "cp1253", "iso8859_7"],
        ["utf_32_le", "utf_32_be", "utf_16_le", "utf_16_be", "utf_8"],
    ]
    for family in families:
        keys = [f"stdlib:encodings/{name}.py" for name in family]
        keys = [k for k in keys if k in splits]
        assert len(keys) >= 3 and len({splits[k] for k in keys}) == 1, {k: splits[k] for k in keys}
    assert split_of("stdlib:encodings/cp861.py") == "heldout" != split_of("stdlib:encodings/cp869.py")  # the old leak
    # the report's check: no held-out document is more similar than the threshold to any train document
    docs = {d.key: d for d in load_documents(STDLIB, None)}
    heldout = [document_signature(docs[k].text) for k, s in splits.items() if s == "heldout"]
    train = [document_signature(docs[k].text) for k, s in splits.items() if s == "train"]
    assert len(heldout) > 10 and similarity(np.stack(heldout), np.stack(train)).max() <= NEAR_DUPLICATE_THRESHOLD


# ---- dir sources -------------------------------------------------------------


def test_dir_split_does_not_depend_on_unrelated_files(tmp_path):
    for i in range(50):
        _write(tmp_path, f"pkg/m{i}.py", f"x = {i}\n")
    source = [{"kind": "dir", "path": str(tmp_path), "name": "mine"}]
    before = document_splits(source)
    assert set(before) == {f"dir:mine:pkg/m{i}.py" for i in range(50)}
    assert before == {k: split_of(k) for k in before}  # no near-duplicates: each key's own hash
    for i in range(50, 300):
        _write(tmp_path, f"other/n{i}.py", f"y = {i}\n")
    after = document_splits(source)
    assert len(after) == 300
    assert {k: after[k] for k in before} == before
    heldout = {d.key for d in load_documents(source, "heldout")}
    assert heldout == {k for k, s in after.items() if s == "heldout"}


def test_dir_reads_non_utf8_skips_empty_hidden_and_caches(tmp_path):
    (tmp_path / "latin.py").write_bytes(b"name = 'caf\xe9'\n")  # latin-1, no cookie
    (tmp_path / "empty.py").write_bytes(b"")
    _write(tmp_path, "__pycache__/c.py", "cached = 1\n")
    _write(tmp_path, ".venv/v.py", "venv = 1\n")
    _write(tmp_path, "notes.md", "# not python\n")
    docs = load_documents([{"kind": "dir", "path": str(tmp_path)}])
    assert [d.key for d in docs] == [f"dir:{tmp_path.name}:latin.py"]
    assert docs[0].text == "name = 'caf\ufffd'\n" and docs[0].source == "dir"
    md = load_documents([{"kind": "dir", "path": str(tmp_path), "glob": "*.md", "name": "n"}])
    assert [d.key for d in md] == ["dir:n:notes.md"]


def test_dir_errors_name_the_folder(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(DFlash2Error, match=r"nope.*does not exist"):
        load_documents([{"kind": "dir", "path": str(missing)}])
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DFlash2Error, match=f"{empty}.*\\*\\*/\\*\\.py"):
        load_documents([{"kind": "dir", "path": str(empty)}])


def test_bad_source_configs_raise_clear_errors(tmp_path):
    with pytest.raises(DFlash2Error, match="valid kinds: stdlib, dir, hf"):
        load_documents([{"kind": "github"}])
    with pytest.raises(DFlash2Error, match=r"unknown keys.*'glb'"):
        load_documents([{"kind": "dir", "path": str(tmp_path), "glb": "*.py"}])
    with pytest.raises(DFlash2Error, match="unknown split"):
        load_documents(STDLIB, "test")
    with pytest.raises(DFlash2Error, match="distinct 'name'"):
        load_documents([{"kind": "stdlib"}, {"kind": "stdlib"}])


def test_omegaconf_sources_are_accepted(tmp_path):
    omegaconf = pytest.importorskip("omegaconf")
    _write(tmp_path, "a.py", "a = 1\n")
    cfg = omegaconf.OmegaConf.create({"sources": [{"kind": "dir", "path": str(tmp_path), "name": "c"}]})
    assert [d.key for d in load_documents(cfg.sources)] == ["dir:c:a.py"]


# ---- hf sources ---------------------------------------------------------------


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """Keep datasets' arrow cache inside the test's tmp dir."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))


def test_hf_local_jsonl_loads_and_splits(tmp_path, hf_cache):
    # Rows with unrelated content (near-identical rows would rightly be grouped into one split).
    rows = [{"text": f"def f{i}():\n    return '{sha256(str(i).encode()).hexdigest()}'\n", "id": i} for i in range(400)]
    rows.append(rows[0])  # an exact duplicate is kept once
    path = tmp_path / "code.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    source = [{"kind": "hf", "path": str(path)}]
    docs = load_documents(source)
    assert len(docs) == 400 and {d.source for d in docs} == {"hf"}
    assert all(d.key.startswith("hf:code:") and len(d.key) == len("hf:code:") + 16 for d in docs)
    assert {d.text for d in docs} == {r["text"] for r in rows}
    held = load_documents(source, "heldout")
    splits = document_splits(source)
    assert held and {d.key for d in held} == {d.key for d in docs if splits[d.key] == "heldout"}
    # The key hashes the content: reversing the rows changes no document's split.
    path.write_text("\n".join(json.dumps(r) for r in reversed(rows)) + "\n")
    assert {d.key for d in load_documents(source, "heldout")} == {d.key for d in held}


def test_hf_jsonl_bad_line_is_reported_with_its_number(tmp_path, hf_cache):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"text": "a"}\n{"text": "b"}\n{"text": "c\n{"text": "d"}\n')
    with pytest.raises(DFlash2Error, match=r"broken\.jsonl.*line 3"):
        load_documents([{"kind": "hf", "path": str(path)}])


def test_hf_missing_text_field_lists_columns(tmp_path, hf_cache):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"content": "a", "lang": "py"}\n')
    with pytest.raises(DFlash2Error, match=r"no column 'text'.*content.*lang"):
        load_documents([{"kind": "hf", "path": str(path)}])
    docs = load_documents([{"kind": "hf", "path": str(path), "text_field": "content"}])
    assert [d.text for d in docs] == ["a"]


def test_hf_missing_local_file_and_unreachable_hub(tmp_path, hf_cache, monkeypatch):
    with pytest.raises(DFlash2Error, match=r"gone\.jsonl.*does not exist"):
        load_documents([{"kind": "hf", "path": str(tmp_path / "gone.jsonl")}])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(pytest.importorskip("datasets").config, "HF_HUB_OFFLINE", True, raising=False)
    with pytest.raises(DFlash2Error, match=r"hub.*local"):
        load_documents([{"kind": "hf", "path": "dflash2-no-such-owner/no-such-dataset"}])


# ---- fingerprint ---------------------------------------------------------------


def test_fingerprint_tracks_files_and_settings(tmp_path):
    _write(tmp_path, "a.py", "a = 1\n")
    source = [{"kind": "dir", "path": str(tmp_path)}]
    first = corpus_fingerprint(source, "train")
    assert first == corpus_fingerprint(source, "train")
    assert first != corpus_fingerprint(source, "heldout")
    assert first != corpus_fingerprint(source, "train", max_file_bytes=10)
    assert first != corpus_fingerprint(source, "train", near_duplicate_threshold=0.6)  # other clusters
    _write(tmp_path, "b.py", "b = 2\n")
    second = corpus_fingerprint(source, "train")
    assert second != first
    _write(tmp_path, "b.py", "b = 22\n")  # same name, new size
    assert corpus_fingerprint(source, "train") != second
    (tmp_path / "b.py").unlink()
    assert corpus_fingerprint(source, "train") == first
    assert len(corpus_fingerprint(STDLIB, "train")) == 16
