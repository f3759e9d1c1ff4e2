"""Wall time of ``normlab reproduce`` with the fused CPU kernels against the reference math, in one run.

    python scripts/bench_reproduce.py                 # make demo's default runs, one seed per run
    python scripts/bench_reproduce.py --experiment rank --seeds 1

Each side runs ``reproduce`` in a fresh process with its own empty normlab cache (the corpus copied in,
so only the kernels' cache is cold): the fused side pays the one-time build of the CPU kernels inside its
time (with ``--warm`` it starts from this machine's build instead, as after ``make setup``, which builds the
kernels); the reference side runs with ``NORMLAB_KERNEL=reference``. The order alternates with ``--order``.
A row is appended to bench/reproduce.csv with the hardware, commit and date.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from _study import stamp
from normlab.corpus import fetch_shakespeare
from normlab.kernels import cpu_build
from normlab.table import append_csv
from normlab.version import code_version

CODE = """
import sys
import normlab.sweep as sweep
from normlab.reproduce import reproduce
from normlab.sweep import Workers
sweep.PROFILES["default"]["seeds"] = int(sys.argv[2])
exps = sys.argv[4:] or None
reproduce(sys.argv[1], "default", experiments=exps, workers=Workers(int(sys.argv[3])), progress=False)
"""


def timed(side: str, seeds: int, jobs: int, experiments: list[str], warm: bool = False) -> float:
    corpus = fetch_shakespeare()
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "cache"
        cache.mkdir()
        shutil.copy(corpus, cache / corpus.name)
        if warm and side == "fused":  # as after `make setup`, which builds the kernels: this machine's build copied in
            cpu_build.load(wait=True)
            built = cpu_build.library_folder()
            shutil.copytree(built, cache / "kernels" / built.name)
        env = {**os.environ, "NORMLAB_CACHE": str(cache)}
        env.pop("NORMLAB_KERNEL", None)
        if side == "reference":
            env["NORMLAB_KERNEL"] = "reference"
        t0 = time.perf_counter()
        argv = [sys.executable, "-c", CODE, str(Path(tmp) / "root"), str(seeds), str(jobs), *experiments]
        proc = subprocess.run(argv, env=env, capture_output=True, text=True)
        seconds = time.perf_counter() - t0
        if proc.returncode != 0:
            raise SystemExit(f"{side}: reproduce failed:\n{proc.stderr[-2000:]}")
        built = (cache / "kernels").exists() and not (warm and side == "fused")
        print(f"{side:9s} {seconds:7.1f} s  (kernels built in this run: {built})", flush=True)
        return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=1, help="seeds per run (make demo uses 2)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--experiment", nargs="*", default=[], help="subset of experiments (default: all)")
    ap.add_argument("--order", choices=["fused-first", "reference-first"], default="reference-first")
    ap.add_argument(
        "--warm",
        action="store_true",
        help="the fused side starts with this machine's kernel build "
        "in its cache (as after make setup) instead of building it inside its time",
    )
    ap.add_argument("--csv", default="bench/reproduce.csv")
    args = ap.parse_args()
    sides = ["reference", "fused"] if args.order == "reference-first" else ["fused", "reference"]
    print(
        f"normlab reproduce, one fresh cache per side, {args.seeds} seed(s) per run, {args.jobs} jobs, "
        f"torch {torch.__version__}, {os.cpu_count()} cores",
        flush=True,
    )
    seconds = {side: timed(side, args.seeds, args.jobs, args.experiment, args.warm) for side in sides}
    ratio = seconds["fused"] / seconds["reference"]
    print(f"fused / reference = {ratio:.3f}")
    row = {"date": datetime.date.today().isoformat(), "commit": code_version().get("git_commit", "unknown")[:12],
           "cores": os.cpu_count(), "torch": torch.__version__, "seeds": args.seeds, "jobs": args.jobs,
           "experiments": " ".join(args.experiment) or "all", "reference_s": round(seconds["reference"], 1),
           "fused_s": round(seconds["fused"], 1), "ratio": round(ratio, 3),
           "kernel_build_in_time": "no" if args.warm else "yes"}  # fmt: skip
    print(f"appended a row to {append_csv(args.csv, [row], stamp=stamp())}")


if __name__ == "__main__":
    main()
