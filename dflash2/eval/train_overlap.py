"""Refuse evaluation prompts that are text of the drafter's train split.

τ measured on text the drafter trained on overstates what it buys on new text. A
prompt is refused when, with whitespace runs collapsed, it is a passage of a train
document or contains a whole train document, of at least ``MIN_OVERLAP_CHARS``
characters: shorter shared spans (an import line, ``if __name__ == "__main__":``)
recur across unrelated files and say nothing about where a prompt came from.
"""

from __future__ import annotations

import bisect

from dflash2.errors import DFlash2Error

MIN_OVERLAP_CHARS = 100  # about 35 tokens of code, a few lines


def check_not_from_train(prompts, train_docs) -> dict:
    """Raise a one-line DFlash2Error naming the first prompt that is train text and the document it
    comes from; else return a summary of the check for results.json."""
    texts = [" ".join(d.text.split()) for d in train_docs]
    joined = "\0".join(texts)  # one string: one fast substring search per prompt
    starts = [0]
    for t in texts[:-1]:
        starts.append(starts[-1] + len(t) + 1)
    by_length = sorted((len(t), i) for i, t in enumerate(texts) if len(t) >= MIN_OVERLAP_CHARS)
    for p in prompts:
        text = " ".join(p.text.split())
        if len(text) < MIN_OVERLAP_CHARS:
            continue
        at = joined.find(text)
        if at >= 0:
            _refuse(p.source, "is a passage of", train_docs[bisect.bisect_right(starts, at) - 1].key)
        for _, i in by_length[: bisect.bisect_right(by_length, (len(text), len(texts)))]:
            if texts[i] in text:
                _refuse(p.source, "contains", train_docs[i].key)
    return {"prompts_checked": len(prompts), "train_documents": len(train_docs), "passed": True}


def _refuse(prompt: str, relation: str, key: str) -> None:
    raise DFlash2Error(
        f"prompt {prompt} {relation} {key}, a document of this drafter's train split; τ on training text "
        "overstates the drafter: remove the prompt or use prompts=heldout"
    )
