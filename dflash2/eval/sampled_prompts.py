"""Seeded samples of documents as fixed-length token prompts: the held-out split and out-of-domain code.

* ``heldout``: documents of the held-out split of the data the drafter was trained
  on (its recorded sources, fractions and near-duplicate threshold), so neither
  the drafter nor, for the embedded target, the target saw them or a near-copy.
* ``ood``: Python files of this interpreter's site-packages, code that no training
  source of the run contains (refused when the run trained on site-packages;
  files that are near-duplicates of a train document are left out).

Documents are drawn in a seeded random order (not key order), and each gives
``prompts_per_document`` prompts of ``prompt_tokens`` tokens at random token
offsets (or its head with ``position=head``). The info dict says what was drawn,
how many documents were passed over and why.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from dflash2.corpus import (
    decode_source,
    document_signature,
    load_documents,
    site_packages_dir,
    source_files,
)
from dflash2.data.split_record import corpus_kwargs
from dflash2.errors import DFlash2Error
from dflash2.eval.prompts import Prompt
from dflash2.near_duplicates import similarity

POSITIONS = ("random", "head")
OOD_SOURCE = {"kind": "dir", "path": "site-packages", "name": "site-packages"}


def sample_prompts(
    keys: list[str],
    read: Callable[[str], str | None],
    tokenizer,
    *,
    num_prompts: int,
    prompt_tokens: int,
    prompts_per_document: int = 1,
    position: str = "random",
    seed: int = 0,
    keep: Callable[[str, str], bool] | None = None,
) -> tuple[list[Prompt], dict]:
    """Up to ``num_prompts`` prompts from documents drawn in a seeded random order.

    read(key) -> text, or None for a document to pass over (empty, too large);
    keep(key, text) -> False drops a document (e.g. a near-copy of a train one).
    Returns (prompts, counts): documents available / drawn / used and passed over, by reason.
    """
    if position not in POSITIONS:
        raise DFlash2Error(f"prompt_position={position!r}: use one of {', '.join(POSITIONS)}")
    if prompt_tokens < 1 or prompts_per_document < 1:
        raise DFlash2Error(
            f"prompt_tokens={prompt_tokens} and prompts_per_document={prompts_per_document} must be >= 1"
        )
    if position == "head" and prompts_per_document > 1:
        raise DFlash2Error("prompts_per_document > 1 needs prompt_position=random (a document has one head)")
    rng = np.random.default_rng(seed)
    prompts, passed_over, drawn = [], {"unreadable": 0, "near_train": 0, "too_short": 0}, 0
    for index in rng.permutation(len(keys)).tolist():
        if len(prompts) >= num_prompts:
            break
        key = keys[index]
        drawn += 1
        text = read(key)
        if text is None:
            passed_over["unreadable"] += 1
            continue
        if keep is not None and not keep(key, text):
            passed_over["near_train"] += 1
            continue
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        if len(ids) < prompt_tokens:
            passed_over["too_short"] += 1
            continue
        starts = len(ids) - prompt_tokens + 1
        count = min(prompts_per_document, starts, num_prompts - len(prompts))
        offsets = [0] if position == "head" else sorted(rng.choice(starts, size=count, replace=False).tolist())
        for offset in offsets:
            window = ids[offset : offset + prompt_tokens]
            prompts.append(Prompt(text=tokenizer.decode(window), ids=window, source=key, offset=offset))
    counts = {
        "documents_available": len(keys),
        "documents_drawn": drawn,
        "documents_used": len({p.source for p in prompts}),
        "documents_passed_over": passed_over,
    }
    return prompts, counts


def heldout_candidates(record: dict) -> tuple[list[str], Callable[[str], str | None]]:
    """Keys and reader of the held-out split that ``record`` (a drafter's training data) defines."""
    docs = {d.key: d.text for d in _documents(record, "heldout")}
    return sorted(docs), docs.get


def ood_candidates(record: dict, max_file_bytes: int) -> tuple[list[str], Callable[[str], str | None], Callable]:
    """Keys, reader and near-duplicate filter of site-packages code; DFlash2Error if the run trained on it."""
    site = site_packages_dir().resolve()
    for i, source in enumerate(record["sources"]):
        path = source.get("path")
        if source.get("kind") == "dir" and path is not None:
            path = site if str(path) == "site-packages" else Path(path).resolve()
            # A folder *above* site-packages is fine: dir sources skip site-packages folders.
            if path == site or site in path.parents:
                raise DFlash2Error(
                    f"prompts=ood draws site-packages code, but this drafter trained on {path} (data.sources[{i}]); "
                    "pass a prompts file of code it never saw"
                )
    files = dict(source_files(OOD_SOURCE))
    train = np.stack([document_signature(d.text) for d in _documents(record, "train")])
    threshold = float(record["near_duplicate_threshold"])

    def read(key: str) -> str | None:
        size = files[key].stat().st_size
        return decode_source(files[key].read_bytes()) if 0 < size <= max_file_bytes else None

    def not_near_train(key: str, text: str) -> bool:
        return bool(similarity(document_signature(text)[None], train).max() <= threshold)

    return sorted(files), read, not_near_train


def _documents(record: dict, split: str):
    """The documents of one split of the run's data; a source that cannot be read here is a one-line error."""
    try:
        return load_documents(record["sources"], split, **corpus_kwargs(record))
    except DFlash2Error as e:
        raise DFlash2Error(
            f"cannot read the data this drafter was trained on ({e}); run where its data.sources exist, "
            "or pass a prompts file"
        ) from None
