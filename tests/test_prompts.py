"""File-prefix prompts for regeneration (issue 3)."""

from __future__ import annotations

import pytest

from dflash2.corpus import Document
from dflash2.data.prompts import code_prompt_batches
from dflash2.errors import DFlash2Error


class CharTokenizer:
    """One token per character: enough to check lengths and prefixes."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) % 200 for c in text]}


def test_batches_share_a_length_and_are_file_prefixes():
    docs = [Document(key=f"k{i}", text="abcdefghij" * (i + 3), source="dir") for i in range(5)]
    batches = code_prompt_batches(
        docs, CharTokenizer(), num_prompts=50, min_tokens=4, max_tokens=20, batch_size=16, seed=0
    )
    assert sum(len(b.keys) for b in batches) == 50
    for b in batches:
        assert b.input_ids.shape[0] == len(b.keys) and 4 <= b.input_ids.shape[1] <= 20
        for row in b.input_ids:
            assert [chr(c) for c in row] == list("abcdefghij" * 10)[: len(row)]


def test_more_prompts_than_documents_are_drawn_with_replacement():
    docs = [Document(key="a", text="x" * 50, source="dir"), Document(key="b", text="y" * 50, source="dir")]
    batches = code_prompt_batches(
        docs, CharTokenizer(), num_prompts=40, min_tokens=8, max_tokens=16, batch_size=32, seed=1
    )
    assert sum(len(b.keys) for b in batches) == 40


def test_documents_too_short_is_a_clear_error():
    docs = [Document(key="a", text="xy", source="dir")]
    with pytest.raises(DFlash2Error, match="prompt_min_tokens"):
        code_prompt_batches(docs, CharTokenizer(), num_prompts=4, min_tokens=8, max_tokens=16, batch_size=4, seed=0)
