"""The corpus split a drafter was trained on, as recorded in its config (``DrafterConfig.training_data``).

Training writes the record; evaluation reads it to draw held-out prompts from the
run's own held-out split and to refuse prompts of its train split. A drafter
without a record (written before records existed, or by another tool) falls back
to the default data config, with a logged warning.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path

from dflash2.corpus import NEAR_DUPLICATE_THRESHOLD, SPLIT_RULE, resolved_sources, split_kwargs
from dflash2.errors import DFlash2Error

log = logging.getLogger(__name__)

DEFAULT_MAX_FILE_BYTES = 1_000_000  # corpus.iter_documents' default; the data config does not set it
DEFAULT_RECORD = {
    "sources": [{"kind": "stdlib"}],
    "validation_fraction": 0.02,
    "heldout_fraction": 0.02,
    "near_duplicate_threshold": NEAR_DUPLICATE_THRESHOLD,
    "max_file_bytes": DEFAULT_MAX_FILE_BYTES,
    "split_rule": SPLIT_RULE,
    "seed": None,
}


def training_data_record(data: Mapping, seed: int, chat_template: str | None = None) -> dict:
    """The record of a run's ``data`` config (a plain mapping): JSON-able, with every source
    normalized (defaults filled, folders as absolute paths) so it reads the same from any cwd.

    Chat data (``data.chat``) adds ``chat``: its conversation sources, the template the prompts
    went through (``chat_template``: "tokenizer" or "plain") and the prompt budget, so that
    evaluation draws and renders held-out chat prompts the way training did.
    """
    record = {
        "sources": resolved_sources(data["sources"]),
        **split_kwargs(data),
        "max_file_bytes": int(data.get("max_file_bytes", DEFAULT_MAX_FILE_BYTES)),
        "split_rule": SPLIT_RULE,
        "seed": int(seed),
    }
    if data.get("chat"):
        from dflash2.data.chat_sources import normalize_chat_sources

        record["chat"] = {
            "conversations": normalize_chat_sources(data["chat"]["conversations"]),
            "template": chat_template,
            "prompt_max_tokens": int(data["prompt_max_tokens"]),
        }
    return record


def read_training_data(drafter_dir) -> dict:
    """The record in a drafter folder's config.json (without loading the weights), or the default."""
    path = Path(drafter_dir) / "config.json"
    if not path.is_file():
        raise DFlash2Error(f"{path} not found; pass a drafter folder written by training or save_drafter")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DFlash2Error(f"{path} is not valid JSON ({e.msg}); re-export the drafter") from None
    return recorded_training_data((config.get("dflash2") or {}).get("training_data"), str(drafter_dir))[0]


def recorded_training_data(record: Mapping | None, drafter_path: str = "the drafter") -> tuple[dict, bool]:
    """(record, True) when the drafter has one (``DrafterConfig.training_data``); else (the default
    record, False) with a logged warning."""
    if record:
        if record.get("split_rule") != SPLIT_RULE:
            log.warning(
                "%s was trained with another split rule (%r); today's held-out split may contain "
                "documents it trained on",
                drafter_path,
                record.get("split_rule"),
            )
        return {**DEFAULT_RECORD, **record}, True
    log.warning(
        "%s does not record the data it was trained on; assuming the default data config (%s, validation %.2f, "
        "heldout %.2f, near-duplicate threshold %.2f)",
        drafter_path,
        DEFAULT_RECORD["sources"],
        DEFAULT_RECORD["validation_fraction"],
        DEFAULT_RECORD["heldout_fraction"],
        DEFAULT_RECORD["near_duplicate_threshold"],
    )
    return dict(DEFAULT_RECORD), False


def corpus_kwargs(record: Mapping) -> dict:
    """The keyword arguments of ``corpus.load_documents`` that reproduce the record's split."""
    return {**split_kwargs(record), "max_file_bytes": int(record["max_file_bytes"])}
