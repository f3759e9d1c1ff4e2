"""The documents users read: the papers cited by title, never by a folder they lack."""

from __future__ import annotations

from pathlib import Path


def test_no_source_document_numbers_are_left():
    """A user who clones normlab has no `shared/seeds` folder: the papers are cited by name (README, References),
    never as "seed 000".."seed 004" or by that folder, in the README, docs, sources, scripts or experiment TOMLs."""
    import re

    repo = Path(__file__).resolve().parents[1]
    files = [repo / "README.md", *(repo / "docs").rglob("*.md"), *(repo / "docs").rglob("*.toml"),
             *(repo / "src").rglob("*.py"), *(repo / "src").rglob("*.toml"),
             *(repo / "scripts").rglob("*.py")]  # fmt: skip
    pattern = re.compile(r"\bseeds? 00[0-4]\b|shared/seeds", re.IGNORECASE)
    hits = [
        f"{f.relative_to(repo)}:{i}"
        for f in files
        for i, line in enumerate(f.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not hits, hits[:10]
    assert "## References" in (repo / "README.md").read_text()
