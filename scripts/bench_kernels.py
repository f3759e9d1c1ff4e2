"""Kernel benchmark: normlab's fused kernels against torch eager, torch.compile and Liger-Kernel, in one run.

    python scripts/bench_kernels.py                          # GPU: 4096 rows x {1024..8192}, bf16 and fp32
    python scripts/bench_kernels.py --ops dyt --dtypes bf16 --channels 4096

For each op, mode (forward, backward, full) and provider it reports milliseconds, GB/s and the
fraction of the device's copy bandwidth, measured in the same run by a device-to-device copy.
Bytes are the minimum traffic of each op (read x, write y; backward: read x and dy, write dx;
parameters are negligible). Peak memory of a full pass is reported too. Rows are appended to a
CSV with the device name, commit and date.

On a CPU (no GPU, or --cpu) it answers "which norm is fastest here": every norm at its best
(``kernel="auto"``: PyTorch's fused LayerNorm, normlab's fused CPU paths for the rest) against the
reference math, nn.LayerNorm / nn.RMSNorm, torch.compile of the reference, and the copy floor, all
timed in one run, alternating providers round by round. The floor of a forward + backward is five
tensor passes (read x, write y; read x and dy, write dx), 2.5 times one copy of x measured in the same
run. It also times the one-time build of the CPU kernels (into an empty cache, in a fresh process) and the
first call of each op in a fresh process, with the machine's build and with an empty cache (where
``kernel="auto"`` takes the reference while the build runs in the background). Rows go to
bench/kernels_cpu.csv:

    python scripts/bench_kernels.py --cpu --channels 1024 --dtypes fp32 bf16
"""

from __future__ import annotations

import argparse
import datetime
import platform

import torch

import normlab.functional as FN
from _study import stamp
from normlab.kernels.inductor_cache import use_cache_of_this_cpu
from normlab.table import append_csv
from normlab.version import code_version

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _ops(n: int, dev, dtype):
    """(name, make_params, reference_fn, fused_fn | None, liger_fn | None) for each op."""
    from normlab.kernels import interpreting, triton_status
    from normlab.kernels.fused import derf as k_derf
    from normlab.kernels.fused import dyisru as k_dyisru
    from normlab.kernels.fused import dyt as k_dyt
    from normlab.kernels.fused import rms_norm as k_rms

    fused_ok = triton_status()[0] and (dev.type == "cuda" or interpreting())
    liger = {}
    try:  # optional: Liger-Kernel's DyT and RMSNorm, when installed
        from liger_kernel.ops.dyt import LigerDyTFunction
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        liger["dyt"] = lambda x, a, w, b: LigerDyTFunction.apply(x, a, w, b)
        liger["rms_norm"] = lambda x, w: LigerRMSNormFunction.apply(x, w, 1e-6)
    except ImportError:
        pass
    if dev.type != "cuda":  # Liger's Triton kernels need a GPU
        liger = {}

    def p(*shape, fill=None):
        if fill is not None:
            return torch.full(shape, fill, device=dev, dtype=dtype, requires_grad=True)
        return (torch.randn(*shape, device=dev, dtype=dtype) * 0.1 + 1).requires_grad_(True)

    return [
        ("dyt", lambda: (p(1, fill=0.5), p(n), p(n)), FN.dyt, k_dyt if fused_ok else None, liger.get("dyt")),
        ("dyisru", lambda: (p(1, fill=4.0), p(n), p(n)), FN.dyisru, k_dyisru if fused_ok else None, None),
        ("derf", lambda: (p(1, fill=0.5), p(1, fill=0.0), p(n), p(n)), FN.derf, k_derf if fused_ok else None, None),
        (
            "rms_norm",
            lambda: (p(n),),
            lambda x, w: FN.rms_norm(x, w, 1e-6),
            (lambda x, w: k_rms(x, w, 1e-6)) if fused_ok else None,
            liger.get("rms_norm"),
        ),
    ]


def _time(fn, dev, reps: int) -> float:
    """Median milliseconds of fn()."""
    import statistics
    import time

    for _ in range(3):
        fn()
    if dev.type == "cuda":
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _modes(fn, x, params, dy, io: int) -> dict:
    """The three timed calls and the minimum bytes each moves (io = bytes of one (M, N) tensor)."""
    inputs = [x, *params]
    y = fn(x, *params)
    return {
        "forward": (lambda: fn(x, *params), 2 * io),  # read x, write y
        "backward": (lambda: torch.autograd.grad(y, inputs, dy, retain_graph=True), 3 * io),  # read x, dy; write dx
        "full": (lambda: torch.autograd.grad(fn(x, *params), inputs, dy), 5 * io),
    }


def copy_bandwidth(nbytes: int, dev, reps: int) -> float:
    """GB/s of a device copy of nbytes (read + write = 2 nbytes moved)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    ms = _time(lambda: dst.copy_(src), dev, reps)
    return 2 * nbytes / ms / 1e6


def run(args) -> list[dict]:
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else (platform.processor() or platform.machine())
    commit = code_version().get("git_commit", "unknown")[:12]
    rows = []
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        for n in args.channels:
            m = args.rows
            elt = torch.finfo(dtype).bits // 8
            io = m * n * elt  # one (M, N) tensor
            peak_bw = copy_bandwidth(2 * io, dev, args.reps)  # a copy of the same bytes as a forward
            for op, make, ref, fused, liger in _ops(n, dev, dtype):
                if args.ops and op not in args.ops:
                    continue
                providers = {"torch_eager": ref, "torch_compile": torch.compile(ref)}
                if op == "rms_norm":  # what a user of torch.nn.RMSNorm runs: PyTorch's own kernel
                    providers["torch_rms_norm"] = lambda x, w: torch.nn.functional.rms_norm(x, (x.shape[-1],), w, 1e-6)
                if fused is not None:
                    providers["normlab"] = fused
                if liger is not None:
                    providers["liger"] = liger
                for prov, fn in providers.items():
                    x = torch.randn(m, n, device=dev, dtype=dtype, requires_grad=True)
                    params = make()
                    dy = torch.randn(m, n, device=dev, dtype=dtype)
                    for mode, (call, nbytes) in _modes(fn, x, params, dy, io).items():
                        if args.modes and mode not in args.modes:
                            continue
                        if dev.type == "cuda":
                            torch.cuda.reset_peak_memory_stats(dev)
                        ms = _time(call, dev, args.reps)
                        peak = torch.cuda.max_memory_allocated(dev) / 2**20 if dev.type == "cuda" else float("nan")
                        gbs = nbytes / ms / 1e6
                        rows.append(
                            {
                                "date": datetime.date.today().isoformat(),
                                "commit": commit,
                                "device": name,
                                "op": op,
                                "mode": mode,
                                "provider": prov,
                                "dtype": dtype_name,
                                "rows": m,
                                "channels": n,
                                "ms": round(ms, 4),
                                "GB/s": round(gbs, 1),
                                "copy_GB/s": round(peak_bw, 1),
                                "frac_of_copy": round(gbs / peak_bw, 3),
                                "peak_MiB": round(peak, 1),
                            }
                        )
                        r = rows[-1]
                        frac = 100 * r["frac_of_copy"]
                        print(
                            f"{op:9s} {mode:8s} {prov:13s} {dtype_name} {m}x{n}: {r['ms']:8.3f} ms "
                            f"{r['GB/s']:7.1f} GB/s  {frac:5.1f}% of copy  peak {r['peak_MiB']} MiB"
                        )
    return rows


CPU_NORMS = ["layer_norm", "rms_norm", "dyt", "scaled_dyt", "derf", "dyisru", "eln"]
NATIVE = {"layer_norm": lambda n: torch.nn.LayerNorm(n), "rms_norm": lambda n: torch.nn.RMSNorm(n)}


def cpu_name() -> str:
    """The CPU's model name and the vector instructions PyTorch uses on it, with "bf16" where it has AVX512-BF16 or
    AMX: the "AMD EPYC" virtual machines seen here are of two kinds, AVX-512 with bf16 and AVX2 alone (where a bf16
    product is emulated, 7x slower than float32), and their times differ (rows written before 0.4.7 give the name
    alone: the AVX-512 kind)."""
    name = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return f"{name} ({torch.backends.cpu.get_cpu_capability()}{', bf16' if native else ''})"


def first_call_seconds(name: str, n: int, dtype_name: str, cache: str | None = None) -> tuple[float, bool]:
    """(seconds, fused) of the first forward + backward of ``name`` (kernel='auto') in a fresh process, with
    normlab's cache at ``cache`` (default: the user's, where the kernels are built); ``fused``: whether the
    fused path was loaded by then (with an empty cache the call takes the reference while the build runs)."""
    import os
    import subprocess
    import sys

    dtype = str(DTYPES[dtype_name])  # "torch.float32"
    code = (
        f"import time, torch, normlab\nfrom normlab.kernels import cpu\n"
        f"m = normlab.create_norm({name!r}, {n}).to({dtype})\n"
        f"x = torch.randn(64, {n}, dtype={dtype}, requires_grad=True)\n"
        "t0 = time.perf_counter(); m(x).sum().backward()\n"
        "print(time.perf_counter() - t0, cpu.ready())"
    )
    env = {**os.environ, **({"NORMLAB_CACHE": cache} if cache else {})}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    seconds, fused = out.stdout.strip().splitlines()[-1].split()
    return float(seconds), fused == "True"


def build_seconds() -> float:
    """Seconds of the one-time build (``normlab build-kernels``) into an empty cache, in a fresh process."""
    import os
    import subprocess
    import sys
    import tempfile
    import time

    with tempfile.TemporaryDirectory() as cache:
        t0 = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "normlab.cli", "build-kernels"],
            capture_output=True,
            check=True,
            env={**os.environ, "NORMLAB_CACHE": cache},
        )
        return time.perf_counter() - t0


def run_cpu(args) -> list[dict]:
    import statistics
    import tempfile
    import time

    import normlab
    from normlab.kernels import cpu as cpu_kernels

    threads = torch.get_num_threads()
    cpu, commit = cpu_name(), code_version().get("git_commit", "unknown")[:12]
    print(f"{cpu}, {threads} threads, torch {torch.__version__}")
    cpu_kernels.ready(wait=True)  # the one-time build, if this machine has not made it yet
    # every norm module shares one forward: give torch.compile room for all of them (else it runs eager)
    torch._dynamo.config.recompile_limit = torch._dynamo.config.accumulated_recompile_limit = 1024
    if not args.no_first_call:
        print(f"one-time build of the CPU kernels into an empty cache, fresh process: {build_seconds():.1f} s")
    rows = []
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        for n in args.channels:
            m = args.rows
            x0 = torch.randn(m, n, dtype=dtype)
            dy = torch.randn(m, n, dtype=dtype)
            calls = {"copy": lambda x0=x0: x0.clone()}
            for name in CPU_NORMS:
                if args.ops and name not in args.ops:
                    continue
                torch.manual_seed(0)
                mods = {"normlab": normlab.create_norm(name, n),
                        "reference": normlab.create_norm(name, n, kernel="reference")}  # fmt: skip
                if name in NATIVE:
                    mods["native"] = NATIVE[name](n)
                mods["torch_compile"] = torch.compile(normlab.create_norm(name, n, kernel="reference"))
                for prov, mod in mods.items():
                    mod = mod.to(dtype)

                    def full(mod=mod, x0=x0, dy=dy):
                        x = x0.detach().requires_grad_(True)
                        mod.zero_grad(set_to_none=True)
                        mod(x).backward(dy)

                    def forward(mod=mod, x0=x0):
                        with torch.no_grad():
                            mod(x0)

                    calls[(name, prov, "full")] = full
                    calls[(name, prov, "forward")] = forward
            times = {k: [] for k in calls}
            for fn in calls.values():  # warm-up, and the compiles
                for _ in range(3):
                    fn()
            for _ in range(args.rounds):  # alternate: slow drifts of a shared machine hit every provider alike
                for k, fn in calls.items():
                    for _ in range(max(1, args.reps // args.rounds)):
                        t0 = time.perf_counter()
                        fn()
                        times[k].append((time.perf_counter() - t0) * 1e3)
            ms = {k: statistics.median(v) for k, v in times.items()}
            floor = {"full": 2.5 * ms["copy"], "forward": ms["copy"]}  # passes over x: 5 and 2; a copy is 2
            print(
                f"\n{dtype_name} {m} x {n}: one copy of x {ms['copy']:.3f} ms; floor fwd {floor['forward']:.3f}, "
                f"fwd+bwd {floor['full']:.3f} ms"
            )
            for key, v in ms.items():
                if key == "copy":
                    continue
                name, prov, mode = key
                native = [ms[(name, p, mode)] for p in ("native",) if (name, p, mode) in ms]
                row = {"date": datetime.date.today().isoformat(), "commit": commit, "device": cpu, "threads": threads,
                       "torch": torch.__version__, "op": name, "provider": prov, "mode": mode, "dtype": dtype_name,
                       "rows": m, "channels": n, "ms": round(v, 4), "copy_ms": round(ms["copy"], 4),
                       "x_floor": round(v / floor[mode], 2),
                       "x_native": round(v / native[0], 3) if native else None,
                       "x_compile": round(v / ms[(name, "torch_compile", mode)], 3), "first_call_s": None,
                       "first_call_empty_cache_s": None}  # fmt: skip
                extra = ""
                if prov == "normlab" and mode == "full" and not args.no_first_call and name != "layer_norm":
                    seconds, fused = first_call_seconds(name, n, dtype_name)
                    with tempfile.TemporaryDirectory() as empty:
                        cold, cold_fused = first_call_seconds(name, n, dtype_name, empty)
                    row["first_call_s"], row["first_call_empty_cache_s"] = round(seconds, 3), round(cold, 3)
                    extra = (
                        f"  first call {seconds:.3f} s ({'fused' if fused else 'reference'}); with an empty "
                        f"cache {cold:.3f} s ({'fused' if cold_fused else 'reference'})"
                    )
                rows.append(row)
                print(
                    f"{name:10s} {prov:13s} {mode:8s} {v:8.3f} ms  {row['x_floor']:6.2f}x floor  "
                    f"{row['x_compile']:5.2f}x compile"
                    + (f"  {row['x_native']:5.2f}x native" if native else "")
                    + extra
                )
    return rows


def main() -> None:
    use_cache_of_this_cpu()  # Inductor's code cache keyed by this CPU (docs/reliability.md)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--channels", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=list(DTYPES))
    ap.add_argument("--ops", nargs="*", help="subset of dyt, dyisru, derf, rms_norm (CPU: +layer_norm scaled_dyt eln)")
    ap.add_argument("--modes", nargs="*", help="subset of forward, backward, full")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--cpu", action="store_true", help="run on the CPU even if a GPU is present")
    ap.add_argument("--rounds", type=int, default=5, help="CPU: providers alternate in this many rounds")
    ap.add_argument("--no-first-call", action="store_true", help="CPU: skip the fresh-process compile timing")
    ap.add_argument("--gpu-table", action="store_true", help="the GPU table on this device even without a GPU (a "
                    "tiny check of the script; normlab's Triton rows under TRITON_INTERPRET=1)")  # fmt: skip
    ap.add_argument("--csv", help="default bench/kernels.csv (GPU) or bench/kernels_cpu.csv (CPU)")
    args = ap.parse_args()
    on_cpu = args.cpu or not torch.cuda.is_available()
    if on_cpu and args.channels == ap.get_default("channels"):
        args.channels = [1024]
    rows = run_cpu(args) if on_cpu and not args.gpu_table else run(args)
    args.csv = args.csv or ("bench/kernels_cpu.csv" if on_cpu else "bench/kernels.csv")
    print(f"appended {len(rows)} rows to {append_csv(args.csv, rows, stamp=stamp())}")


if __name__ == "__main__":
    main()
