"""Prompt sets for acceptance evaluation (issue 4).

* ``heldout``: the held-out split of the embedded stdlib corpus (docs/CORPUS.md) as
  file-prefix prompts of a fixed token length: the target continues real code from
  a real point, on files neither it nor the drafter trained on. No chat template:
  these are continuation prompts, not conversations.
* a ``.jsonl`` file with one ``{"prompt": "..."}`` (or ``{"messages": [...]}``) per
  line; blank lines are skipped. The tokenizer's chat template is applied when it
  has one (user turn + generation prompt), otherwise the text is encoded as is.

Every user mistake is a one-line ``DFlash2Error`` naming the file and 1-based line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from dflash2.errors import DFlash2Error

HELDOUT = "heldout"


@dataclass
class Prompt:
    """One prompt: its text (decoded back for heldout prefixes), its token ids, and where it came from."""

    text: str
    ids: list[int]
    source: str


def load_prompts(
    spec: str, tokenizer, *, num_prompts: int | None = None, prompt_tokens: int = 64, chat_template: bool = True
) -> list[Prompt]:
    """``spec`` = "heldout" or a path to a .jsonl file -> up to ``num_prompts`` prompts (None = all).

    prompt_tokens: length of the heldout file-prefix prompts. Raises DFlash2Error on
    an empty set, a missing/bad file or a missing tokenizer.
    """
    if tokenizer is None:
        raise DFlash2Error(
            "the target has no tokenizer, so text prompts cannot be encoded; save a tokenizer "
            "with the target (save_pretrained) or pass token ids"
        )
    if num_prompts is not None and num_prompts < 1:
        raise DFlash2Error(f"num_prompts={num_prompts} must be >= 1 (or null for all)")
    if str(spec) == HELDOUT:
        prompts = heldout_prompts(tokenizer, num_prompts=num_prompts, prompt_tokens=prompt_tokens)
        where = f"the held-out corpus split (no file has {prompt_tokens} tokens)"
    else:
        prompts = jsonl_prompts(spec, tokenizer, num_prompts=num_prompts, chat_template=chat_template)
        where = str(spec)
    if not prompts:
        raise DFlash2Error(f"the prompt set is empty: no prompts in {where}; add prompts or use prompts=heldout")
    return prompts


def heldout_prompts(tokenizer, *, num_prompts: int | None, prompt_tokens: int, sources=None) -> list[Prompt]:
    """The first ``prompt_tokens`` tokens of held-out files (sorted by key; shorter files skipped)."""
    from dflash2.corpus import load_documents

    if prompt_tokens < 1:
        raise DFlash2Error(f"prompt_tokens={prompt_tokens} must be >= 1")
    out = []
    for doc in load_documents(sources or [{"kind": "stdlib"}], HELDOUT):
        ids = tokenizer(doc.text, add_special_tokens=False)["input_ids"]
        if len(ids) < prompt_tokens:
            continue
        ids = list(ids[:prompt_tokens])
        out.append(Prompt(text=tokenizer.decode(ids), ids=ids, source=doc.key))
        if num_prompts is not None and len(out) == num_prompts:
            break
    return out


def jsonl_prompts(path, tokenizer, *, num_prompts: int | None = None, chat_template: bool = True) -> list[Prompt]:
    """Prompts of a jsonl file; a line that is not a JSON object with a non-empty "prompt" string
    (or a "messages" list with a user turn) raises DFlash2Error naming the file and line."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise DFlash2Error(
            f'prompts file {path} not found; pass prompts=heldout or a .jsonl file of {{"prompt": ...}} lines'
        )
    out = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path} line {lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DFlash2Error(
                    f'{where} is not valid JSON ({e.msg}); each line must be {{"prompt": "..."}}'
                ) from None
            messages = _messages(row, where)
            out.append(
                Prompt(
                    text=messages[-1]["content"],
                    ids=encode_chat(messages, tokenizer, chat_template),
                    source=f"{path.name}:{lineno}",
                )
            )
            if num_prompts is not None and len(out) == num_prompts:
                break
    return out


def _messages(row, where: str) -> list[dict]:
    """A jsonl row -> chat messages (user turns only), or DFlash2Error naming the line."""
    if isinstance(row, dict) and "prompt" in row:
        if not isinstance(row["prompt"], str) or not row["prompt"]:
            raise DFlash2Error(f'{where}: "prompt" must be a non-empty string, got {row["prompt"]!r}')
        return [{"role": "user", "content": row["prompt"]}]
    if isinstance(row, dict) and isinstance(row.get("messages"), list):
        users = [
            m
            for m in row["messages"]
            if isinstance(m, dict) and m.get("role") == "user" and isinstance(m.get("content"), str)
        ]
        if not users:
            raise DFlash2Error(f'{where}: "messages" has no user turn with string content')
        return users
    raise DFlash2Error(
        f'{where}: expected a JSON object with a "prompt" string (or "messages"), got {json.dumps(row)[:80]}'
    )


def encode_chat(messages: list[dict], tokenizer, chat_template: bool = True) -> list[int]:
    """User turns -> ids: through the chat template (with the generation prompt) when the tokenizer has
    one, else the contents joined by newlines. The template is rendered to text and then encoded
    without extra special tokens (templates carry their own), which works the same on every
    transformers version (``tokenize=True`` changed its return type in v5)."""
    if chat_template and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer("\n".join(m["content"] for m in messages))["input_ids"])
