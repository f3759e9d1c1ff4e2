"""Plain-text and Markdown tables, shared by the command line and the report."""

from __future__ import annotations

from collections.abc import Sequence


def _cell(v) -> str:
    if isinstance(v, float):
        if v == 0:
            return "0"
        if abs(v) >= 1e4 or abs(v) < 1e-3:
            return f"{v:.2e}"
        return f"{v:.4g}" if abs(v) < 100 else f"{v:.1f}"
    return str(v)


def format_table(headers: Sequence[str], rows: Sequence[Sequence], markdown: bool = False) -> str:
    cells = [[_cell(v) for v in row] for row in rows]
    if markdown:
        esc = lambda s: s.replace("|", "\\|")  # noqa: E731
        lines = ["| " + " | ".join(map(esc, headers)) + " |", "|" + "|".join("---" for _ in headers) + "|"]
        lines += ["| " + " | ".join(map(esc, r)) + " |" for r in cells]
        return "\n".join(lines)
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    fmt = lambda r: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    return "\n".join([fmt(headers), fmt(["-" * w for w in widths]), *(fmt(r) for r in cells)])
