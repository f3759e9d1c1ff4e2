"""Build normlab's CPU kernels and run the kernel, module and swap tests against a named torch release, in a venv of
its own, and record the result in bench/torch_versions.csv.

    python3 scripts/kernels_on_torch.py 2.15.0            # venv /work/venv-torch-2.15.0 (made if absent)
    python3 scripts/kernels_on_torch.py 2.14.1 --venv DIR

CI installs the one torch that comes as a CPU wheel here (2.13.0, the Makefile's pin); a plain ``pip install torch``
gives users the newest release, a multi-GB CUDA build that CI cannot install at every landing. This script is how a
new release is checked: a fresh venv, ``pip install torch==VERSION``, then ``pip install -e .`` (torch already
satisfied), ``normlab build-kernels --check`` into an empty kernel cache (so the build happens here, not from an
earlier one), and pytest on tests/kernels, tests/test_norms.py and tests/test_swap.py. One row per run: the torch
version, the C++ standard the build took from it, whether it built and in how long, the path each norm took, and
the tests' counts.

Runs with any Python 3.10+; it needs no torch itself.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "torch_versions.csv"
TESTS = ["tests/kernels", "tests/test_norms.py", "tests/test_swap.py"]
FIELDS = ["date", "commit", "torch", "python", "machine", "std", "built", "build_s", "fused_norms", "reference_norms",
          "passed", "failed", "skipped", "errors", "test_s", "command"]  # fmt: skip


def run(cmd: list[str], env: dict | None = None, log: Path | None = None) -> subprocess.CompletedProcess:
    print("$", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    if log is not None:
        with log.open("a") as f:
            f.write(f"$ {' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}\n")
    return proc


def cpu_name() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    name = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "?")
    flags = next((ln for ln in text.splitlines() if ln.startswith("flags")), "").split()
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    return f"{name}, {isa}, {os.cpu_count()} cores"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("version", help="the torch release, e.g. 2.15.0")
    ap.add_argument("--venv", type=Path, help="the venv (default /work/venv-torch-VERSION, made if absent)")
    ap.add_argument("--no-record", action="store_true", help="do not append to bench/torch_versions.csv")
    args = ap.parse_args()
    venv = args.venv or Path(f"/work/venv-torch-{args.version}")
    py = venv / "bin" / "python"
    log = Path(tempfile.mkdtemp(prefix="normlab-torch-")) / "log.txt"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    have = run([str(py), "-c", "import torch; print(torch.__version__)"]).stdout.strip().split("+")[0]
    # a site-wide pip constraint may cap torch below the release asked for: the named release is what is wanted
    env = {**os.environ, "PIP_CONSTRAINT": os.devnull}
    if have != args.version:
        proc = run([str(py), "-m", "pip", "install", "--quiet", f"torch=={args.version}"], env=env, log=log)
        if proc.returncode:
            print(proc.stderr[-3000:], file=sys.stderr)
            return 1
    proc = run([str(py), "-m", "pip", "install", "--quiet", "-e", ".[hf]", "pytest"], env=env, log=log)
    if proc.returncode:
        print(proc.stderr[-3000:], file=sys.stderr)
        return 1
    torch_version = run([str(py), "-c", "import torch; print(torch.__version__)"]).stdout.strip()
    cache = tempfile.mkdtemp(prefix="normlab-cache-")
    test_env = {**os.environ, "NORMLAB_CACHE": cache}
    test_env.pop("NORMLAB_KERNEL", None)
    t0 = datetime.datetime.now()
    build = run([str(venv / "bin" / "normlab"), "build-kernels", "--check"], env=test_env, log=log)
    build_s = (datetime.datetime.now() - t0).total_seconds()
    print(build.stdout, build.stderr[-3000:], sep="\n")
    std = re.search(r" as (c\+\+\d\d)", build.stdout)
    fused = sorted(set(re.findall(r"^(\w+)\s+fused C\+\+ \(normlab_cpu\)\s+fused C\+\+", build.stdout, re.M)))
    reference = sorted(set(re.findall(r"^(\w+)\s+.*reference math", build.stdout, re.M)))
    t0 = datetime.datetime.now()
    tests = run([str(py), "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS], env=test_env, log=log)
    test_s = (datetime.datetime.now() - t0).total_seconds()
    tail = tests.stdout.strip().splitlines()[-1] if tests.stdout.strip() else ""
    print("\n".join(tests.stdout.strip().splitlines()[-15:]))
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)", tail)}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    row = {
        "date": datetime.date.today().isoformat(), "commit": commit.stdout.strip(), "torch": torch_version,
        "python": run([str(py), "-c", "import platform; print(platform.python_version())"]).stdout.strip(),
        "machine": cpu_name(), "std": std.group(1) if std else "", "built": build.returncode == 0,
        "build_s": round(build_s, 1), "fused_norms": " ".join(fused), "reference_norms": " ".join(reference),
        "passed": counts.get("passed", 0), "failed": counts.get("failed", 0), "skipped": counts.get("skipped", 0),
        "errors": counts.get("errors", counts.get("error", 0)), "test_s": round(test_s, 1),
        "command": f"python3 scripts/kernels_on_torch.py {args.version}",
    }  # fmt: skip
    print(row)
    print(f"full log: {log}")
    if not args.no_record:
        new = not OUT.exists()
        with OUT.open("a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=FIELDS)
            if new:
                w.writeheader()
            w.writerow(row)
        print(f"row appended to {OUT.relative_to(ROOT)}")
    return 0 if build.returncode == 0 and tests.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
