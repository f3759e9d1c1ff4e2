"""SmolLM2-135M converted to DyISRU by each recipe, judged as it will be used: the figures of the `usable` study.

    python scripts/plot_conversion.py                  # docs/figures/real_model.png and conversion_frontier.png

The frontier (conversion_frontier.png, the README's figure): norms converted against same top-1 and KL divergence
on held-out text, a point per recipe measured (the newest row of each job), the README's recipes named, and the
same judge on the model with its weights rounded to 8, 6 and 4 bits (bench/reference_points.csv) as reference lines:
a user picks a point.

Each recipe is the newest row of its cell in bench/study_usable.csv (`normlab study usable --bench bench` appends
them, each with its commit, machine and date), or in bench/usable.csv (the rows of the script that study replaced).
Left: the share of positions where the converted model's top-1 token is the original's, on held-out Shakespeare,
docutils and the chat set, with the chat score (greedy answers whose first six words are the original's) as a dot.
Right: the median and the worst 128-token sequence's rise over the original, log scale, with the blow-ups counted.
The label says how many sites each converts and how long the command took on 2 cores (and on which machine, where it
is not most rows').
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

from _study import ROOT, save

LABELS = {  # the README table's recipes (the usable study's cells), in its order -> their labels
    "recommended": "walk on samples\n(recommended)",
    "budget_0.1_heal_2048": "walk 0.1\n+ heal",
    "budget_self_kl_0.05_heal_tokens": "walk on samples\n+ heal",
    "budget_heal": "walk 0.4\n+ heal",
    "budget": "walk 0.4",
    "per_channel": "per channel",
    "recipe": "per channel\n+ heal",
    "per_channel_route": "every site",
}
README = tuple(LABELS)


def read(tables: list[Path]) -> list[dict]:
    """The rows of the tables, oldest table first, each with its ``job`` (a study row's cell) and its target."""
    rows = []
    for table in tables:
        for r in csv.DictReader(table.open()) if table.is_file() else []:
            command = r.get("command") or ""
            to = r.get("to") or ("dyisru" if "--to " not in command else command.split("--to ")[1].split()[0])
            rows.append(r | {"job": r.get("job") or r["cell"], "to": to})
    return rows


def newest(rows: list[dict], model: str = "smollm2") -> list[tuple[str, dict]]:
    """The newest row (by date, then file order) of each job of the README's table that bench/usable.csv has for
    ``model``, with its label."""
    out = []
    for job in README:
        label = LABELS[job]
        hit = [r for r in rows if r["job"] == job and r.get("model", model) in (model, "")]
        if hit:
            out.append((label, max(enumerate(hit), key=lambda ir: (ir[1]["date"], ir[0]))[1]))
    return out


FRONTIER = {  # the README table's recipes -> their names on the frontier, and where each name sits (points)
    "recommended": ("recommended", (-12, -15)),
    "budget_self_kl_0.05_heal_tokens": ("16 sites + heal", (8, 4)),
    "budget_0.1_heal_2048": ("33 sites + heal", (8, 4)),
    "per_channel": ("per channel", (8, 4)),
    "per_channel_route": ("every norm", (-20, 8)),
}
ROUNDED = {"int8": "8 bits", "int6": "6 bits", "int4": "4 bits"}  # bench/reference_points.csv's points


def every_job(rows: list[dict], model: str = "smollm2") -> dict[str, dict]:
    """The newest row (by date, then file order) of every job bench/usable.csv has for ``model``."""
    out: dict[str, tuple] = {}
    for i, r in enumerate(rows):
        if r.get("model", model) in (model, "") and r.get("sites") and r.get("held_kld_mean") and r["to"] == "dyisru":
            if r["job"] not in out or (r["date"], i) >= out[r["job"]][0]:
                out[r["job"]] = ((r["date"], i), r)
    return {job: r for job, (_, r) in out.items()}


PANELS = (("held_same_top1", 100, "same top-1 token as the original (%)"),
          ("held_kld_mean", 1, "KL divergence to the original (nats/token)"))  # fmt: skip


def _point(ax, job: str, r: dict, key: str, scale: float) -> None:
    """One recipe's point: named and red for the README's recipes, squares for those that heal."""
    x, y = int(r["sites"]), float(r[key]) * scale
    shown = job in FRONTIER
    marker = "s" if "heal" in job or job == "recipe" else "o"
    color = "C3" if shown else ("C1" if marker == "s" else "C0")
    ax.plot(x, y, marker, ms=6 if shown else 4, color=color, alpha=1 if shown else 0.45, zorder=3)
    if shown:
        label, offset = FRONTIER[job]
        ax.annotate(label, (x, y), textcoords="offset points", xytext=offset, fontsize=8)


def plot_frontier(rows: list[dict], points: list[dict], out: Path) -> None:
    """Sites converted against same top-1 (left) and mean KLD (right, log), held out; the rounded weights as lines."""
    import matplotlib.pyplot as plt

    jobs = every_job(rows)
    rounded = {r["point"]: r for r in points if r.get("model", "smollm2") == "smollm2" and r["point"] in ROUNDED}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    for ax, (key, scale, name) in zip(axes, PANELS):
        for job, r in jobs.items():
            _point(ax, job, r, key, scale)
        for point, label in ROUNDED.items():
            if point in rounded:
                y = float(rounded[point][key]) * scale
                ax.axhline(y, color="grey", ls="--", lw=0.8)
                ax.text(61.5, y, f" {label}", va="center", fontsize=8, color="grey")
        ax.set_xlabel("norms converted to DyISRU (of 61)")
        ax.set_ylabel(name)
        ax.set_xlim(0, 68)
        ax.grid(alpha=0.3)
    axes[1].set_yscale("log")
    axes[0].plot([], [], "o", color="C0", alpha=0.45, label="a walk, no training")
    axes[0].plot([], [], "s", color="C1", alpha=0.45, label="with a heal")
    axes[0].plot([], [], "o", color="C3", label="the README's recipes")
    axes[0].legend(fontsize=8, loc="lower left")
    title = "SmolLM2-135M-Instruct, RMSNorm -> DyISRU: each recipe, and the same model's weights rounded (dashed)"
    fig.suptitle(title, fontsize=10)
    save(fig, out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--csv", type=Path, nargs="+", default=[ROOT / "bench" / "usable.csv", ROOT / "bench" / "study_usable.csv"]
    )
    ap.add_argument("--points", type=Path, default=ROOT / "bench" / "reference_points.csv", help="rounded weights")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "figures" / "real_model.png")
    ap.add_argument("--frontier", type=Path, default=ROOT / "docs" / "figures" / "conversion_frontier.png")
    args = ap.parse_args()
    rows = read(args.csv)
    picked = newest(rows)
    if not picked:
        raise SystemExit(f"{args.csv}: no row of any job in {sorted(README)}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top1, gap) = plt.subplots(1, 2, figsize=(14, 4.6))
    width = 0.26
    xs = range(len(picked))
    for k, (key, name) in enumerate((("held", "held-out Shakespeare"), ("docs", "docutils"), ("chat", "chat set"))):
        ys = [100 * float(r[f"{key}_same_top1"]) for _, r in picked]
        top1.bar([x + (k - 1) * width for x in xs], ys, width, label=name, color=f"C{k}")
    top1.plot(xs, [100 * float(r["chat_score"]) for _, r in picked], "kD", label="chat score (first 6 words)")
    top1.axhline(75, color="grey", ls=":", lw=1)
    top1.set_ylabel("same top-1 token as the original (%)")
    top1.set_ylim(0, 100)
    machines = [r["machine"] for _, r in picked]
    machine = max(machines, key=machines.count)  # the most rows' machine; a row from another names its own
    labels = [
        f"{label}\n{r['sites']} sites\n{float(r['minutes']):.1f} min"
        + (f"\n({r['machine'].split('(')[-1].rstrip(')')} CPU)" if r["machine"] != machine else "")
        for label, r in picked
    ]
    top1.set_xticks(list(xs), labels, fontsize=7)
    top1.legend(fontsize=7, loc="upper right")
    for k, (key, name) in enumerate((("held_gap_median", "median sequence"), ("held_gap_worst", "worst sequence"))):
        ys = [max(float(r[key]), 1e-3) for _, r in picked]
        gap.bar([x + (k - 0.5) * 0.38 for x in xs], ys, 0.38, label=name, color=f"C{k + 3}")
    for x, (_, r) in zip(xs, picked):
        gap.text(x, max(float(r["held_gap_worst"]), 1e-3) * 1.15, f"{r['blowups']} blow-ups", ha="center",
                 fontsize=7)  # fmt: skip
    gap.set_yscale("log")
    gap.set_ylim(top=max(float(r["held_gap_worst"]) for _, r in picked) * 4)
    gap.set_ylabel("rise over the original, held out (nats/token)")
    gap.set_xticks(list(xs), labels, fontsize=7)
    gap.legend(fontsize=7, loc="upper left")
    fig.suptitle(f"SmolLM2-135M-Instruct, RMSNorm -> DyISRU, judged as used ({machine}, 2 cores; bench/usable.csv)")
    save(fig, args.out)
    plot_frontier(rows, list(csv.DictReader(args.points.open())), args.frontier)


if __name__ == "__main__":
    main()
