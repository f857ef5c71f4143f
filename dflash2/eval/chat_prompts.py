"""Chat prompts for acceptance evaluation (ARCHITECTURE.md §2.8).

A conversation row (ShareGPT ``conversations`` or OpenAI ``messages``) is evaluated on the
conversation up to its first assistant turn, through the chat template the drafter was trained
with (``DrafterConfig.training_data["chat"]["template"]``). ``prompts=heldout`` for a drafter
trained on chat data draws such prompts from the held-out conversations of its own chat data
(for the embedded set: conversations made from held-out documents). Rows that cannot be used
are counted and skipped, as in training.
"""

from __future__ import annotations

import logging

from dflash2.data.chat_format import BadRow, RowCounts, conversation_messages, first_turn_prompt, render_prompt
from dflash2.data.chat_sources import conversation_documents, iter_conversations
from dflash2.eval.prompts import Prompt

log = logging.getLogger(__name__)


def row_prompt_messages(row) -> list[dict]:
    """A conversation row -> the messages up to its first assistant turn; BadRow when unusable."""
    return first_turn_prompt(conversation_messages(row))


def heldout_chat_set(tokenizer, record: dict, num_prompts: int, seed: int) -> tuple[list[Prompt], dict]:
    """Up to ``num_prompts`` first-turn prompts of the held-out conversations, in a seeded order.

    A prompt over the record's ``prompt_max_tokens`` is skipped, as training skipped it.
    """
    chat = record["chat"]
    counts, prompts = RowCounts(), []
    for conversation in iter_conversations(record, "heldout", seed, counts):
        if len(prompts) >= num_prompts:
            break
        try:
            messages = first_turn_prompt(conversation.messages)
        except BadRow as e:
            counts.skip(e.reason)
            continue
        ids = render_prompt(messages, tokenizer, chat["template"])
        if len(ids) > int(chat["prompt_max_tokens"]):
            counts.skip("over_long")
            continue
        prompts.append(Prompt(text=messages[-1]["content"], ids=ids, source=conversation.key))
    counts.turns = len(prompts)
    if counts.skipped:
        log.warning(counts.summary("held-out chat prompts"))
    info = {"set": "heldout", "chat": True, "seed": int(seed), "asked": num_prompts, "made": len(prompts)}
    info.update(rows=counts.to_dict(), shortfall=None)
    if len(prompts) < num_prompts:
        info["shortfall"] = (
            f"{len(prompts)} of {num_prompts} prompts asked: {counts.summary('the held-out chat split')}"
        )
    return prompts, info


def chat_train_documents(record: dict) -> list:
    """The train-split conversations of the record's chat datasets, for the train-text check
    (embedded conversations are made from corpus documents, which the check reads anyway)."""
    return conversation_documents(record, "train") if record.get("chat") else []
