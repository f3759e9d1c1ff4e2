"""DyT's and Derf's fused CPU backward: compute tanh / erf again from x, or read it as the forward saved it?

    python scripts/bench_saves.py                  # 4096 x 1024, fp32 and bf16, DyT and Derf
    python scripts/bench_saves.py --channels 576 4096

`normlab.kernels.cpu.BACKWARD_SAVES` picks, per op, what the backward reads: ``x`` (x only; f = tanh(alpha x) or
erf(alpha x + s) is recomputed) or ``x_and_f`` (the forward also writes f in x's dtype: one more tensor written
and read, one transcendental fewer). Both modes alternate in one run, for forward + backward and for the backward
alone (the graph kept, as in `scripts/bench_kernels.py`), beside one copy of x (the memory floor's unit). The
gradients of both are compared with a float64 reference: in bf16 a saved f holds 8 bits, and 1 - f^2 near
saturation loses them, so the mode that is faster must also be as accurate. Rows go to bench/kernels_saves.csv.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time

import torch

from _study import ROOT, commit, machine, stamp
from normlab import functional as F
from normlab.kernels import cpu
from normlab.table import append_csv

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MODES = ("x", "x_and_f")


def call(op: str, x, p):
    return cpu.dyt(x, p[0], p[2], p[3]) if op == "dyt" else cpu.derf(x, p[0], p[1], p[2], p[3])


def reference(op: str, x, p):
    return F.dyt(x, p[0], p[2], p[3]) if op == "dyt" else F.derf(x, p[0], p[1], p[2], p[3])


def grad_error(op: str, mode: str, x, p, dy) -> float:
    """The largest error of any gradient (x, alpha, shift, weight, bias) against the float64 reference, relative to
    that gradient's largest magnitude."""
    cpu.BACKWARD_SAVES[op] = mode
    xs, ps = x.detach().requires_grad_(), [q.detach().requires_grad_() for q in p]
    got = torch.autograd.grad(call(op, xs, ps), [xs, *ps], dy, allow_unused=True)
    x64, p64 = x.double().requires_grad_(), [q.double().requires_grad_() for q in p]
    want = torch.autograd.grad(reference(op, x64, p64), [x64, *p64], dy.double(), allow_unused=True)
    errs = [((g.double() - w).abs().max() / w.abs().max().clamp_min(1e-30)).item()
            for g, w in zip(got, want, strict=True) if g is not None and w is not None]  # fmt: skip
    return max(errs)


def measure(op: str, dtype_name: str, rows: int, channels: int, reps: int, rounds: int) -> list[dict]:
    dtype = DTYPES[dtype_name]
    torch.manual_seed(0)
    x = (2 * torch.randn(rows, channels)).to(dtype)  # reaches saturation: |alpha x| up to about 5 at alpha 0.5
    dy = torch.randn(rows, channels).to(dtype)
    p = [torch.full((1,), 0.5), torch.full((1,), 0.1), torch.randn(channels), torch.randn(channels)]
    p = [q.to(dtype) for q in p]

    def full(mode):
        cpu.BACKWARD_SAVES[op] = mode
        xs = x.detach().requires_grad_()
        call(op, xs, p).backward(dy)

    graphs = {}

    def backward(mode):
        cpu.BACKWARD_SAVES[op] = mode
        if mode not in graphs:
            xs = x.detach().requires_grad_()
            graphs[mode] = (call(op, xs, p), xs)
        y, xs = graphs[mode]
        torch.autograd.grad(y, [xs], dy, retain_graph=True)

    calls = {("copy", ""): lambda: x.clone()}
    for mode in MODES:
        calls[("full", mode)] = lambda mode=mode: full(mode)
        calls[("backward", mode)] = lambda mode=mode: backward(mode)
    times = {k: [] for k in calls}
    for fn in calls.values():
        fn()
    for _ in range(rounds):  # alternate, so that a drift in the machine's load hits both modes
        for k, fn in calls.items():
            for _ in range(max(1, reps // rounds)):
                t0 = time.perf_counter()
                fn()
                times[k].append(1e3 * (time.perf_counter() - t0))
    ms = {k: statistics.median(v) for k, v in times.items()}
    out = []
    for mode in MODES:
        err = grad_error(op, mode, x, p, dy)
        out.append({"date": datetime.date.today().isoformat(), "commit": commit(), "machine": machine(), "op": op,
                    "dtype": dtype_name, "rows": rows, "channels": channels, "saves": mode,
                    "full_ms": round(ms[("full", mode)], 4), "backward_ms": round(ms[("backward", mode)], 4),
                    "copy_ms": round(ms[("copy", "")], 4),
                    "full_vs_x": round(ms[("full", mode)] / ms[("full", "x")], 3),
                    "saved_bytes": x.numel() * x.element_size() * (2 if mode == "x_and_f" else 1),
                    "grad_rel_error": float(f"{err:.3g}")})  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ops", nargs="+", default=["dyt", "derf"], choices=["dyt", "derf"])
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--channels", type=int, nargs="+", default=[1024])
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--csv", default=str(ROOT / "bench" / "kernels_saves.csv"))
    args = ap.parse_args()
    if not cpu.ready(wait=True):
        raise SystemExit("the CPU kernels are not available on this machine: nothing to compare")
    default = dict(cpu.BACKWARD_SAVES)
    print(machine())
    try:
        for dtype_name in args.dtypes:
            for c in args.channels:
                for op in args.ops:
                    rows = measure(op, dtype_name, args.rows, c, args.reps, args.rounds)
                    for r in rows:
                        print(f"{op:5s} {dtype_name} {args.rows} x {c} saves {r['saves']:8s} fwd+bwd "
                              f"{r['full_ms']:7.3f} ms (x{r['full_vs_x']:.3f})  bwd {r['backward_ms']:7.3f} ms  "
                              f"copy {r['copy_ms']:.3f} ms  grad error {r['grad_rel_error']:.2e}")  # fmt: skip
                    append_csv(args.csv, rows, stamp=stamp())
    finally:
        cpu.BACKWARD_SAVES.update(default)
    print(f"appended to {args.csv}")


if __name__ == "__main__":
    main()
