"""Draw docs/figures/kernels_cpu.png from bench/kernels_cpu.csv: each norm's forward + backward time on the CPU,
fused (normlab) against torch.compile of its reference and the reference itself, with the copy floor.

    python scripts/plot_kernels.py [--commit SHA] [--out docs/figures/kernels_cpu.png]

The rows are those of one commit (default: the latest with every provider), median over its runs; the machine and
commit are written on the figure."""

from __future__ import annotations

import argparse
import csv
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OPS = ["rms_norm", "dyt", "scaled_dyt", "derf", "dyisru", "eln"]
LABELS = {"rms_norm": "RMSNorm", "dyt": "DyT", "scaled_dyt": "scaled DyT", "derf": "Derf", "dyisru": "DyISRU",
          "eln": "ELN"}  # fmt: skip
PROVIDERS = {"normlab": ("normlab (fused)", "tab:blue"),
             "torch_compile": ("torch.compile of the reference", "tab:orange"),
             "reference": ("reference math", "tab:grey")}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--commit", help="the commit whose rows to draw (default: the latest with every provider)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "figures" / "kernels_cpu.png"))
    args = ap.parse_args()
    rows = [r for r in csv.DictReader(open(ROOT / "bench" / "kernels_cpu.csv")) if r["mode"] == "full"]
    if args.commit is None:
        full = [r["commit"] for r in rows if r["provider"] == "torch_compile"]
        args.commit = full[-1]
    rows = [r for r in rows if r["commit"].startswith(args.commit)]
    if not rows:
        raise SystemExit(f"no forward + backward rows for commit {args.commit} in bench/kernels_cpu.csv")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    for ax, dtype in zip(axes, ("fp32", "bf16")):
        ms = lambda op, p, dtype=dtype: statistics.median(  # noqa: E731
            float(r["ms"]) for r in rows if r["op"] == op and r["provider"] == p and r["dtype"] == dtype
        )
        floor = {op: statistics.median(float(r["ms"]) / float(r["x_floor"]) for r in rows
                                       if r["op"] == op and r["provider"] == "normlab" and r["dtype"] == dtype)
                 for op in OPS}  # fmt: skip
        for k, (p, (label, color)) in enumerate(PROVIDERS.items()):
            ys = [i + (k - 1) * 0.27 for i in range(len(OPS))]
            ax.barh(ys, [ms(op, p) for op in OPS], height=0.27, color=color, label=label)
        ax.scatter([floor[op] for op in OPS], range(len(OPS)), marker="|", s=300, color="black", zorder=3,
                   label="floor: 2.5 copies of x, same run")  # fmt: skip
        ax.set_xscale("log")
        ticks = [0.5, 1, 2, 5, 10, 20, 50, 100]
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
        ax.minorticks_off()
        ax.set_title(f"{dtype}: forward + backward, 4096 x 1024")
        ax.set_xlabel("ms (log scale; lower is faster)")
    axes[0].invert_yaxis()  # shared: once for both
    axes[0].set_yticks(range(len(OPS)), [LABELS[op] for op in OPS])
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="lower center", ncol=4, frameon=False)
    r = rows[0]
    fig.suptitle(f"normlab's CPU kernels: {r['device']}, {r['threads']} threads, torch {r['torch']}, "
                 f"commit {r['commit'][:7]}, {r['date']}", fontsize=9)  # fmt: skip
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
