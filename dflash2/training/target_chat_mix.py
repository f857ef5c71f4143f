"""Templated instruction -> code conversations mixed into the embedded target's pretraining stream
(``target.recipe.chat_fraction``; ARCHITECTURE.md §2.8, §8).

A target pretrained on raw code only has never seen the chat template, so its greedy reply to
every ``data=chat`` prompt is a loop of marker-like lines and chat τ measures nothing. With
``chat_fraction = f > 0`` the build adds conversations of the embedded chat set
(:func:`dflash2.data.chat_embedded.document_conversations`: "Write the Python module X",
"Complete this function: ..."), rendered whole (user turn, assistant marker, the code, EOS) with the
project's plain template -- the same text ``data=chat`` with ``template: auto`` gives the embedded
target as a prompt -- so the target learns to answer them with code and to stop.

Only the build's own train documents are used: the split that already feeds its code stream, so
no validation or held-out document (hence no held-out chat prompt) reaches the target, as for code.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from dflash2.corpus import Document
from dflash2.data.chat_embedded import document_conversations
from dflash2.data.chat_sources import EMBEDDED_VERSION
from dflash2.errors import DFlash2Error
from dflash2.tokenizer import CHAT_TEMPLATE, encode_documents

log = logging.getLogger(__name__)
RECIPE_KEY = "chat_fraction"


def chat_fraction(recipe: Mapping) -> float:
    """``recipe.chat_fraction`` (absent = 0): the share of the pretraining token stream that is chat."""
    raw = recipe.get(RECIPE_KEY) or 0
    try:
        value = float(raw)
    except (TypeError, ValueError):
        value = float("nan")
    if not 0.0 <= value < 1.0:  # 1.0 would leave no code at all, and the target must still write code
        raise DFlash2Error(f"target.recipe.{RECIPE_KEY}={raw!r}: use a fraction in [0, 1), e.g. 0.25 (0 = code only)")
    return value


def chat_mix_cache_entry(recipe: Mapping) -> dict | None:
    """What the chat mix adds to the target cache key: None at fraction 0 (the key stays that of a
    code-only target); else the fraction plus what decides the conversations' text (the embedded
    set's version and the template), so a change to either rebuilds the target."""
    fraction = chat_fraction(recipe)
    if fraction == 0.0:
        return None
    template = hashlib.sha256(CHAT_TEMPLATE.encode()).hexdigest()[:12]
    return {"fraction": fraction, "embedded_version": EMBEDDED_VERSION, "template": template}


@dataclass
class ChatMix:
    """The chat part of the stream: ``tokens`` (N,) int32 (each conversation ends in EOS) and the
    keys of the conversations in it, in stream order (their document keys are train documents)."""

    tokens: np.ndarray
    keys: list[str]


def render_conversation(messages: list[dict], tokenizer) -> str:
    """A whole conversation in the plain template: ``render_prompt``'s prompt text, then the reply."""
    return tokenizer.apply_chat_template(messages, tokenize=False, chat_template=CHAT_TEMPLATE)


def conversations_in_order(train_docs: Sequence[Document], seed: int) -> Iterator[tuple[str, list[dict]]]:
    """(key, messages) of the train documents' conversations, documents in a seeded order (a budget
    smaller than the set still spans the whole corpus rather than its alphabetically first modules)."""
    for i in np.random.default_rng([seed, 1]).permutation(len(train_docs)).tolist():
        for conversation in document_conversations(train_docs[i]):
            yield conversation.key, conversation.messages


def chat_pretraining_tokens(
    train_docs: Sequence[Document], tokenizer, code_tokens: int, fraction: float, seed: int
) -> ChatMix:
    """Encoded conversations until they are ``fraction`` of the code + chat stream (whole
    conversations, so the last one may overshoot a little). A corpus too small for the budget gives
    all it has and says so: the fraction is then lower than asked."""
    budget = round(code_tokens * fraction / (1.0 - fraction)) if fraction > 0 else 0
    chunks: list[np.ndarray] = []
    keys: list[str] = []
    total = 0
    for key, messages in conversations_in_order(train_docs, seed):
        if total >= budget:
            break
        # One conversation per call: a few thousand short encodes take seconds, and the budget is
        # checked between conversations.
        ids = encode_documents(tokenizer, [render_conversation(messages, tokenizer)], show_progress=False)
        chunks.append(ids)
        keys.append(key)
        total += len(ids)
    if total < budget:
        log.warning(
            f"chat pretraining: the train documents give only {total:,} of the {budget:,} chat tokens that "
            f"target.recipe.{RECIPE_KEY}={fraction} asks for; using them all"
        )
    tokens = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int32)
    return ChatMix(tokens=tokens, keys=keys)
