"""Prompt sets for acceptance evaluation (issues 4, 11).

* ``heldout``: a seeded random sample of the held-out split of the data the drafter
  was trained on (``DrafterConfig.training_data``), as fixed-length token prompts at
  random offsets (or file heads): the target continues real code from a real point,
  on documents that neither the drafter nor any near-copy of them was trained on
  (docs/CORPUS.md). No chat template: these are continuation prompts, not conversations.
* ``ood``: the same from this interpreter's site-packages, code that no training
  source of the run contains (``dflash2.eval.sampled_prompts``).
* a ``.jsonl`` file with one ``{"prompt": "..."}`` or one conversation (OpenAI
  ``{"messages": [...]}`` or ShareGPT ``{"conversations": [...]}``, evaluated up to
  its first assistant turn) per line; blank lines are skipped, conversation rows
  that cannot be used (an unknown role, no user turn) are counted and skipped. For
  a drafter trained on chat data the template it was trained with is applied
  (``dflash2.eval.chat_prompts``); otherwise the tokenizer's chat template when it
  has one (turns + generation prompt), else the text is encoded as is. A file is
  evaluated whole unless a count is asked for, and a prompt that is text of the
  run's train split is refused (``dflash2.eval.train_overlap``).
* ``heldout`` for a drafter trained on chat data: first-turn prompts of the held-out
  conversations of its chat data (``dflash2.eval.chat_prompts``).

Every user mistake is a one-line ``DFlash2Error`` naming the file and 1-based line.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from dflash2.data.chat_format import BAD_ROW_REASONS, BadRow, render_prompt
from dflash2.errors import DFlash2Error

log = logging.getLogger(__name__)
HELDOUT = "heldout"
OOD = "ood"
DEFAULT_SAMPLE_SIZE = 32  # prompts drawn from heldout / ood when no count is asked for


@dataclass
class Prompt:
    """One prompt: its text (decoded back for corpus prompts), its token ids, where it came from
    (a document key, or FILE:LINE) and, for corpus prompts, its token offset in that document."""

    text: str
    ids: list[int]
    source: str
    offset: int | None = None


@dataclass
class PromptSet:
    """Prompts and what results.json records about them: the set, seed, settings, the data split
    the drafter was trained on, counts, why fewer prompts than asked or available were made, and
    every prompt's key and offset."""

    prompts: list[Prompt]
    info: dict = field(default_factory=dict)


def load_prompts(
    spec: str,
    tokenizer,
    *,
    num_prompts: int | None = None,
    prompt_tokens: int = 64,
    chat_template: bool = True,
    **options,
) -> list[Prompt]:
    """The prompts of :func:`prompt_set` (same arguments)."""
    return prompt_set(
        spec, tokenizer, num_prompts=num_prompts, prompt_tokens=prompt_tokens, chat_template=chat_template, **options
    ).prompts


def prompt_set(
    spec: str,
    tokenizer,
    *,
    num_prompts: int | None = None,
    prompt_tokens: int = 64,
    prompts_per_document: int = 1,
    position: str = "random",
    seed: int = 0,
    training_data: dict | None = None,
    chat_template: bool = True,
) -> PromptSet:
    """``spec`` = "heldout", "ood" or a path to a .jsonl file -> a PromptSet.

    num_prompts: None = a whole file, or DEFAULT_SAMPLE_SIZE prompts drawn from heldout / ood.
    prompt_tokens, prompts_per_document, position ("random" offsets or "head"), seed: how
    heldout / ood prompts are drawn. training_data: the drafter's record of its data split
    (None: the default data config). Raises DFlash2Error on an empty set, a missing/bad file,
    a missing tokenizer, or a prompt from the train split.
    """
    from dflash2.data.split_record import DEFAULT_RECORD

    if tokenizer is None:
        raise DFlash2Error(
            "the target has no tokenizer, so text prompts cannot be encoded; save a tokenizer "
            "with the target (save_pretrained) or pass token ids"
        )
    if num_prompts is not None and num_prompts < 1:
        raise DFlash2Error(f"num_prompts={num_prompts} must be >= 1 (or null for all)")
    record = dict(training_data or DEFAULT_RECORD)
    spec = str(spec)
    if spec == HELDOUT and record.get("chat"):
        from dflash2.eval.chat_prompts import heldout_chat_set

        prompts, info = heldout_chat_set(tokenizer, record, num_prompts or DEFAULT_SAMPLE_SIZE, seed)
    elif spec in (HELDOUT, OOD):
        prompts, info = _sampled_set(
            spec, tokenizer, record, num_prompts, prompt_tokens, prompts_per_document, position, seed
        )
    else:
        prompts, info = _file_set(spec, tokenizer, record, num_prompts, chat_template)
    if not prompts:
        raise DFlash2Error(f"the prompt set is empty: {info['shortfall']}; add prompts or use prompts=heldout")
    info["data_split"] = record
    info["prompts"] = [{"key": p.source, "offset": p.offset} for p in prompts]
    return PromptSet(prompts, info)


def heldout_prompts(
    tokenizer, *, num_prompts: int | None, prompt_tokens: int, sources=None, seed: int = 0, **options
) -> list[Prompt]:
    """A seeded sample of prompts of the held-out split of ``sources`` (default: the stdlib) with the
    default split settings; ``options`` as in :func:`prompt_set`."""
    from dflash2.data.split_record import DEFAULT_RECORD

    record = {**DEFAULT_RECORD, "sources": list(sources or DEFAULT_RECORD["sources"])}
    return load_prompts(
        HELDOUT,
        tokenizer,
        num_prompts=num_prompts,
        prompt_tokens=prompt_tokens,
        seed=seed,
        training_data=record,
        **options,
    )


def _sampled_set(spec, tokenizer, record, num_prompts, prompt_tokens, prompts_per_document, position, seed):
    from dflash2.eval.sampled_prompts import heldout_candidates, ood_candidates, sample_prompts

    keep = None
    if spec == HELDOUT:
        keys, read = heldout_candidates(record)
        where = "the held-out split"
    else:
        keys, read, keep = ood_candidates(record, int(record["max_file_bytes"]))
        where = "site-packages"
    asked = num_prompts or DEFAULT_SAMPLE_SIZE
    prompts, counts = sample_prompts(
        keys,
        read,
        tokenizer,
        num_prompts=asked,
        prompt_tokens=prompt_tokens,
        prompts_per_document=prompts_per_document,
        position=position,
        seed=seed,
        keep=keep,
    )
    info = {
        "set": spec,
        "seed": int(seed),
        "prompt_tokens": int(prompt_tokens),
        "prompts_per_document": int(prompts_per_document),
        "position": position,
        "asked": asked,
        "made": len(prompts),
        **counts,
        "shortfall": None,
    }
    if len(prompts) < asked:
        over = counts["documents_passed_over"]
        reasons = [
            f"{over['too_short']} shorter than prompt_tokens={prompt_tokens}" if over["too_short"] else "",
            f"{over['near_train']} near-duplicates of train documents" if over["near_train"] else "",
            f"{over['unreadable']} empty or larger than max_file_bytes" if over["unreadable"] else "",
        ]
        reasons = ", ".join(r for r in reasons if r) or "none passed over"
        info["shortfall"] = (
            f"{len(prompts)} of {asked} prompts asked: {where} has {len(keys)} documents ({reasons}) "
            f"and each gives at most prompts_per_document={prompts_per_document}"
        )
    return prompts, info


def _file_set(path, tokenizer, record, num_prompts, chat_template):
    from dflash2.corpus import load_documents
    from dflash2.data.split_record import corpus_kwargs
    from dflash2.eval.chat_prompts import chat_train_documents
    from dflash2.eval.train_overlap import check_not_from_train

    template = (record.get("chat") or {}).get("template")
    skipped: dict[str, int] = {}
    prompts = jsonl_prompts(path, tokenizer, chat_template=chat_template, template=template, skipped=skipped)
    in_file = len(prompts)
    if num_prompts is not None:
        prompts = prompts[:num_prompts]
    info = {"set": str(path), "asked": num_prompts, "in_file": in_file, "made": len(prompts), "shortfall": None}
    if skipped:
        info["skipped_rows"] = skipped
        log.warning("%s: skipped %s", path, ", ".join(f"{n} {BAD_ROW_REASONS[r]}" for r, n in sorted(skipped.items())))
    if num_prompts is not None and in_file < num_prompts:
        info["shortfall"] = f"{in_file} of {num_prompts} prompts asked: {path} has {in_file}"
    elif len(prompts) < in_file:
        info["shortfall"] = f"the first {len(prompts)} of the {in_file} prompts in {path} (num_prompts={num_prompts})"
    if not in_file:
        info["shortfall"] = f"no prompts in {path}"
        return prompts, info
    try:
        train = load_documents(record["sources"], "train", **corpus_kwargs(record)) + chat_train_documents(record)
    except DFlash2Error as e:  # trained elsewhere: say the check was not made, and why
        info["train_split_check"] = {"passed": None, "not_made_because": str(e)}
        log.warning("prompts were not checked against the drafter's train split: %s", e)
    else:
        info["train_split_check"] = check_not_from_train(prompts, train)
    return prompts, info


def jsonl_prompts(
    path,
    tokenizer,
    *,
    num_prompts: int | None = None,
    chat_template: bool = True,
    template: str | None = None,
    skipped: dict | None = None,
) -> list[Prompt]:
    """The first ``num_prompts`` (None: all) prompts of a jsonl file.

    A line that is not a JSON object with a non-empty "prompt" string or a "messages" /
    "conversations" list raises DFlash2Error naming the file and line; a conversation that cannot
    be used is skipped and counted in ``skipped`` (reason -> count). template: "plain" or
    "tokenizer" (``chat_format.render_prompt``, what a chat-trained drafter saw), None: see
    :func:`encode_chat`.
    """
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
            try:
                messages = _messages(row, where)
            except BadRow as e:
                if skipped is not None:
                    skipped[e.reason] = skipped.get(e.reason, 0) + 1
                continue
            ids = (
                render_prompt(messages, tokenizer, template)
                if template
                else encode_chat(messages, tokenizer, chat_template)
            )
            out.append(Prompt(text=messages[-1]["content"], ids=ids, source=f"{path.name}:{lineno}"))
            if num_prompts is not None and len(out) == num_prompts:
                break
    return out


def _messages(row, where: str) -> list[dict]:
    """A jsonl row -> chat messages (a conversation up to its first assistant turn); DFlash2Error
    naming the line when it is no prompt row at all, BadRow when it is a conversation that cannot be used."""
    if isinstance(row, dict) and "prompt" in row:
        if not isinstance(row["prompt"], str) or not row["prompt"]:
            raise DFlash2Error(f'{where}: "prompt" must be a non-empty string, got {row["prompt"]!r}')
        return [{"role": "user", "content": row["prompt"]}]
    if isinstance(row, dict) and (isinstance(row.get("messages"), list) or isinstance(row.get("conversations"), list)):
        from dflash2.eval.chat_prompts import row_prompt_messages

        return row_prompt_messages(row)
    raise DFlash2Error(
        f'{where}: expected a JSON object with a "prompt" string (or "messages" / "conversations"), '
        f"got {json.dumps(row)[:80]}"
    )


def encode_chat(messages: list[dict], tokenizer, chat_template: bool = True) -> list[int]:
    """Turns -> ids: through the chat template (with the generation prompt) when the tokenizer has
    one, else the contents joined by newlines. The template is rendered to text and then encoded
    without extra special tokens (templates carry their own), which works the same on every
    transformers version (``tokenize=True`` changed its return type in v5)."""
    if chat_template and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer("\n".join(m["content"] for m in messages))["input_ids"])
