"""What the study scripts share: the commit and machine a row was measured on, and saving a figure."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def commit() -> str:
    """The short hash of HEAD, or 'unknown' outside a git checkout."""
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine() -> str:
    """The machine a row was measured on, as `normlab study` records it."""
    from normlab.study import machine as study_machine

    return study_machine()


def save(fig, path: Path, rect: tuple | None = None) -> None:
    """``fig`` laid out (within ``rect`` of the figure, leaving room for a legend outside it) and written."""
    fig.tight_layout(rect=rect)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")
