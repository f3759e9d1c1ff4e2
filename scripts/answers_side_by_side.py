"""Greedy answers side by side: the original's and each converted folder's, to the same chat prompts, read from the
judgement each folder keeps (``fidelity.json``'s ``usage.generation`` after ``normlab convert``, or
``evaluation.json`` after ``normlab evaluate``). Prints a Markdown table for the docs.

    python scripts/answers_side_by_side.py RUN1 RUN2 --names "recipe" "walk alone" --prompts 3

Every folder must have been judged on the same prompts; the original's answers are checked to agree across them
(greedy answers of one model are deterministic on one machine). Nothing is measured here: it reads.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def generation(folder: Path) -> dict:
    """The ``generation`` part of the judgement ``folder`` keeps; a clear error when it keeps none."""
    for name, key in (("evaluation.json", None), ("fidelity.json", "usage")):
        f = folder / name
        if f.is_file():
            report = json.loads(f.read_text())
            report = report.get(key, {}) if key else report
            if "generation" in report:
                return report["generation"]
    raise SystemExit(f"{folder}: no judged answers (fidelity.json usage.generation or evaluation.json generation)")


def cell(text: str, n: int) -> str:
    """One table cell: on one line, at most ``n`` characters, pipes escaped."""
    one = " ".join(text.split()).replace("|", "\\|")
    return f'"{one}"' if len(one) <= n else f'"{one[: n - 3]}..."'


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folders", type=Path, nargs="+", help="converted folders, judged")
    ap.add_argument("--names", nargs="+", help="a column name per folder (default: the folder's name)")
    ap.add_argument("--prompts", type=int, default=3, help="how many prompts, from the first")
    ap.add_argument("--chars", type=int, default=120, help="the longest cell")
    args = ap.parse_args()
    names = args.names or [f.name for f in args.folders]
    if len(names) != len(args.folders):
        raise SystemExit(f"--names gives {len(names)} names for {len(args.folders)} folders")
    gens = [generation(f) for f in args.folders]
    first = gens[0]["answers"][: args.prompts]
    for f, g in zip(args.folders, gens):
        theirs = g["answers"][: args.prompts]
        if [(a["prompt"], a["original"]) for a in theirs] != [(a["prompt"], a["original"]) for a in first]:
            raise SystemExit(f"{f}: judged on other prompts or another original than {args.folders[0]}")
    head = ["prompt", "original", *names]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for i, a in enumerate(first):
        row = [a["prompt"], cell(a["original"], args.chars)]
        row += [cell(g["answers"][i]["converted"], args.chars) for g in gens]
        print("| " + " | ".join(row) + " |")
    print()
    print("chat score: " + ", ".join(f"{n} {g['chat_score']:.0%}" for n, g in zip(names, gens)))


if __name__ == "__main__":
    main()
