"""The repository stands alone: code and docs cite its own docs/ARCHITECTURE.md, never a design
briefing that users of the repo do not have (a reference to its sections crept back in once)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SUFFIXES = {".py", ".md", ".yaml", ".ipynb", ".toml"}
# The briefing's name and folder, spelled in pieces so that this file does not match its own pattern.
_NAME, _FOLDER = "DES" + "IGN", r"\.\./" + "shared/"
OUTSIDE = re.compile(rf"{_NAME}(\.md)?\s*§|{_FOLDER}|{_NAME}\.md")


def test_no_reference_points_outside_the_repo():
    files = [p for p in REPO.rglob("*") if p.suffix in SUFFIXES or p.name == "Makefile"]
    files = [
        p for p in files if not any(part.startswith(".") or part == "outputs" for part in p.relative_to(REPO).parts)
    ]
    hits = [
        f"{p.relative_to(REPO)}:{i}"
        for p in files
        if p != Path(__file__).resolve()
        for i, line in enumerate(p.read_text(errors="replace").splitlines(), start=1)
        if OUTSIDE.search(line)
    ]
    assert len(files) > 50 and not hits, hits
    assert (REPO / "docs" / "ARCHITECTURE.md").is_file()
