"""The CPU kernels of two commits, before and after, on one machine: the raw ops of both builds timed in alternating
fresh processes (two libraries registering the same ops cannot share a process).

    python scripts/bench_kernel_builds.py --against 29a5fec            # 4096 x 1024, fp32 and bf16, 3 pairs
    python scripts/bench_kernel_builds.py --against HEAD~1 --rows 128 --threads 1   # in cache: arithmetic only

Each build is compiled with this machine's flags (`normlab.kernels.cpu_build`) from ``csrc/cpu_norms.cpp`` as the
commit holds it. A process times every op forward and backward (``torch.ops.normlab_cpu`` called directly, no
autograd or module), in rounds that alternate the ops, and prints the median of each; the processes alternate
between the builds ``--pairs`` times, and the table gives each op's fastest process per build and their ratio.
The CPU's time varies by tens of percent on a shared VM, which this design tolerates: the fastest of several
alternating processes. Rows go to bench/kernel_builds.csv with the hardware and both commits.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from _study import stamp
from bench_kernels import cpu_name  # scripts/ is on the path when a script runs
from normlab.kernels import cpu_build
from normlab.table import append_csv, format_table
from normlab.version import code_version

SOURCE = "src/normlab/kernels/csrc/cpu_norms.cpp"

# one process: load a build, time every op; prints one JSON line {op: ms}
TIMER = """
import json, statistics, sys, time, torch
torch.set_num_threads(int(sys.argv[2])); torch.ops.load_library(sys.argv[1])
ops, rows, dt = torch.ops.normlab_cpu, int(sys.argv[3]), getattr(torch, sys.argv[4])
torch.manual_seed(0)
x, g = torch.randn(rows, 1024).to(dt), torch.randn(rows, 1024).to(dt)
w, b, s = torch.rand(1024).to(dt) + 0.5, torch.randn(1024).to(dt), torch.zeros(1024, dtype=dt)
a, beta = torch.full((1,), 0.5, dtype=dt), torch.ones(1, dtype=dt)
rstd = ops.rms_fwd(x, w, 1e-6)[1]
calls = {"copy": lambda: x.clone(), "rms_norm fwd": lambda: ops.rms_fwd(x, w, 1e-6),
         "rms_norm bwd": lambda: ops.rms_bwd(g, x, rstd, w)}
for name, kind, p0, p1 in (("dyt", 0, a, None), ("derf", 1, a, s), ("dyisru", 2, beta, None), ("eln", 3, beta, None)):
    calls[name + " fwd"] = lambda k=kind, p0=p0, p1=p1: ops.pointwise_fwd(x, p0, p1, w, b, 1.0, k)
    calls[name + " bwd"] = lambda k=kind, p0=p0, p1=p1: ops.pointwise_bwd(g, x, None, p0, p1, w, b, 1.0, k)
times = {k: [] for k in calls}
for f in calls.values():
    f()
for _ in range(15):
    for k, f in calls.items():
        t = time.perf_counter()
        for _ in range(5):
            f()
        times[k].append((time.perf_counter() - t) / 5 * 1e3)
print(json.dumps({k: statistics.median(v) for k, v in times.items()}))
"""


def build(commit: str, folder: Path) -> Path:
    """The library of ``commit``'s kernel source, compiled with this machine's flags."""
    src = folder / f"{commit}.cpp"
    src.write_text(subprocess.run(["git", "show", f"{commit}:{SOURCE}"], capture_output=True, text=True,
                                  check=True).stdout)  # fmt: skip
    out = folder / f"{commit}.so"
    subprocess.run(cpu_build.compile_command(src, out), check=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", required=True, help="the earlier commit")
    ap.add_argument("--commit", default="HEAD", help="the later commit (default HEAD)")
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--pairs", type=int, default=3, help="alternating processes per build")
    ap.add_argument("--csv", default="bench/kernel_builds.csv")
    args = ap.parse_args()
    revs = {}
    for name in (args.against, args.commit):
        revs[name] = subprocess.run(["git", "rev-parse", "--short=12", name], capture_output=True, text=True,
                                    check=True).stdout.strip()  # fmt: skip
    machine = f"{cpu_name()}, {args.threads} threads, torch {torch.__version__}"
    with tempfile.TemporaryDirectory() as tmp:
        libs = {name: build(rev, Path(tmp)) for name, rev in revs.items()}
        records = []
        for dtype in args.dtypes:
            best: dict[str, dict[str, float]] = {name: {} for name in libs}
            for _ in range(args.pairs):
                for name, lib in libs.items():
                    cmd = [sys.executable, "-c", TIMER, str(lib), str(args.threads), str(args.rows), dtype]
                    got = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
                    for op, ms in got.items():
                        best[name][op] = min(ms, best[name].get(op, float("inf")))
            before, after = best[args.against], best[args.commit]
            rows = [[op, f"{before[op]:.3f}", f"{after[op]:.3f}", f"{after[op] / before[op]:.2f}"] for op in before]
            print(f"\n{dtype}, {args.rows} x 1024, fastest of {args.pairs} processes per build, ms; {machine}")
            print(format_table(["op", revs[args.against], revs[args.commit], "after / before"], rows, markdown=True))
            records += [{"date": datetime.date.today().isoformat(), "machine": machine, "dtype": dtype,
                         "rows": args.rows, "channels": 1024, "op": op, "before": revs[args.against],
                         "after": revs[args.commit], "before_ms": round(before[op], 4),
                         "after_ms": round(after[op], 4), "ratio": round(after[op] / before[op], 3),
                         "pairs": args.pairs, "bench_commit": code_version().get("git_commit", "unknown")[:12]}
                        for op in before]  # fmt: skip
    append_csv(args.csv, records, stamp=stamp())


if __name__ == "__main__":
    main()
