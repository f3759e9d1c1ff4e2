"""Plain-text and Markdown tables, shared by the command line and the report."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path

from normlab.owner import hold


def _cell(v) -> str:
    if isinstance(v, float):
        if v == 0:
            return "0"
        if abs(v) >= 1e4 or abs(v) < 1e-3:
            return f"{v:.2e}"
        return f"{v:.4g}" if abs(v) < 100 else f"{v:.1f}"
    return str(v)


def format_table(headers: Sequence[str], rows: Sequence[Sequence], markdown: bool = False) -> str:
    """Rows under their headers as aligned plain text, or as a Markdown table.

    Args:
        headers: The column names.
        rows: The rows, one value per column (floats to 4 significant digits, or as 1.2e+04 beyond 1e4 and below
            1e-3).
        markdown: A Markdown table instead of plain text.
    """

    cells = [[_cell(v) for v in row] for row in rows]
    if markdown:
        esc = lambda s: s.replace("|", "\\|")  # noqa: E731
        lines = ["| " + " | ".join(map(esc, headers)) + " |", "|" + "|".join("---" for _ in headers) + "|"]
        lines += ["| " + " | ".join(map(esc, r)) + " |" for r in cells]
        return "\n".join(lines)
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    fmt = lambda r: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    return "\n".join([fmt(headers), fmt(["-" * w for w in widths]), *(fmt(r) for r in cells)])


def append_csv(path: str | Path, rows: list[dict], stamp: dict | None = None) -> Path:
    """Append rows to a CSV: benchmarks keep one growing table. When the rows bring columns the file lacks,
    the file is rewritten under the union of the columns (older rows leave the new cells empty), so that
    every row has as many cells as the header. Two benchmarks appending to one table take turns (a lock beside it,
    ``.<name>.lock``), so neither loses the other's rows.

    Args:
        path: The CSV file (made when absent).
        rows: The rows, as column name -> value.
        stamp: Columns every row gets where it has none of its own: what measured it (a benchmark's command,
            commit, machine and date).
    """
    rows = [{**(stamp or {}), **r} for r in rows]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with hold(path, "benchmark table", wait=True):
        _append(path, rows)
    return path


def _append(path: Path, rows: list[dict]) -> None:
    old_rows, columns = [], []
    if path.exists() and path.stat().st_size:
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            columns, old_rows = list(reader.fieldnames or []), list(reader)
    new_columns = [k for r in rows for k in r if k not in columns]
    columns += list(dict.fromkeys(new_columns))
    if new_columns or not old_rows:
        tmp = path.with_suffix(path.suffix + ".tmp")
        with tmp.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=columns, restval="")
            w.writeheader()
            w.writerows([*old_rows, *rows])
        tmp.replace(path)
    else:
        with path.open("a", newline="") as f:
            csv.DictWriter(f, fieldnames=columns, restval="").writerows(rows)
