"""Greedy answers side by side: the original's and each converted folder's, to the same chat prompts, read from the
judgement each folder keeps (``fidelity.json``'s ``usage.generation`` after ``normlab convert``, or
``evaluation.json`` after ``normlab evaluate``). Prints a Markdown table for the docs.

    python scripts/answers_side_by_side.py RUN1 RUN2 --names "recipe" "walk alone" --prompts 3

Every folder must have been judged on the same prompts; the original's answers are checked to agree across them
(greedy answers of one model are deterministic on one machine). Nothing is measured here: it reads. Under the
table: each folder's chat score with its 95% interval, and each folder against the first prompt by prompt (the
answers only one of the two keeps, and McNemar's exact p-value that both keep as many:
`normlab.conversion.measure.usage.paired_chat`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from normlab.conversion.measure.usage import UsageConfig, chat_interval, kept_answers, paired_chat


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
    ap.add_argument(
        "--words", type=int, default=UsageConfig().words, help="the first words an answer must share (the judgement's)"
    )
    args = ap.parse_args()
    names = args.names or [f.name for f in args.folders]
    if len(names) != len(args.folders):
        raise SystemExit(f"--names gives {len(names)} names for {len(args.folders)} folders")
    gens = [generation(f) for f in args.folders]
    for f, g in zip(args.folders, gens):
        if [(a["prompt"], a["original"]) for a in g["answers"]] != [
            (a["prompt"], a["original"]) for a in gens[0]["answers"]
        ]:
            raise SystemExit(f"{f}: judged on other prompts or another original than {args.folders[0]}")
    first = gens[0]["answers"][: args.prompts]
    head = ["prompt", "original", *names]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for i, a in enumerate(first):
        row = [a["prompt"], cell(a["original"], args.chars)]
        row += [cell(g["answers"][i]["converted"], args.chars) for g in gens]
        print("| " + " | ".join(row) + " |")
    print()
    kept = [kept_answers(g["answers"], args.words) for g in gens]
    for n, k in zip(names, kept):
        lo, hi = chat_interval(sum(k), len(k))
        print(f"chat score: {n} {sum(k)} of {len(k)} ({sum(k) / len(k):.0%}; 95% interval {lo:.0%}-{hi:.0%})")
    for n, k in zip(names[1:], kept[1:]):
        d = paired_chat(kept[0], k)
        print(
            f"{n} against {names[0]}: {d['only_second']} answers kept by {n} alone, {d['only_first']} by "
            f"{names[0]} alone; McNemar's exact p = {d['p']:.2g}"
        )


if __name__ == "__main__":
    main()
