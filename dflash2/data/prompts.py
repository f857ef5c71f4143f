"""Prompts for response regeneration (issue 3).

Code corpora: a prompt is a file's prefix of random length (in tokens), so the
target continues real code from a real point. Chat data: a prompt is a
conversation up to one of its assistant turns, through the chat template
(ARCHITECTURE.md §2.8). Prompts are grouped so that every batch shares one
length: batched generation then needs no padding, which matters for hybrid GDN
targets whose recurrent layers would otherwise fold pad tokens into their state.
Chat prompts cannot be cut to a drawn length, so only prompts of equal length
share a batch (on real chat data most batches hold a single prompt).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from dflash2.data.chat_format import BadRow, Conversation, RowCounts, render_prompt, turn_prompts
from dflash2.errors import DFlash2Error


@dataclass
class PromptBatch:
    """`input_ids` (n, P) int64 numpy array, all prompts of the batch the same length P; `keys` the documents."""

    input_ids: np.ndarray
    keys: list[str]


def code_prompt_batches(
    documents, tokenizer, *, num_prompts: int, min_tokens: int, max_tokens: int, batch_size: int, seed: int
) -> list[PromptBatch]:
    """Draw `num_prompts` file-prefix prompts in equal-length batches.

    Documents shorter than a batch's drawn length are skipped for that batch;
    documents are drawn with replacement once the set is exhausted (a prefix
    length differs, so the prompt usually does too).
    """
    if num_prompts <= 0:
        return []
    if min_tokens < 1 or max_tokens < min_tokens:
        raise DFlash2Error(
            f"data.prompt_min_tokens={min_tokens} / prompt_max_tokens={max_tokens}: need 1 <= min <= max"
        )
    rng = np.random.default_rng(seed)
    documents = list(documents)
    if not documents:
        raise DFlash2Error("no documents to draw prompts from; check data.sources")
    # Encode lazily and only a text prefix long enough for the longest prompt
    # (~12 chars/token is generous for code): the corpus is tens of MB and a
    # run needs a few hundred prompts.
    encoded: dict[int, list[int]] = {}

    def tokens_of(i: int) -> list[int]:
        if i not in encoded:
            encoded[i] = tokenizer(documents[i].text[: max_tokens * 12], add_special_tokens=False)["input_ids"]
        return encoded[i]

    order = rng.permutation(len(documents))
    batches, made, cursor = [], 0, 0
    while made < num_prompts:
        n = min(batch_size, num_prompts - made)
        length = int(rng.integers(min_tokens, max_tokens + 1))
        rows, keys, tries = [], [], 0
        # Draws are with replacement, so a small split can still fill a large batch.
        while len(rows) < n and tries < 4 * (len(documents) + n):
            i = int(order[cursor % len(order)])
            cursor += 1
            tries += 1
            ids = tokens_of(i)
            if len(ids) >= length:
                rows.append(ids[:length])
                keys.append(documents[i].key)
        if len(rows) < n:
            if length == min_tokens:
                raise DFlash2Error(
                    f"no document has at least data.prompt_min_tokens={min_tokens} tokens; "
                    "lower it or add corpus sources"
                )
            max_tokens = max(min_tokens, length - 1)  # no document this long: draw shorter prompts
            continue
        batches.append(PromptBatch(np.asarray(rows, dtype=np.int64), keys))
        made += n
    return batches


def chat_prompt_batches(
    conversations: Iterable[Conversation],
    tokenizer,
    *,
    template: str,
    num_prompts: int | None,
    max_tokens: int,
    batch_size: int,
    counts: RowCounts,
) -> list[PromptBatch]:
    """One prompt per assistant turn (``chat_format.turn_prompts``) until ``num_prompts`` (None: all).

    Conversations are taken in the given order; one without an assistant turn is skipped and
    counted, and so is a turn whose prompt is over ``max_tokens`` tokens (``counts.turns`` counts
    the prompts made). Batches group prompts of equal length, shortest first; ``keys`` name the
    conversation and turn.
    """
    prompts: list[tuple[list[int], str]] = []
    for conversation in conversations:
        if num_prompts is not None and len(prompts) >= num_prompts:
            break
        try:
            turns = turn_prompts(conversation.messages)
        except BadRow as e:
            counts.skip(e.reason)
            continue
        for t, messages in enumerate(turns):
            ids = render_prompt(messages, tokenizer, template)
            if len(ids) > max_tokens:
                counts.skip("over_long")
                continue
            if num_prompts is None or len(prompts) < num_prompts:
                prompts.append((ids, f"{conversation.key}#{t}"))
    counts.turns = len(prompts)
    order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i][0]), i))
    batches: list[PromptBatch] = []
    for i in order:
        ids, key = prompts[i]
        last = batches[-1] if batches else None
        if last is not None and last.input_ids.shape[1] == len(ids) and len(last.keys) < batch_size:
            last.input_ids = np.vstack([last.input_ids, np.asarray([ids], dtype=np.int64)])
            last.keys.append(key)
        else:
            batches.append(PromptBatch(np.asarray([ids], dtype=np.int64), [key]))
    return batches
