"""How many prompts were asked for, given to the decoder and evaluated, and why any went missing.

results.json and the console both carry this, so a run that evaluates fewer prompts
than asked or given always says how many and why (issue 11).
"""

from __future__ import annotations


def prompt_counts(prompt_set: dict | None, given: int, skipped: list[dict], context_limit: int | None) -> dict:
    """{"asked", "given", "evaluated", "notes"}: ``prompt_set`` is PromptSet.info (None for prompts passed
    directly), ``skipped`` the prompts the decoder left out (too long for the context)."""
    info = prompt_set or {}
    notes = [info["shortfall"]] if info.get("shortfall") else []
    if skipped:
        empty = sum(1 for s in skipped if s["prompt_tokens"] == 0)
        too_long = len(skipped) - empty
        parts = [f"{too_long} longer than the context limit {context_limit} with the new tokens"] if too_long else []
        parts += [f"{empty} empty"] if empty else []
        notes.append(f"{len(skipped)} of {given} given prompts skipped: {', '.join(parts)}")
    return {"asked": info.get("asked"), "given": given, "evaluated": given - len(skipped), "notes": notes}


def counts_line(counts: dict) -> str | None:
    """One console line when fewer prompts were evaluated than asked or given, else None."""
    if not counts["notes"]:
        return None
    asked = f"asked {counts['asked']}, " if counts["asked"] is not None else ""
    return f"evaluated {counts['evaluated']} prompts ({asked}given {counts['given']}): " + "; ".join(counts["notes"])
