"""Prompts for response regeneration (issue 3).

Code corpora: a prompt is a file's prefix of random length (in tokens), so the
target continues real code from a real point. (Chat datasets, whose prompts are
the user turns, are not wired into training yet.) Prompts are grouped so that
every batch of `batch_size` prompts shares one length: batched generation then
needs no padding, which matters for hybrid GDN targets whose recurrent layers
would otherwise fold pad tokens into their state.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

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
