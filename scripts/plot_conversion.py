"""SmolLM2-135M converted to DyISRU step by step, as `normlab convert` runs it: the figure of bench/real_model.csv.

    python scripts/plot_conversion.py                  # docs/figures/real_model.png

Each bar is one row of bench/real_model.csv (chosen by its commit and the start of its stage), the held-out
Shakespeare cross-entropy beside the docutils documentation's, the original's as dashed lines; the label says how
long the command took on 2 cores. The uncalibrated conversion (380 nats) is left out of the axis and named in the
title.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

from _study import ROOT, save

# (label, commit, the stage's start): the rows the figure shows, in the order a user would run them
ROWS = [
    ("calibrated per site\n(3b43a2e)", "3b43a2e", "calibrated"),
    ("calibrated per channel", "bbb5b7e", "calibrated, one beta"),
    ("budget walk, 51 of 61\n(8c977a9)", "8c977a9", "no heal: budget 0.4"),
    ("budget walk, 49 of 61\n(fe02fce: float32, defer=4)", "fe02fce", "no heal: budget 0.4"),
    ("budget walk, 50 of 61\n(now: bf16 steps, defer=3)", "ad7114d", "no heal: budget 0.4"),
    ("self recipe, bf16\n(from nothing)", "2031abe", "self recipe from nothing"),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--csv", type=Path, default=ROOT / "bench" / "real_model.csv")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "figures" / "real_model.png")
    args = ap.parse_args()
    rows = list(csv.DictReader(args.csv.open()))
    picked = []
    for label, commit, stage in ROWS:
        hit = [r for r in rows if r["commit"] == commit and r["stage"].startswith(stage) and r["target"] == "dyisru"]
        if len(hit) != 1:
            raise SystemExit(f"{args.csv}: {len(hit)} rows of commit {commit} with a stage starting {stage!r}")
        picked.append((label, hit[0]))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.2))
    width = 0.38
    for k, (key, base, name) in enumerate((("ce", "ce_original", "held-out Shakespeare"),
                                           ("ce_second", "ce_second_original", "docutils documentation"))):  # fmt: skip
        xs = [i + (k - 0.5) * width for i in range(len(picked))]
        ys = [float(r[key]) for _, r in picked]
        bars = ax.bar(xs, ys, width, label=name, color=f"C{k}")
        for b, (_, r) in zip(bars, picked):
            ax.text(b.get_x() + b.get_width() / 2, b.get_height() + 0.05, f"+{float(r[key]) - float(r[base]):.2f}",
                    ha="center", fontsize=8)  # fmt: skip
        original = float(next(r[base] for _, r in picked if r[base]))
        ax.axhline(original, color=f"C{k}", ls="--", lw=1, label=f"original, {name} ({original:.2f})")
    minutes = [float(r["minutes"]) for _, r in picked]
    ax.set_xticks(range(len(picked)), [f"{label}\n{m:.1f} min" for (label, _), m in zip(picked, minutes)], fontsize=8)
    ax.set_ylim(3, max(float(r["ce"]) for _, r in picked) + 0.8)
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("SmolLM2-135M, RMSNorm -> DyISRU: no calibration reads 380 nats; each step below, 2 CPU cores")
    ax.legend(fontsize=8, loc="upper right")
    save(fig, args.out)


if __name__ == "__main__":
    main()
