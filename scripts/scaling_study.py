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
import re
import shutil
import sys
import time
from pathlib import Path

from _study import ROOT, commit, machine
from normlab.lab.runs import read_summary
from normlab.owner import hold
from normlab.sweep import Workers, expand, load_experiment, run_sweep, write_index

RECORD = ROOT / "bench" / "scaling.jsonl"
TABLE = ROOT / "bench" / "scaling.csv"
FIGURES = ROOT / "docs" / "figures" / "scaling"
KEEP = ("val_loss", "logit_std", "attn_entropy/0")  # metrics kept in the record, besides the per-site prefixes below
KEEP_PREFIX = ("gain/", "sat_frac/", "rms_in/", "rms_out/", "alpha_rms/", "resid_std/")


def _thin(row: dict) -> dict | None:
    kept = {
        k: (round(v, 6) if isinstance(v, float) else v)
        for k, v in row.items()
        if k in KEEP or k.startswith(KEEP_PREFIX)
    }
    return {"step": row["step"], **kept} if kept else None


def record_run(spec, status: str) -> None:
    """Append one finished run to the record (a line each, flushed, so a kill loses nothing written)."""
    out = Path(spec.config.out)
    summary = read_summary(out) or {"status": status}
    if summary.get("status") not in ("completed", "diverged"):
        return  # failed or interrupted runs are not results; the next start runs them again
    rows = [
        t
        for r in (json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line)
        if (t := _thin(r))
    ]
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
            w.writerow(
                [
                    r["name"],
                    m.get("cell"),
                    m.get("series"),
                    m.get("width"),
                    m.get("budget", 1),
                    m.get("block"),
                    m.get("opt"),
                    m.get("lr_field"),
                    m.get("lr"),
                    r["seed"],
                    s.get("status"),
                    s.get("final_val_loss"),
                    s.get("escape_step"),
                    s.get("tokens_per_s"),
                    r["commit"],
                ]
            )


def _best(records: dict[str, dict], cell: str, series: str) -> list[dict]:
    """The seeds of one cell's series at its best rate (lowest mean final validation loss)."""
    runs = [
        r
        for r in records.values()
        if r["meta"].get("cell") == cell
        and r["meta"].get("series") == series
        and r["summary"].get("final_val_loss") is not None
    ]
    by_lr: dict[float, list[dict]] = {}
    for r in runs:
        by_lr.setdefault(r["meta"]["lr"], []).append(r)
    if not by_lr:
        return []
    return min(by_lr.values(), key=lambda rs: sum(r["summary"]["final_val_loss"] for r in rs) / len(rs))


def mechanism_figure(records: dict[str, dict], cells=("w64 x1 gpt2 adamw", "w128 x1 gpt2 adamw")) -> Path | None:
    """Matched DyT and RMSNorm at their best rates over training, seed 0: the logits' std, the residual stream's
    RMS at each block's input, and (DyT) the sites' gain alpha x |gamma| and saturated fraction."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from _study import save

    cells = [c for c in cells if _best(records, c, "rms") and _best(records, c, "dyt_m")]
    if not cells:
        return None
    panels = ("val_loss", "logit_std", "rms_in", "gain", "sat_frac")
    fig, axes = plt.subplots(len(cells), len(panels), figsize=(3.2 * len(panels), 2.9 * len(cells)), squeeze=False)
    for row, cell in zip(axes, cells):
        for series, color in (("rms", "C0"), ("dyt_m", "C3")):
            run = min(_best(records, cell, series), key=lambda r: r["seed"])
            rows = run["metrics"]
            label = f"{'RMSNorm' if series == 'rms' else 'DyT match_rms'} lr {run['meta']['lr']:g}"
            for ax, panel in zip(row, panels):
                if panel in ("val_loss", "logit_std"):
                    pts = [(r["step"], r[panel]) for r in rows if panel in r]
                    ax.plot(*zip(*pts), color=color, label=label) if pts else None
                    continue
                depth = run["config"]["model"]["depth"]
                for i in range(depth):  # one line per block, lighter with depth
                    key = f"{panel}/blocks.{i}.norm_attn"
                    pts = [(r["step"], r[key]) for r in rows if key in r]
                    if pts:
                        ax.plot(
                            *zip(*pts), color=color, alpha=1 - 0.7 * i / depth, lw=1, label=label if i == 0 else None
                        )
        titles = {"val_loss": "validation loss", "logit_std": "logits' std", "rms_in": "residual RMS at block input",
                  "gain": "gain alpha x |gamma| (attn sites)", "sat_frac": "fraction |alpha x| > 1"}  # fmt: skip
        for ax, panel in zip(row, panels):
            ax.set_title(f"{cell}: {titles[panel]}", fontsize=8)
            ax.set_xlabel("step", fontsize=8)
            if panel in ("rms_in", "logit_std"):
                ax.set_yscale("log")
        row[0].legend(fontsize=6)
    path = FIGURES / "mechanism.png"
    save(fig, path)
    plt.close(fig)
    return path


def report(root: Path) -> None:
    from normlab.report import write_report

    path = write_report(root)
    FIGURES.mkdir(parents=True, exist_ok=True)
    for png in (root / "figures").glob("scaling_*.png"):
        shutil.copy(png, FIGURES / png.name)
    text = path.read_text().replace("](figures/", "](../docs/figures/scaling/")
    text = re.sub(r"\[([^\]]*)\]\(runs/[^)]*\)", r"\1", text)  # run folders are not in the repository
    total = len({sp.run_id for sp in expand(load_experiment("scaling"), "scaling", root)})
    done = len(recorded())
    status = (
        f"\n**Status:** {done} of {total} runs recorded in bench/scaling.jsonl ({time.strftime('%Y-%m-%d')}, "
        f"commit {commit()}, {machine()}); `python scripts/scaling_study.py` runs the rest.\n"
    )
    (ROOT / "bench" / "scaling.md").write_text(text + status)
    write_table(recorded())
    mechanism_figure(recorded())
    print(f"wrote {ROOT / 'bench' / 'scaling.md'}, {TABLE}, {FIGURES}/")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--root",
        default=str(Path.home() / ".cache" / "normlab" / "studies" / "scaling"),
        help="the run root (checkpoints of runs in flight; restored from the record)",
    )
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
        started = {r["meta"].get("sweep") for r in records.values()}
        todo.sort(key=lambda s: s.meta.get("sweep") not in started)  # finish the grids already begun (stable)
        if args.max_runs is not None:
            todo = todo[: args.max_runs]
        print(f"{len(todo)} runs to go of {len(specs)}, {args.jobs} at a time, in the TOML's order (decisive first)")
        try:
            with hold(RECORD, "the scaling study's record"):  # one study appends to it at a time
                run_sweep(todo, workers=Workers(args.jobs), on_done=record_run)
        except KeyboardInterrupt:
            print("stopped: every finished run is in the record; run the same command to go on", file=sys.stderr)
            return 130
    report(root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
