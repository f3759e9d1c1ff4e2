"""Healed on what, measured where: each heal's rise over the original on the heal's own text and on a text it never
read, as grouped bars, from the rows of bench/real_model.csv.

    python scripts/plot_heal_texts.py                      # the 30-minute heals of docs/heal-texts.md
    python scripts/plot_heal_texts.py --match "30-minute budget, batch 4" --out docs/figures/heal_texts_30min.png

A row is drawn when its ``stage`` contains ``--match`` and starts with "healed"; its label is the heal text, the
first field of the stage after the objective and what it trained (``text``, ``self``, ``self+text``), with the
self recipe's parts (per-channel calibration, cooldown, cached teacher, clip) where the row has them.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

from _study import ROOT, save

TABLE = ROOT / "bench" / "real_model.csv"


def heal_text(stage: str) -> str:
    """'healed (distill, norms, self+text: ...; 30-minute budget, ...)' -> 'self+text'."""
    fields = stage.split("(", 1)[1].split(",")
    return fields[2].split(":")[0].split(";")[0].strip()


def label(stage: str) -> str:
    """The bar's label: the heal text, and the self recipe's parts when the row has them."""
    text = heal_text(stage)
    if "calibrated per channel" not in stage:
        return f"healed on {text}"
    return f"healed on {text}, the recipe:\nper channel, cooldown,\ncached teacher" + (
        ", clip" if "clipped" in stage else ""
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--match", default="30-minute budget, batch 4, rollback at +0.5")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "figures" / "heal_texts_30min.png")
    args = ap.parse_args()
    with TABLE.open() as f:
        rows = [r for r in csv.DictReader(f) if r["stage"].startswith("healed") and args.match in r["stage"]]
    if not rows:
        raise SystemExit(f"{TABLE}: no healed row whose stage contains {args.match!r}")
    labels = [label(r["stage"]) for r in rows]
    own = [float(r["ce"]) - float(r["ce_original"]) for r in rows]
    other = [float(r["ce_second"]) - float(r["ce_second_original"]) for r in rows]

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    xs = range(len(rows))
    w = 0.38
    for shift, values, name in ((-w / 2, own, "held-out Shakespeare"), (w / 2, other, "docutils (never read)")):
        bars = ax.bar([x + shift for x in xs], values, w, label=name)
        ax.bar_label(bars, fmt="+%.2f", fontsize=8)
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_ylabel("CE over the original (nats/token)")
    ax.set_title("SmolLM2-135M, DyISRU at all 61 sites, 30-minute heals")
    ax.legend(fontsize=8)
    save(fig, args.out)


if __name__ == "__main__":
    main()
