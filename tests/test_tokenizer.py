"""The byte-level BPE: exact round trips, fixed special ids, save/load, determinism."""

import hashlib
import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import subprocess_env
from transformers import AutoTokenizer

from dflash2.corpus import Document, load_documents
from dflash2.errors import DFlash2Error
from dflash2.tokenizer import (
    EOS_TOKEN,
    MASK_TOKEN,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    encode_documents,
    train_bpe_tokenizer,
)

REPO = Path(__file__).resolve().parents[1]
VOCAB = 512
TRAIN_BYTES = 400_000  # a few stdlib files: trains in well under a second


@pytest.fixture(scope="module")
def train_texts():
    docs = load_documents([{"kind": "stdlib"}], "train", max_documents=200)
    return [d.text for d in docs]


@pytest.fixture(scope="module")
def tok(train_texts):
    return train_bpe_tokenizer(train_texts, vocab_size=VOCAB, max_train_bytes=TRAIN_BYTES)


HAND_STRINGS = [
    "",
    " ",
    "  leading spaces",
    "trailing spaces   ",
    "tabs\tand\r\nwindows\rlines\n",
    "NUL\x00byte and \x7f DEL",
    "emoji 😀👍🏽 family 👨‍👩‍👧",
    "CJK 日本語の文章 中文 한국어",
    "combining e\u0301 vs \u00e9, a\u0308\u0323",  # NFC would merge these: must not
    "RTL עברית العربية",
    "zero\u200bwidth \ufeffBOM \ufffd replacement",
    "astral \U0001d54f \U0010fffd",
    "  x = 'it''s'  .  ,  don't ",  # HF's space cleanup would rewrite " ." and " 's"
    f"literal specials {EOS_TOKEN}{MASK_TOKEN} inside text",
]

# Code point ranges to sample from: ASCII, Latin, Greek/Cyrillic, combining
# marks, Arabic, Devanagari, CJK, Hangul, private use, emoji, astral planes.
RANGES = [
    (0x00, 0x7F),
    (0x80, 0x24F),
    (0x370, 0x4FF),
    (0x300, 0x36F),
    (0x600, 0x6FF),
    (0x900, 0x97F),
    (0x4E00, 0x9FFF),
    (0xAC00, 0xD7A3),
    (0xE000, 0xF8FF),
    (0xFE00, 0xFFFF),
    (0x1F300, 0x1FAFF),
    (0x10000, 0x10FFFF),
]


def random_strings(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        chars = []
        for _ in range(rng.randint(1, 40)):
            lo, hi = rng.choice(RANGES)
            cp = rng.randint(lo, hi)
            if 0xD800 <= cp <= 0xDFFF:  # surrogates are not encodable text
                cp = 0x20
            chars.append(chr(cp))
        out.append("".join(chars))
    return out


def _round_trips(tokenizer, s: str) -> bool:
    return tokenizer.decode(tokenizer.encode(s), skip_special_tokens=False) == s


def test_round_trip_hand_picked_unicode(tok):
    for s in HAND_STRINGS:
        assert _round_trips(tok, s), repr(s)


def test_round_trip_random_unicode(tok):
    failures = [s for s in random_strings(500) if not _round_trips(tok, s)]
    assert failures == []


def test_round_trip_code_and_compression(tok, train_texts):
    # Code files: `encodings/` holds generated codec tables (one unicode literal per line), which
    # dominate the held-out split of the slimmer stdlib on the GPU image (574 files, not ~1,800).
    held = [d for d in load_documents([{"kind": "stdlib"}], "heldout") if not d.key.startswith("stdlib:encodings/")][:5]
    for text in [*train_texts[:3], *(d.text for d in held)]:
        assert _round_trips(tok, text)
    text = "\n".join(d.text for d in held)
    ratio = len(text.encode()) / len(tok.encode(text))
    assert ratio > 2.0, f"BPE should merge common code spans, got {ratio:.2f} bytes/token"


def test_special_tokens_have_fixed_ids(tok):
    assert SPECIAL_TOKENS == [EOS_TOKEN, PAD_TOKEN, MASK_TOKEN]
    assert (tok.eos_token_id, tok.pad_token_id, tok.mask_token_id) == (0, 1, 2)
    assert tok.bos_token is None and tok.bos_token_id is None
    assert len(tok) == VOCAB
    assert tok.encode(MASK_TOKEN) == [2] and len(tok) > 2
    assert tok.convert_ids_to_tokens([0, 1, 2]) == SPECIAL_TOKENS


def test_encode_adds_no_special_tokens(tok):
    ids = tok.encode("x = 1")
    assert ids == tok("x = 1")["input_ids"]
    assert not set(ids) & {0, 1, 2}
    assert tok.encode("") == []


def test_save_and_reload_is_identical(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.get_vocab() == tok.get_vocab()
    assert (loaded.eos_token_id, loaded.pad_token_id, loaded.mask_token_id) == (0, 1, 2)
    assert loaded.bos_token_id is None
    for s in [*HAND_STRINGS, *random_strings(100, seed=1)]:
        assert loaded.encode(s) == tok.encode(s), repr(s)
        assert _round_trips(loaded, s), repr(s)


def test_training_is_deterministic(tok, train_texts):
    again = train_bpe_tokenizer(train_texts, vocab_size=VOCAB, max_train_bytes=TRAIN_BYTES)
    assert again.backend_tokenizer.to_str() == tok.backend_tokenizer.to_str()


def test_training_is_deterministic_across_processes(tok, train_texts, tmp_path):
    """Rust hash maps are seeded per process; the merges must not depend on that."""
    corpus = tmp_path / "texts.json"
    corpus.write_text(json.dumps(train_texts))
    code = (
        "import hashlib, json, sys; from dflash2.tokenizer import train_bpe_tokenizer; "
        "t = train_bpe_tokenizer(json.load(open(sys.argv[1])), vocab_size=int(sys.argv[2]), "
        "max_train_bytes=int(sys.argv[3])); "
        "print(hashlib.sha256(t.backend_tokenizer.to_str().encode()).hexdigest())"
    )
    env = subprocess_env()
    out = subprocess.run(
        [sys.executable, "-c", code, str(corpus), str(VOCAB), str(TRAIN_BYTES)],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.strip() == hashlib.sha256(tok.backend_tokenizer.to_str().encode()).hexdigest()


def test_max_train_bytes_limits_what_is_read():
    texts = ["aaaa bbbb " * 100, "zzzz yyyy " * 100]
    first_only = train_bpe_tokenizer(iter(texts), vocab_size=300, max_train_bytes=10)
    both = train_bpe_tokenizer(texts, vocab_size=300, max_train_bytes=None)
    assert "zzzz" not in first_only.get_vocab() and "zzzz" in both.get_vocab()
    assert "aaaa" in first_only.get_vocab()


def test_training_errors():
    with pytest.raises(DFlash2Error, match="vocab_size 100"):
        train_bpe_tokenizer(["abc"], vocab_size=100)
    with pytest.raises(DFlash2Error, match="no text"):
        train_bpe_tokenizer([], vocab_size=300)


def test_encode_documents_separates_documents_with_eos(tok):
    texts = ["def f():\n    pass\n", "x = 1", "", "emoji 😀"]
    ids = encode_documents(
        tok, [Document(f"k{i}", t, "dir") for i, t in enumerate(texts)], batch_size=3, show_progress=False
    )
    assert ids.dtype == np.int32 and ids.ndim == 1
    expected = [i for t in texts for i in [*tok.encode(t), tok.eos_token_id]]
    assert ids.tolist() == expected
    assert (ids == 0).sum() == len(texts)
    pieces = tok.decode(ids.tolist(), skip_special_tokens=False).split(EOS_TOKEN)
    assert pieces == [*texts, ""]
    no_eos = encode_documents(tok, iter(texts), add_eos=False, show_progress=False)
    assert no_eos.tolist() == [i for t in texts for i in tok.encode(t)]
    assert encode_documents(tok, [], show_progress=False).shape == (0,)
