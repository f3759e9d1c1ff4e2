"""SmolLM2-135M converted to DyISRU by each recipe, judged as it will be used: the figure of bench/usable.csv.

    python scripts/plot_conversion.py                  # docs/figures/real_model.png

Each recipe is the newest row of its job in bench/usable.csv (`python scripts/bench_usable.py` appends them, each
with its command, commit, machine and date). Left: the share of positions where the converted model's top-1 token
is the original's, on held-out Shakespeare, docutils and the chat set, with the chat score (greedy answers whose
first six words are the original's) as a dot. Right: the median and the worst 128-token sequence's rise over the
original, log scale, with the blow-ups counted. The label says how many sites each converts and how long the
command took on 2 cores (and on which machine, where it is not most rows').
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

from _study import ROOT, save
from bench_usable import README  # the README table's jobs, in its order

LABELS = {  # job -> its label
    "recommended": "walk on samples\n(recommended)",
    "budget_0.1_heal_2048": "walk 0.1\n+ heal",
    "budget_self_kl_0.05_heal_tokens": "walk on samples\n+ heal",
    "budget_heal": "walk 0.4\n+ heal",
    "budget": "walk 0.4",
    "per_channel": "per channel",
    "recipe": "per channel\n+ heal",
    "per_channel_route": "every site",
}


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--csv", type=Path, default=ROOT / "bench" / "usable.csv")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "figures" / "real_model.png")
    args = ap.parse_args()
    picked = newest(list(csv.DictReader(args.csv.open())))
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


if __name__ == "__main__":
    main()
