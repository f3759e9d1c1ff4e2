"""Heal curves side by side: validation cross-entropy against minutes and against tokens, one line per heal_curve.csv.

    python scripts/plot_heal_curves.py bench/heal_curves.csv:heal_30min_dyisru "one core" \
        bench/heal_curves.csv:heal_30min_dyisru_2threads "two threads" --out docs/figures/heal_30min.png
    python scripts/plot_heal_curves.py A.csv "batch 8" B.csv "batch 4" --ylim 4.8 9.5 --out FIG.png   # clip a spike

    python scripts/plot_heal_curves.py --study runs/heal_grid --out FIG.png   # every healed cell of a study

Each CSV is what `normlab convert --heal-minutes N --out DIR` writes as DIR/heal_curve.csv (columns tokens,
seconds, val_ce, ...), or FILE.csv:NAME, the rows of curve NAME in a table of curves (bench/heal_curves.csv, with
each curve's command, commit, machine and date); a study cell's result.json (`normlab study`) holds the same curve.
The kept point (the best validation CE) is circled on each line.
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

from _study import save


def read_curve(path: Path) -> dict[str, list[float]]:
    if path.suffix == ".json":  # a study cell's result
        rows = ((json.loads(path.read_text()).get("fidelity") or {}).get("heal") or {}).get("curve") or []
        if not rows:
            raise SystemExit(f"{path}: a study result without a heal curve")
        return {k: [float(r[k]) for r in rows] for k in ("tokens", "seconds", "val_ce")}
    name = None
    if ":" in path.name:  # FILE.csv:NAME, one curve of a table of curves
        file, name = path.name.split(":", 1)
        path = path.with_name(file)
    with path.open() as f:
        rows = [r for r in csv.DictReader(f) if name is None or r.get("curve") == name]
    if name is not None and not rows:
        raise SystemExit(f"{path}: no curve named {name!r}")
    missing = {"tokens", "seconds", "val_ce"} - set(rows[0] if rows else {})
    if missing:
        raise SystemExit(f"{path}: not a heal curve (no {', '.join(sorted(missing))} column)")
    return {k: [float(r[k]) if r[k] else float("nan") for r in rows] for k in ("tokens", "seconds", "val_ce")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("pairs", nargs="*", help="CSV LABEL [CSV LABEL ...] (a CSV or a study cell's result.json)")
    ap.add_argument("--study", type=Path, help="a study's folder (ROOT/STUDY): every cell that healed, by name")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--title", default="SmolLM2-135M, DyISRU at all 61 sites: the stream heal")
    ap.add_argument("--ylim", type=float, nargs=2, metavar=("LOW", "HIGH"), help="the CE axis (a diverged curve)")
    ap.add_argument("--tokens-only", action="store_true", help="one panel: tokens (for runs that shared a CPU)")
    args = ap.parse_args()
    if len(args.pairs) % 2 or not (args.pairs or args.study):
        ap.error("give each CSV a label: CSV LABEL [CSV LABEL ...], or a --study folder")
    if args.study:
        cells = sorted(args.study.glob("*/result.json"))
        healed = [p for p in cells if (json.loads(p.read_text()).get("fidelity") or {}).get("heal")]
        args.pairs += [x for p in healed for x in (str(p), p.parent.name)]
    curves = [(read_curve(Path(p)), label) for p, label in zip(args.pairs[::2], args.pairs[1::2], strict=True)]

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 1 if args.tokens_only else 2
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels + 1, 4), sharey=True, squeeze=False)
    axes = axes[0]
    for c, label in curves:
        best = min(range(len(c["val_ce"])), key=c["val_ce"].__getitem__)
        xs = [c["tokens"]] if args.tokens_only else [[s / 60 for s in c["seconds"]], c["tokens"]]
        for ax, x in zip(axes, xs, strict=True):
            (line,) = ax.plot(x, c["val_ce"], marker=".", label=f"{label}: {int(c['tokens'][-1]):,} tokens")
            ax.plot(x[best], c["val_ce"][best], "o", mfc="none", ms=10, color=line.get_color())
    for ax, name in zip(axes, ["tokens healed on"] if args.tokens_only else ["minutes of healing", "tokens healed on"]):
        ax.set_xlabel(name)
    axes[0].set_ylabel("validation CE (nats/token)")
    axes[0].legend(fontsize=8)
    if args.ylim:
        axes[0].set_ylim(*args.ylim)
    fig.suptitle(args.title)
    save(fig, args.out)


if __name__ == "__main__":
    main()
