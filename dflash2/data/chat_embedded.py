"""The embedded chat set: instruction -> code conversations made from corpus documents (ARCHITECTURE.md §2.8).

No chat dataset ships with the machine, so the offline default turns each Python
document into conversations:

* "Write the Python module `json/decoder.py`."  ->  the module's source;
* "Complete this function:" + a function's signature and docstring  ->  the whole function
  (up to ``FUNCTIONS_PER_DOCUMENT`` documented functions or methods per document, dedented).

A conversation belongs to the split of the document it was made from, so held-out chat
prompts come from held-out documents. The assistant turns here are only placeholders:
training regenerates them with the target.
"""

from __future__ import annotations

import ast
import textwrap

from dflash2.corpus import Document
from dflash2.data.chat_format import Conversation

FUNCTIONS_PER_DOCUMENT = 2  # a few conversations per file: the set is varied without one file dominating
MAX_FUNCTION_LINES = 60  # longer functions make prompts far over any prompt budget
MODULE_ANSWER_CHARS = 4000  # the placeholder answer; the target writes the real one


def document_conversations(doc: Document) -> list[Conversation]:
    """The conversations made from one document: the module request, then documented functions."""
    name = doc.key.rsplit(":", 1)[-1]
    out = [
        Conversation(
            f"chat:embedded:{doc.key}:module",
            _pair(f"Write the Python module `{name}`.", doc.text[:MODULE_ANSWER_CHARS]),
        )
    ]
    for qualname, head, body in _documented_functions(doc.text)[:FUNCTIONS_PER_DOCUMENT]:
        out.append(Conversation(f"chat:embedded:{doc.key}:{qualname}", _pair(f"Complete this function:\n{head}", body)))
    return out


def _pair(user: str, assistant: str) -> list[dict]:
    return [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]


def _documented_functions(text: str) -> list[tuple[str, str, str]]:
    """(qualified name, signature + docstring, whole function) of the documented functions, in source order.

    A file that does not parse (stdlib test fixtures in Python 2 syntax) has none.
    """
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines()
    found = []

    def visit(node, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = child.body[0] if child.body else None
                documented = isinstance(doc, ast.Expr) and isinstance(getattr(doc, "value", None), ast.Constant)
                documented = documented and isinstance(doc.value.value, str) and len(child.body) > 1
                if documented and child.end_lineno - child.lineno < MAX_FUNCTION_LINES:
                    head = textwrap.dedent("\n".join(lines[child.lineno - 1 : doc.end_lineno]))
                    body = textwrap.dedent("\n".join(lines[child.lineno - 1 : child.end_lineno]))
                    found.append((prefix + child.name, head, body))
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")

    visit(tree, "")
    return found
