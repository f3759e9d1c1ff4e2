"""Healed on what, measured where: each 30-minute heal's rise over the original on held-out Shakespeare and on a text
no heal reads (docutils), as grouped bars, from the cells of bench/study_heal_recipe.csv.

    python scripts/plot_heal_texts.py          # docs/figures/heal_texts_30min.png

Each bar pair is one cell of ``normlab study heal_recipe``, named under it with its commit; a cell not yet measured
is left out with a note. ``--cells`` picks others (their names are the labels then).
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

from _study import ROOT, save

TABLE = ROOT / "bench" / "study_heal_recipe.csv"

# The cells of docs/heal-measurements.md#healed-on-what's 30-minute table, in its order, with what each one healed on.
CELLS = {
    "text-lr2.5e-4-30min": "Shakespeare\n2.5e-4",
    "text-30min": "Shakespeare\n1e-3",
    "self-30min-lr2.5e-4": "own samples\n2.5e-4",
    "self-30min": "own samples\n1e-3",
    "self+text-30min": "half each\n2.5e-4",
    "self+text-30min-lr1e-3": "half each\n1e-3",
    "recipe-lr2.5e-4": "the recipe\n(own samples)\n2.5e-4",
    "recipe-lr2.5e-4-noclip": "the recipe\nnot clipped\n2.5e-4",
    "recipe-lora": "the recipe\n+ LoRA\n2.5e-4",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cells", nargs="+", default=list(CELLS))
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "figures" / "heal_texts_30min.png")
    args = ap.parse_args()
    with TABLE.open() as f:
        latest = {r["cell"]: r for r in csv.DictReader(f)}  # a cell measured twice: its last row
    missing = [c for c in args.cells if c not in latest]
    if missing:
        print(f"{TABLE.name}: not measured yet, left out: {', '.join(missing)}")
    rows = [latest[c] for c in args.cells if c in latest]
    if not rows:
        raise SystemExit(f"{TABLE}: none of the cells {args.cells} has a row")
    labels = [f"{CELLS.get(r['cell'], r['cell'])}\n{r['commit'][:7]}" for r in rows]
    own = [float(r["ce_rise"]) for r in rows]
    other = [float(r["ce_rise_docs"]) for r in rows]

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.2))
    xs = range(len(rows))
    w = 0.38
    for shift, values, name in ((-w / 2, own, "held-out Shakespeare"), (w / 2, other, "docutils (no heal reads it)")):
        bars = ax.bar([x + shift for x in xs], values, w, label=name)
        ax.bar_label(bars, fmt="+%.2f", fontsize=7)
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_ylabel("CE over the original (nats/token)")
    ax.set_title("SmolLM2-135M, DyISRU at all 61 sites: 30-minute heals by text and rate (the recipe: 22 min)")
    ax.legend(fontsize=8)
    save(fig, args.out)


if __name__ == "__main__":
    main()
