"""One row per run of a sweep root (`normlab sweep ... --root ROOT`) into a bench CSV: its experiment, name, cell and
series, rate, seed, status and the experiment's metrics from its summary, beside the commit and machine that ran it.

    python scripts/sweep_rows.py runs/quantize --out bench/quantize.csv

The root's own report (`normlab report --root ROOT`) states the verdicts; this is the data they were read from,
small enough to commit (the run folders hold checkpoints). A row per run, written afresh each time (a run not yet
finished has its status and no metrics).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
from pathlib import Path

from _study import machine  # scripts/ is on the path when a script runs
from normlab.lab.runs import read_summary


def rows(root: Path) -> list[dict]:
    """Every run of every experiment in ``root``'s index, with its metrics."""
    index = json.loads((root / "index.json").read_text())
    here = machine()  # a root's runs are this machine's (a run folder does not record its CPU)
    out = []
    for exp in index["experiments"]:
        for run in exp["runs"]:
            folder = root / "runs" / run["run_id"]
            summary = read_summary(folder) or {"status": "missing"}
            version = json.loads((folder / "version.json").read_text()) if (folder / "version.json").is_file() else {}
            meta = run.get("meta", {})
            row = {"experiment": exp["name"], "name": run["name"], "cell": meta.get("cell", ""),
                   "series": meta.get("series", ""), "lr_field": meta.get("lr_field", ""), "lr": meta.get("lr", ""),
                   "seed": run["seed"], "status": summary.get("status")}  # fmt: skip
            row |= {m: summary.get(m, "") for m in exp.get("metrics", ["final_val_loss"])}
            done = folder / "summary.json"
            row |= {
                "command": f"normlab sweep {exp['name']} --profile {index['profile']} --root {root}",
                "commit": str(version.get("git_commit", ""))[:12],
                "dirty": version.get("git_dirty", ""),
                "machine": here,
                "torch": version.get("torch", ""),
                "date": datetime.date.fromtimestamp(done.stat().st_mtime).isoformat() if done.is_file() else "",
            }
            out.append(row)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("root", type=Path, help="a sweep root (its index.json and runs/)")
    p.add_argument("--out", type=Path, required=True, help="the CSV to write")
    args = p.parse_args()
    table = rows(args.root)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in table for k in r)))
        w.writeheader()
        w.writerows(table)
    done = sum(r["status"] in ("completed", "diverged") for r in table)
    print(f"{len(table)} runs ({done} finished) -> {args.out}")


if __name__ == "__main__":
    main()
