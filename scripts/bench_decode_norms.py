"""One norm call at a decode step: the cost per site that a converted model pays for every generated token.

    python scripts/bench_decode_norms.py                   # 1 x 576 (SmolLM2's width), inference mode
    python scripts/bench_decode_norms.py --shape 1 2048 --threads 1

At decode a norm reads one row, so what it costs is the call, not the arithmetic. This times, in one run and
alternating round by round, the original model's norm (Hugging Face's LlamaRMSNorm, what SmolLM2 ships with)
against each normlab module on its default path (``kernel="auto"``) and on the reference math, and against the
fused C++ op of RMSNorm and DyT called alone (what the modules' Python adds), under ``torch.inference_mode()``.
The median of the rounds is reported in microseconds per call and as a ratio to LlamaRMSNorm, with the hardware;
rows go to bench/decode_norms.csv. `scripts/bench_fold.py` measures the whole model.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time

import torch

import normlab
from _study import stamp
from bench_kernels import cpu_name  # scripts/ is on the path when a script runs
from normlab.table import append_csv, format_table
from normlab.version import code_version

NORMS = ["rms_norm", "dyt", "derf", "dyisru", "eln"]


def per_call_us(fn, x, reps: int) -> float:
    t = time.perf_counter()
    for _ in range(reps):
        fn(x)
    return (time.perf_counter() - t) / reps * 1e6


def providers(c: int) -> dict:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    out = {"LlamaRMSNorm (the original's)": LlamaRMSNorm(c, eps=1e-5)}
    for name in NORMS:
        for kernel in ("auto", "reference"):
            out[f"{name}, {kernel}"] = normlab.create_norm(name, c, kernel=kernel)
    # the C++ op alone, with the modules' parameters: what a call would cost without the module's Python
    rms, dyt = out["rms_norm, auto"], out["dyt, auto"]
    out["rms_norm, the C++ op alone"] = lambda x: torch.ops.normlab_cpu.rms_fwd(x, rms.weight, rms.eps)[0]
    out["dyt, the C++ op alone"] = lambda x: torch.ops.normlab_cpu.pointwise_fwd(
        x, dyt.alpha, None, dyt.weight, dyt.bias, 1.0, 0
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", type=int, nargs="+", default=[1, 576], help="the input's shape (default 1 576)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--reps", type=int, default=2000, help="calls per timing")
    ap.add_argument("--rounds", type=int, default=7, help="every provider is timed once per round")
    ap.add_argument("--csv", default="bench/decode_norms.csv")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from normlab.kernels import cpu

    cpu.ready(wait=True)
    x = torch.randn(*args.shape)
    mods = providers(args.shape[-1])
    times = {name: [] for name in mods}
    with torch.inference_mode():
        for m in mods.values():  # warm-up
            per_call_us(m, x, 100)
        for _ in range(args.rounds):
            for name, m in mods.items():
                times[name].append(per_call_us(m, x, args.reps))
    base = statistics.median(times["LlamaRMSNorm (the original's)"])
    machine = f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    commit = code_version().get("git_commit", "unknown")[:12]
    rows, records = [], []
    for name, t in times.items():
        us = statistics.median(t)
        rows.append([name, f"{us:.2f}", f"{us / base:.2f}"])
        records.append({"provider": name, "shape": "x".join(map(str, args.shape)), "us_per_call": round(us, 3),
                        "vs_llama_rms_norm": round(us / base, 3), "reps": args.reps, "rounds": args.rounds,
                        "commit": commit, "date": datetime.date.today().isoformat(), "machine": machine})  # fmt: skip
    print(f"one call on {tuple(args.shape)}, inference mode; {machine}")
    print(format_table(["provider", "us per call", "vs LlamaRMSNorm"], rows, markdown=True))
    append_csv(args.csv, records, stamp=stamp())
    print(f"rows appended to {args.csv}")


if __name__ == "__main__":
    main()
