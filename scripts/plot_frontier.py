"""The frontier of SmolLM2's norms, drawn from bench/frontier.json: docs/figures/frontier.png.

    python scripts/plot_frontier.py

Each curve is a walk that converts the sites cheapest first and measures the held-out cross-entropy after each; each
point is a walk that selected its sites on validation sequences and was measured on held-out ones. The entries
were measured with the frontier study's former script (scripts/frontier_study.py, at the commits each entry
records), but for the command's walk as it runs now (``curve_validation``: `normlab study budget_walk --only
walk`); `normlab study frontier` runs the same walks now, its cells' result.json holding each walk
(`fidelity.budget_walk.walk`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from _study import ROOT, save


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, zoom) = plt.subplots(1, 2, figsize=(12, 6))
    markers = iter("os^vDP*X")
    for to, r in results.items():
        if "curve_validation" in r:  # the command's walk: its curve on the sequences that chose, and its held-out end
            rise = [c - r["ce_validation_original"] for c in r["curve_validation"]]
            for a in (ax, zoom):
                label = f"the command's walk now ({r['commit']}): {r['sites_kept']} sites, on validation"
                a.plot(range(len(rise)), rise, color="k", ls="--", lw=1.2, label=label)
            held = r["ce_held"] - r["ce_held_original"]
            zoom.plot(r["sites_kept"], held, marker="*", ms=13, color="k", ls="", label=f"... held out: {held:+.2f}")
            continue
        if "curve" not in r:  # a --select-on validation entry: one point, the sites kept and their held-out rise
            rise = r["ce_held"] - r["ce_held_original"]
            zoom.plot(
                r["sites_kept"],
                rise,
                marker=next(markers, "o"),
                ls="",
                ms=8,
                label=f"{to.replace('selected on validation, ', '')}: {rise:+.2f}",
            )
            continue
        ks = range(len(r["curve"]))
        rise = [c - r["ce_original"] for c in r["curve"]]
        for a in (ax, zoom):
            a.plot(ks, rise, marker=".", label=f"{to} ({r['within_0.1']} / {r['within_0.5']} sites in +0.1 / +0.5)")
    ax.set_yscale("symlog", linthresh=0.1)
    zoom.set_ylim(-0.05, 1.0)
    for a in (ax, zoom):
        for y in (0.1, 0.5):
            a.axhline(y, color="grey", lw=0.8, ls="--")
        a.set_xlabel("sites converted, cheapest first (calibrated, no training)")
        a.set_ylabel("held-out CE - original's (nats/token)")
    ax.set_title("SmolLM2-135M: the greedy frontier")
    zoom.set_title("up to +1 nat; points: kept on validation, measured held out")
    handles, labels = zoom.get_legend_handles_labels()  # below both panels: as wide as the figure, never wider
    fig.legend(handles, labels, fontsize=7, loc="lower center", ncol=2, frameon=False)
    save(fig, path, rect=(0, 0.035 * ((len(labels) + 1) // 2), 1, 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "frontier.json")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "figures" / "frontier.png")
    args = ap.parse_args()
    plot(json.loads(args.json.read_text())["targets"], args.out)


if __name__ == "__main__":
    main()
