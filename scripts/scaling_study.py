"""The scaling study (experiments/scaling.toml), resumable across sessions and machines: matched DyT, Derf, DyISRU,
default DyT and matched layer_scale against RMSNorm, each at its best learning rate of a grid, two seeds, over
width, tokens, block and optimizer.

    python scripts/scaling_study.py                 # run what is not yet recorded, then the report
    python scripts/scaling_study.py --report-only   # the report from what is recorded
    python scripts/scaling_study.py --max-runs 40   # stop (cleanly) after 40 new runs

Every finished run is appended at once to bench/scaling.jsonl (its config, summary and a thinned metrics log:
validation losses and the mechanism's telemetry), which is the study's record: commit it as it grows. On start,
each recorded run is restored into the run root, so a study killed at any point, or moved to a fresh clone,
loses at most the runs in flight (and those resume from their checkpoints when the root is still there). The
report is the ordinary `normlab report` of that root (REPORT.md with its verdicts and figures), copied to
bench/scaling.md and docs/figures/scaling/, plus bench/scaling.csv (one row per run).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import sys
import time
from pathlib import Path

from _study import ROOT, commit, machine
from normlab.lab.runs import read_summary
from normlab.sweep import expand, load_experiment, run_sweep, write_index

RECORD = ROOT / "bench" / "scaling.jsonl"
TABLE = ROOT / "bench" / "scaling.csv"
FIGURES = ROOT / "docs" / "figures" / "scaling"
KEEP = ("val_loss", "logit_std", "attn_entropy/0")  # metrics kept in the record, besides the per-site prefixes below
KEEP_PREFIX = ("gain/", "sat_frac/", "rms_in/", "rms_out/", "alpha_rms/", "resid_std/")


def _thin(row: dict) -> dict | None:
    kept = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in row.items()
            if k in KEEP or k.startswith(KEEP_PREFIX)}  # fmt: skip
    return {"step": row["step"], **kept} if kept else None


def record_run(spec, status: str) -> None:
    """Append one finished run to the record (a line each, flushed, so a kill loses nothing written)."""
    out = Path(spec.config.out)
    summary = read_summary(out) or {"status": status}
    if summary.get("status") not in ("completed", "diverged"):
        return  # failed or interrupted runs are not results; the next start runs them again
    rows = [t for r in (json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line)
            if (t := _thin(r))]  # fmt: skip
    line = {"run_id": spec.run_id, "name": spec.name, "seed": spec.seed, "meta": spec.meta,
            "config": spec.config.to_dict(), "summary": summary, "metrics": rows, "commit": commit(),
            "machine": machine(), "recorded": time.strftime("%Y-%m-%dT%H:%M:%S%z")}  # fmt: skip
    with RECORD.open("a") as f:
        f.write(json.dumps(line) + "\n")
        f.flush()
        os.fsync(f.fileno())


def recorded() -> dict[str, dict]:
    """The record's runs by run_id (a line cut by a kill is skipped: that run is simply run again)."""
    out = {}
    if RECORD.exists():
        for line in RECORD.read_text().splitlines():
            try:
                r = json.loads(line)
            except ValueError:
                continue
            out[r["run_id"]] = r
    return out


def restore(root: Path, records: dict[str, dict]) -> int:
    """Write each recorded run's summary, config and thinned metrics into the root, where the sweep skips it."""
    n = 0
    for run_id, r in records.items():
        d = root / "runs" / run_id
        if (read_summary(d) or {}).get("status") in ("completed", "diverged"):
            continue
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps(r["config"], indent=2) + "\n")
        (d / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in r["metrics"]))
        (d / "summary.json").write_text(json.dumps({**r["summary"], "restored_from": str(RECORD.name)}, indent=2))
        n += 1
    return n


def write_table(records: dict[str, dict]) -> None:
    cols = ["name", "cell", "series", "width", "budget", "block", "optimizer", "lr_field", "lr", "seed", "status",
            "final_val_loss", "escape_step", "tokens_per_s", "commit"]  # fmt: skip
    with TABLE.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        for r in sorted(records.values(), key=lambda r: (r["name"], r["seed"])):
            m, s = r["meta"], r["summary"]
            w.writerow([r["name"], m.get("cell"), m.get("series"), m.get("width"), m.get("budget", 1), m.get("block"),
                        m.get("opt"), m.get("lr_field"), m.get("lr"), r["seed"], s.get("status"),
                        s.get("final_val_loss"), s.get("escape_step"), s.get("tokens_per_s"), r["commit"]])  # fmt: skip


def report(root: Path) -> None:
    from normlab.report import write_report

    path = write_report(root)
    FIGURES.mkdir(parents=True, exist_ok=True)
    for png in (root / "figures").glob("scaling_*.png"):
        shutil.copy(png, FIGURES / png.name)
    text = path.read_text().replace("](figures/", "](../docs/figures/scaling/")
    text = "\n".join(line for line in text.splitlines() if "](runs/" not in line or line.startswith("|"))
    (ROOT / "bench" / "scaling.md").write_text(text.replace("](runs/", "](#") + "\n")
    write_table(recorded())
    print(f"wrote {ROOT / 'bench' / 'scaling.md'}, {TABLE}, {FIGURES}/")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=str(Path.home() / ".cache" / "normlab" / "studies" / "scaling"),
                    help="the run root (checkpoints of runs in flight; restored from the record)")  # fmt: skip
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="runs at a time (default: CPU cores)")
    ap.add_argument("--max-runs", type=int, help="stop after this many new runs")
    ap.add_argument("--report-only", action="store_true", help="no training: the report from the record")
    args = ap.parse_args(argv)
    root = Path(args.root)
    exp = load_experiment("scaling")
    specs = expand(exp, "scaling", root)
    write_index([exp], "scaling", root)
    records = recorded()
    print(f"{len(records)} runs recorded in {RECORD.relative_to(ROOT)}; restored {restore(root, records)} into {root}")
    if not args.report_only:
        todo = [s for s in specs if s.run_id not in records]
        if args.max_runs is not None:
            todo = todo[: args.max_runs]
        print(f"{len(todo)} runs to go of {len(specs)}, {args.jobs} at a time, in the TOML's order (decisive first)")
        try:
            run_sweep(todo, jobs=args.jobs, on_done=record_run)
        except KeyboardInterrupt:
            print("stopped: every finished run is in the record; run the same command to go on", file=sys.stderr)
            return 130
    report(root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
