"""Cheaper ``@triton.jit`` helper calls in Triton's interpreter (TRITON_INTERPRET=1), same behaviour.

When an interpreted kernel calls a jit helper (``_prep_chunk``, ``_verify_token``, ... : our kernels are
built from them), the interpreter patches ``triton.language`` for the helper again: an
``inspect.getmembers`` walk over ``tl``, ``tl.core``, ``tl.math`` and the tensor class per call. Inside a
launch those modules are already patched (the launch patches them and restores them when it ends), so the
walk finds nothing left to patch, and its cost is pure overhead: 5-8% of the wall time of the
engine-level GDN tests (about a tenth under cProfile), whose kernels call helpers thousands of times.

:func:`skip_repatching_nested_calls` makes a helper call skip the walk when every language module the
helper can see is already patched, and patch as before otherwise (a helper called outside a launch, or
one that sees a module the kernel did not). The test suite's conftest calls it; it changes nothing on a
GPU, and in a Triton whose interpreter is laid out differently it does nothing.
"""

from __future__ import annotations

import inspect

_PATCHED = "_dflash2_skips_repatching"


def _already_patched(fn) -> bool:
    """Whether every language module visible from ``fn`` has had its builtins swapped for the
    interpreter's (a patched builtin is a plain function without Triton's builtin marker)."""
    import triton.language as tl

    langs = [v for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)]
    if not langs:
        return False
    is_builtin = tl.core.is_builtin
    for lang in langs:
        if is_builtin(lang.load) or is_builtin(lang.tensor.__add__):
            return False
        if lang is tl and is_builtin(tl.math.exp):
            return False
    return True


def skip_repatching_nested_calls() -> bool:
    """Make the interpreter's jit-helper calls skip re-patching an already patched language (idempotent);
    True when it is in place."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    original = getattr(interpreter, "_patch_lang", None)
    if original is None or not hasattr(interpreter, "_LangPatchScope"):
        return False
    if not getattr(original, _PATCHED, False):
        interpreter._patch_lang = skipping_patch_lang(original, interpreter._LangPatchScope)
    return True


def skipping_patch_lang(original, scope_type):
    """``original`` (the interpreter's _patch_lang), except for a function whose language is already patched:
    then an empty ``scope_type()`` (nothing changed, so nothing to restore)."""

    def _patch_lang(fn):
        if _already_patched(fn):
            return scope_type()
        return original(fn)

    setattr(_patch_lang, _PATCHED, True)
    _patch_lang.__wrapped__ = original
    return _patch_lang
