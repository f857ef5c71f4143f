"""Conversations: the two dataset layouts, the roles they use, rows that cannot be used,
and the chat template that turns a conversation into a prompt (ARCHITECTURE.md §2.8).

Layouts (one row = one conversation):

* ShareGPT: ``{"conversations": [{"from": "human" | "gpt" | "system", "value": str}, ...]}``
* OpenAI:   ``{"messages": [{"role": "user" | "assistant" | "system", "content": str}, ...]}``

Both become a list of ``{"role": "system" | "user" | "assistant", "content": str}``.
A row that cannot be used raises :class:`BadRow` with one of :data:`BAD_ROW_REASONS`;
readers count and skip such rows (:class:`RowCounts`), they never stop half-way.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field

from dflash2.errors import DFlash2Error
from dflash2.tokenizer import CHAT_TEMPLATE

# Speaker names seen in public chat sets -> the three roles chat templates know. Anything else
# (tool calls, function results, "observation") is an unknown role: its template differs per model.
ROLES = {
    "system": "system",
    "developer": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
}
BAD_ROW_REASONS = {  # reason -> what the summary line calls the skipped items
    "malformed": "malformed rows",
    "unknown_role": "rows with an unknown role",
    "no_assistant": "rows without an assistant turn after a user turn",
    "over_long": "turn prompts over data.prompt_max_tokens",
}
TEMPLATES = ("auto", "tokenizer", "plain")


@dataclass
class Conversation:
    """A usable conversation: ``key`` is stable (its split follows from it or from its document),
    ``messages`` are [{role, content}] with roles system / user / assistant."""

    key: str
    messages: list[dict]


class BadRow(Exception):
    """A row that cannot be used; ``reason`` is a key of BAD_ROW_REASONS."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}{': ' + detail if detail else ''}")
        self.reason = reason


@dataclass
class RowCounts:
    """How many conversations were read and why some were skipped; ``turns`` = assistant turns used."""

    read: int = 0
    turns: int = 0
    skipped: Counter = field(default_factory=Counter)

    def skip(self, reason: str) -> None:
        self.skipped[reason] += 1

    def summary(self, what: str) -> str:
        """One line such as 'chat train: 120 conversations read, 130 assistant turns used; skipped: 2 rows
        with an unknown role, 1 turn prompts over data.prompt_max_tokens'."""
        reasons = ", ".join(f"{n} {BAD_ROW_REASONS[r]}" for r, n in sorted(self.skipped.items()))
        return (
            f"{what}: {self.read} conversations read, {self.turns} assistant turns used; skipped: {reasons or 'none'}"
        )

    def to_dict(self) -> dict:
        return {"read": self.read, "turns": self.turns, "skipped": dict(sorted(self.skipped.items()))}


def conversation_messages(row) -> list[dict]:
    """A row in either layout -> messages [{role, content}]; BadRow when it is unusable."""
    if not isinstance(row, dict):
        raise BadRow("malformed", f"a {type(row).__name__}, not an object")
    if isinstance(row.get("conversations"), list):
        turns, role_key, text_key = row["conversations"], "from", "value"
    elif isinstance(row.get("messages"), list):
        turns, role_key, text_key = row["messages"], "role", "content"
    else:
        raise BadRow("malformed", 'no "conversations" or "messages" list')
    messages = []
    for turn in turns:
        if not isinstance(turn, dict) or not isinstance(turn.get(text_key), str):
            raise BadRow("malformed", f'a turn without a string "{text_key}"')
        role = ROLES.get(str(turn.get(role_key, "")).lower())
        if role is None:
            raise BadRow("unknown_role", repr(turn.get(role_key)))
        messages.append({"role": role, "content": turn[text_key]})
    return messages


def turn_prompts(messages: list[dict]) -> list[list[dict]]:
    """For every assistant turn that follows a user turn: the messages before it (its prompt).

    Each assistant turn is regenerated from the conversation's own earlier turns. BadRow
    ("no_assistant") when there is none.
    """
    prompts, seen_user = [], False
    for i, m in enumerate(messages):
        seen_user |= m["role"] == "user"
        if m["role"] == "assistant" and seen_user:
            prompts.append(messages[:i])
    if not prompts:
        raise BadRow("no_assistant")
    return prompts


def first_turn_prompt(messages: list[dict]) -> list[dict]:
    """The conversation up to its first assistant turn (all of it when it has none): an evaluation prompt.
    BadRow ("malformed") when that part has no user turn."""
    cut = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
    prompt = messages[:cut]
    if not any(m["role"] == "user" for m in prompt):
        raise BadRow("malformed", "no user turn before the first assistant turn")
    return prompt


def canonical_text(messages: list[dict]) -> str:
    """A stable text of a conversation: what its key hashes and near-duplicate detection compares."""
    return json.dumps(messages, ensure_ascii=False, sort_keys=True)


def resolve_template(choice: str, tokenizer) -> str:
    """data.chat.template -> "tokenizer" (the target tokenizer's own chat template) or "plain"
    (the project's role-marker template, ``dflash2.tokenizer.CHAT_TEMPLATE``); "auto" picks the
    tokenizer's when it has one."""
    if choice not in TEMPLATES:
        raise DFlash2Error(f"data.chat.template={choice!r}: use one of {', '.join(TEMPLATES)}")
    has_own = bool(getattr(tokenizer, "chat_template", None))
    if choice == "tokenizer" and not has_own:
        raise DFlash2Error(
            "data.chat.template=tokenizer but the target tokenizer has no chat template; use auto or plain"
        )
    if choice == "auto":
        return "tokenizer" if has_own else "plain"
    return choice


def render_prompt(messages: list[dict], tokenizer, template: str) -> list[int]:
    """Prompt ids of ``messages`` with the generation prompt (the assistant header) appended.

    template: "tokenizer" or "plain" (see resolve_template). The template is rendered to text and
    encoded without extra special tokens (templates carry their own), which behaves the same on
    every transformers version (``tokenize=True`` changed its return type in v5).
    """
    kw = {"chat_template": CHAT_TEMPLATE} if template == "plain" else {}
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kw)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
