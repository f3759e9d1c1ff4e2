"""How long `normlab convert` takes, stage by stage, at this commit and at an earlier one, in one run.

    python scripts/bench_convert.py --against 012416b                      # per-channel calibration, both commits
    python scripts/bench_convert.py --against 012416b --jobs per_channel budget
    python scripts/bench_convert.py --jobs samples                         # this commit only
    python scripts/bench_convert.py --model qwen-coder --jobs per_channel budget   # the 0.5B second family
    python scripts/bench_convert.py --model standin-262k --jobs recommended        # a 262k vocabulary, per stage

Each job is a real `normlab convert` of SmolLM2-135M-Instruct (``--model smollm2``, or another fixture with
``--model``) in a fresh process, its output in a temporary folder; the earlier commit runs from a git worktree of it
(its own ``src/`` first on the path, the same venv). A commit whose convert records stage timings
(``fidelity.json``'s ``stages``) gives one row per stage, an older one its wall time only; each stage's row carries
its peak resident memory (``peak_gb``) and the model's parameter count where the commit records them, so a stage's
memory reads against the float32 model's size. The held-out and docutils cross-entropies go beside the times, so a
faster stage that changed the result shows it. Rows go to bench/convert_stages.csv with the command, the machine and
both commits. A benchmark, not a test: nothing is asserted; the samples job draws its set in a cache folder of its
own (a cached set reads back in a second), the user's cached sets untouched.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _study import stamp
from bench_kernels import cpu_name  # scripts/ is on the path when a script runs
from normlab.conversion.flags import RECOMMENDED
from normlab.table import append_csv, format_table

ROOT = Path(__file__).resolve().parent.parent
JOBS = {
    "per_channel": ["--to", "dyisru", "--per", "channel"],
    "budget": ["--to", "dyisru", "--per", "channel", "--budget-nats", "0.4"],
    "samples": ["--to", "dyisru", "--per", "channel", "--calibrate-on", "self"],
    "recommended": ["--to", "dyisru", *RECOMMENDED],  # the README's command (its samples drawn afresh)
}
# the walk's parts (fidelity.json's budget_walk.stage_seconds), as the rows name them
WALK_PARTS = {"fits": "walk: independent fits", "costs": "walk: cost of each site alone", "steps": "walk: steps"}


def _commit(ref: str) -> str:
    return subprocess.run(["git", "rev-parse", "--short=12", ref], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()  # fmt: skip


def _run(src: Path, job: str, out: Path, threads: int, cache: Path | None = None, model: str = "smollm2") -> dict:
    """One convert in a fresh process from ``src`` (``cache``: its NORMLAB_CACHE); returns its wall time and what its
    fidelity.json says."""
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": str(threads)}
    if cache is not None:
        env["NORMLAB_CACHE"] = str(cache)
    code = "import sys; from normlab.cli import main; sys.exit(main())"
    argv = [sys.executable, "-c", code, "convert", "--model", model, *JOBS[job], "--no-progress", "--out", str(out)]
    t0 = time.perf_counter()
    proc = subprocess.run(argv, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{job} at {src} failed:\n{proc.stderr[-2000:]}")
    fid = json.loads((out / "fidelity.json").read_text())
    cfg = json.loads((out / "convert_config.json").read_text())
    return {"wall": wall, "fid": fid, "cfg": cfg, "command": " ".join(["normlab", *argv[3:-2]])}


def _rows(job: str, commit: str, res: dict) -> list[dict]:
    fid = res["fid"]
    common = {
        "job": job,
        "commit": commit,
        "command": res["command"],
        "parameters": fid.get("parameters", ""),
        "ce_held_out": round(fid.get("ce_converted", float("nan")), 4),
        "ce_original": round(fid.get("ce_original", float("nan")), 4),
        "ce_docs": round(fid.get("second_text", {}).get("ce_converted", float("nan")), 4),
    }
    peaks = fid.get("stage_peak_gb", {})
    rows = [
        {**common, "stage": st, "seconds": s, "peak_gb": peaks.get(st, "")} for st, s in fid.get("stages", {}).items()
    ]
    data, walk = res["cfg"].get("data", {}), fid.get("budget_walk") or {}
    tokens = (data.get("samples") or 0) * res["cfg"].get("seq_len", 0)
    for row in rows:  # each stage's seconds per unit of its work, where it has one
        if row["stage"] == "samples" and tokens and data.get("walk") == "self":
            row.update(per=round(row["seconds"] / tokens, 5), unit="token")
    for key, name in WALK_PARTS.items():
        if key in walk.get("stage_seconds", {}):
            secs, n = walk["stage_seconds"][key], max(walk.get("sites", 0), 1)
            rows.append(
                {
                    **common,
                    "stage": name,
                    "seconds": secs,
                    "per": round(secs / n, 3),
                    "unit": "site",
                    "every": walk.get("every", ""),
                }
            )
    return [*rows, {**common, "stage": "wall (process)", "seconds": round(res["wall"], 1)}]


def _fresh_samples_cache(tmp: Path) -> Path:
    """A cache folder whose every entry links to the user's normlab cache, except ``samples/``: the samples job draws
    its set afresh there, and the user's cached sample sets are never touched."""
    from normlab.corpus import cache_dir

    folder = tmp / "cache"
    folder.mkdir(parents=True, exist_ok=True)
    for entry in cache_dir().iterdir():
        if entry.name != "samples" and not (folder / entry.name).exists():
            (folder / entry.name).symlink_to(entry)
    return folder


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", help="an earlier commit to time beside this one (a git worktree of it)")
    ap.add_argument("--jobs", nargs="+", choices=list(JOBS), default=["per_channel"])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--model", default="smollm2", help="a fixture (smollm2, qwen-coder, standin-262k, ...) or a path")
    ap.add_argument("--csv", default=str(ROOT / "bench" / "convert_stages.csv"))
    args = ap.parse_args(argv)
    here = _commit("HEAD")
    sides = [(here, ROOT / "src")]
    with tempfile.TemporaryDirectory() as tmp:
        if args.against:
            before = _commit(args.against)
            tree = Path(tmp) / "before"
            subprocess.run(["git", "worktree", "add", "--detach", str(tree), before], cwd=ROOT, check=True,
                           capture_output=True)  # fmt: skip
            sides.insert(0, (before, tree / "src"))
        try:
            rows = []
            for job in args.jobs:
                for commit, src in sides:
                    fresh = job in ("samples", "recommended")
                    cache = _fresh_samples_cache(Path(tmp) / f"cache-{commit}") if fresh else None
                    res = _run(src, job, Path(tmp) / f"{job}-{commit}", args.threads, cache, args.model)
                    rows += _rows(job, commit, res)
                    print(f"{job} at {commit}: {res['wall'] / 60:.1f} min", flush=True)
        finally:
            if args.against:
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, capture_output=True)
    machine = f"{cpu_name()}, {args.threads} threads"
    measured = {"date": datetime.date.today().isoformat(), "machine": machine, "bench_commit": here}
    append_csv(args.csv, [{**measured, **r} for r in rows], stamp=stamp())
    cols = ["job", "commit", "stage", "seconds", "per", "unit", "peak_gb", "ce_held_out", "ce_docs"]
    print(format_table(cols, [[r.get(k, "") for k in cols] for r in rows]))
    print(f"\n{machine}; rows appended to {args.csv}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
