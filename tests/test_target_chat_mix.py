"""`target.recipe.chat_fraction` (dflash2/training/target_chat_mix.py): the embedded target's pretraining
stream gets templated instruction -> code conversations of train documents only, in the template that
`data=chat` prompts the embedded target with; the option is in the target cache key only when non-zero."""

from __future__ import annotations

import json
import re

import pytest

from dflash2.corpus import document_splits, load_documents
from dflash2.data.chat_format import render_prompt
from dflash2.errors import DFlash2Error
from dflash2.tokenizer import train_bpe_tokenizer
from dflash2.training.target_chat_mix import (
    chat_fraction,
    chat_mix_cache_entry,
    chat_pretraining_tokens,
    conversations_in_order,
    render_conversation,
)

# High split fractions so that a 60-file corpus has documents in every split.
SPLIT = {"validation_fraction": 0.2, "heldout_fraction": 0.2}


def _document_key(conversation_key: str) -> str:
    """'chat:embedded:dir:toy:m7.py:f' -> 'dir:toy:m7.py' (the document a conversation was made from)."""
    return conversation_key.removeprefix("chat:embedded:").rsplit(":", 1)[0]


@pytest.fixture(scope="module")
def toy_corpus(tmp_path_factory):
    """60 small modules with documented functions, as a `dir` source; its documents, split and tokenizer."""
    root = tmp_path_factory.mktemp("toy")
    for i in range(60):
        funcs = "\n\n".join(
            f'def f{i}_{j}(x):\n    """Return x times {j + i}."""\n    y = x * {j + i}\n    return y' for j in range(3)
        )
        (root / f"m{i}.py").write_text(f'"""Toy module {i}."""\n\n{funcs}\n', encoding="utf-8")
    sources = [{"kind": "dir", "path": str(root), "name": "toy"}]
    splits = document_splits(sources, **SPLIT)
    assert {"train", "validation", "heldout"} <= set(splits.values())
    train = load_documents(sources, "train", **SPLIT)
    tokenizer = train_bpe_tokenizer((d.text for d in train), vocab_size=300, max_train_bytes=None)
    return train, splits, tokenizer


def test_fraction_is_validated_and_absent_means_zero():
    assert chat_fraction({}) == 0.0 and chat_fraction({"chat_fraction": 0}) == 0.0
    assert chat_fraction({"chat_fraction": 0.25}) == 0.25
    for bad in (1.0, -0.1, "lots"):
        with pytest.raises(DFlash2Error, match="chat_fraction"):
            chat_fraction({"chat_fraction": bad})


def test_cache_entry_only_when_non_zero():
    assert chat_mix_cache_entry({}) is None and chat_mix_cache_entry({"chat_fraction": 0}) is None
    assert chat_mix_cache_entry({"chat_fraction": 0.25})["fraction"] == 0.25


def test_conversations_come_from_train_documents_only(toy_corpus):
    train, splits, tokenizer = toy_corpus
    code_tokens = 2000
    mix = chat_pretraining_tokens(train, tokenizer, code_tokens, 0.25, seed=0)
    assert mix.keys and {splits[_document_key(k)] for k in mix.keys} == {"train"}
    # Module and function requests both, and the stream is about a quarter of code + chat.
    assert any(k.endswith(":module") for k in mix.keys) and any(not k.endswith(":module") for k in mix.keys)
    assert 0.25 <= len(mix.tokens) / (code_tokens + len(mix.tokens)) < 0.3
    assert (mix.tokens == tokenizer.eos_token_id).sum() == len(mix.keys)  # each conversation ends in EOS
    text = tokenizer.decode(mix.tokens.tolist())
    assert text.count("# <|user|>\n") == text.count("# <|assistant|>\n") == len(mix.keys)
    named = set(re.findall(r"Write the Python module `([^`]+)`", text))
    assert named and all(splits[f"dir:toy:{n}"] == "train" for n in named)


def test_a_conversation_starts_with_the_prompt_data_chat_gives_the_embedded_target(toy_corpus):
    """data=chat with template auto renders the embedded target's prompts in the plain template; the
    pretraining text is that prompt followed by the reply, so the target sees its own prompt format."""
    train, _, tokenizer = toy_corpus
    for _, messages in list(conversations_in_order(train, seed=0))[:6]:
        prompt = tokenizer.decode(render_prompt(messages[:1], tokenizer, "plain"))
        whole = render_conversation(messages, tokenizer)
        assert whole == prompt + messages[1]["content"] + "\n"


def test_a_small_corpus_gives_what_it_has(toy_corpus, caplog):
    train, _, tokenizer = toy_corpus
    mix = chat_pretraining_tokens(train[:2], tokenizer, 10**7, 0.5, seed=0)
    assert len(mix.keys) == sum(1 for _ in conversations_in_order(train[:2], seed=0))
    assert "asks for; using them all" in caplog.text


def test_order_is_seeded(toy_corpus):
    train, _, tokenizer = toy_corpus
    a = chat_pretraining_tokens(train, tokenizer, 1000, 0.25, seed=0)
    assert a.keys == chat_pretraining_tokens(train, tokenizer, 1000, 0.25, seed=0).keys
    assert a.keys != chat_pretraining_tokens(train, tokenizer, 1000, 0.25, seed=1).keys


# ------------------------------------------------------------------ the build (Hydra, full stdlib split)


@pytest.mark.slow
def test_cache_key_default_unchanged_and_chat_fraction_in_it(tmp_path):
    from test_build_target import build_overrides, compose_cfg

    from dflash2.training.build_target import target_cache_key

    def key(*extra):
        return target_cache_key(compose_cfg(build_overrides(tmp_path, "k", tmp_path / "cache", *extra)))

    default = key()
    assert key("~target.recipe.chat_fraction") == default  # a recipe from before the option: the same target
    assert key("target.recipe.chat_fraction=0.25") != default
    assert key("target.recipe.chat_fraction=0.25") != key("target.recipe.chat_fraction=0.5")


@pytest.mark.slow
def test_micro_target_built_with_chat_trains_on_train_conversations(tmp_path, monkeypatch):
    from test_build_target import build

    import dflash2.training.build_target as bt

    seen = {}
    make_mix, make_windows = bt.chat_pretraining_tokens, bt.RandomWindows

    def record_mix(*args, **kwargs):
        seen["mix"] = make_mix(*args, **kwargs)
        return seen["mix"]

    def record_windows(tokens, *args):
        seen["stream"] = tokens
        return make_windows(tokens, *args)

    monkeypatch.setattr(bt, "chat_pretraining_tokens", record_mix)
    monkeypatch.setattr(bt, "RandomWindows", record_windows)
    summary = build(tmp_path, "run", tmp_path / "cache", "target.recipe.chat_fraction=0.25")

    mix, stream = seen["mix"], seen["stream"]
    assert (stream[-len(mix.tokens) :] == mix.tokens).all()  # the stream pretraining samples holds the chat
    splits = document_splits([{"kind": "stdlib"}])
    assert mix.keys and {splits[_document_key(k)] for k in mix.keys} == {"train"}
    info = json.loads((tmp_path / "run" / "target" / "build_info.json").read_text())
    assert info["chat_pretraining"]["conversations"] == len(mix.keys)
    assert 0.2 < info["chat_pretraining"]["fraction"] < 0.35
    assert summary["target_build"]["heldout_cross_entropy"] > 0  # it trained (3 micro steps) and was scored
