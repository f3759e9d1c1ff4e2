"""What the bench and study scripts share: the command, commit, machine and date a row was measured with, a
judgement's statistics as a row, and saving a figure."""

from __future__ import annotations

import datetime
import shlex
import subprocess
import sys
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


def stamp() -> dict:
    """What every bench row records of how it was measured: the command as typed (the script's path from the
    repository), the commit, the machine and the date."""
    script = Path(sys.argv[0]).resolve()
    shown = script.relative_to(ROOT) if script.is_relative_to(ROOT) else script
    command = shlex.join(["python", str(shown), *sys.argv[1:]])
    return {"command": command, "commit": commit(), "machine": machine(), "date": datetime.date.today().isoformat()}


def judgement_row(report: dict, p99: bool = False) -> dict:
    """A judgement's headline statistics (`normlab.conversion.measure.usage.usage_report`) as bench columns: same
    top-1, mean KL and the worst sequence's gap held out and on the chat set (with their KL p99 when ``p99``), same
    top-1 and mean KL on docutils, the chat score and the blow-ups."""
    row = {}
    for name, key in (("held-out", "held"), ("chat", "chat")):
        t = report["texts"][name]
        row[f"{key}_same_top1"], row[f"{key}_kld_mean"] = round(t["same_top1"], 4), round(t["kld"]["mean"], 4)
        if p99:
            row[f"{key}_kld_p99"] = round(t["kld"]["p99"], 3)
        row[f"{key}_gap_worst"] = round(t["gap"]["worst"], 3)
    docs = next(v for k, v in report["texts"].items() if "docutils" in k)
    return row | {"docs_same_top1": round(docs["same_top1"], 4), "docs_kld_mean": round(docs["kld"]["mean"], 4),
                  "chat_score": round(report["generation"]["chat_score"], 3),
                  "blowups": len(report["blowups"]["over"])}  # fmt: skip


def save(fig, path: Path, rect: tuple | None = None) -> None:
    """``fig`` laid out (within ``rect`` of the figure, leaving room for a legend outside it) and written."""
    fig.tight_layout(rect=rect)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")
