"""Training steps of a Hugging Face Llama built from a config, through `normlab.replace_norms`: each norm's step time
as a ratio to RMSNorm's, eager and under torch.compile, all in one run.

    python scripts/bench_own_model.py                       # CPU: 4 layers, width 512, sequence 256, batch 4
    python scripts/bench_own_model.py --device cuda         # GPU: adds Liger-Kernel's LigerRMSNorm and LigerDyT

The anchor is the model's own norm, HF's ``LlamaRMSNorm`` as the model ships (the ratio's denominator, column
``ratio_to_own_norm``; rows before 0.8.0 are anchored on ``nn.RMSNorm`` in ``ratio_to_rmsnorm``); torch's
``nn.RMSNorm`` in every site is timed beside it. normlab's DyT, Derf and DyISRU go in through the swap, as a user's
code would put them (``kernel="auto"``: the fused C++ op on the CPU, Triton on CUDA). One step is a forward, the
backward and an AdamW step on one batch of random tokens. The variants take turns round by round (so a slower
machine state falls on every variant alike); the median step of each is reported, and its ratio to
``LlamaRMSNorm``'s in the same mode. Each variant is checked to run its fused path (the ops the dispatcher saw) before
it is timed. Rows go to bench/own_model.csv with the hardware, torch and commit.

With ``--device cuda`` and liger-kernel installed, LigerRMSNorm and LigerDyT are timed as the anchors of the GPU
rows; under ``TRITON_INTERPRET=1`` on a CPU the same code runs (slowly), which the test suite does not need.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import normlab  # noqa: E402
from bench_kernels import cpu_name  # noqa: E402  (scripts/ is on the path when a script runs)
from normlab.kernels.inductor_cache import use_cache_of_this_cpu  # noqa: E402
from normlab.kernels.paths import fused_ops  # noqa: E402
from normlab.sites import swap  # noqa: E402
from normlab.table import append_csv  # noqa: E402

OUT = ROOT / "bench" / "own_model.csv"
OWN = "rmsnorm (HF LlamaRMSNorm)"  # the anchor: the model's own norm, as it ships


def llama(args, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    hidden = int(args.width * 8 / 3) // 64 * 64  # LLaMA's SwiGLU width, to a multiple of 64
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.width, intermediate_size=hidden,
                      num_hidden_layers=args.layers, num_attention_heads=args.width // 64,
                      num_key_value_heads=args.width // 64, max_position_embeddings=args.seq)  # fmt: skip
    return LlamaForCausalLM(cfg).to(args.device)


def _every_rmsnorm(model: nn.Module, make) -> None:
    names = [n for n, m in model.named_modules() if type(m).__name__ == "LlamaRMSNorm"]
    for n in names:
        old = model.get_submodule(n)
        swap(model, n, make(old.weight.shape[0], old.variance_epsilon).to(old.weight.device))


def variants(args) -> dict:
    """name -> a function that builds the model with that norm in every site."""

    def torch_rms(a):
        m = llama(a)
        _every_rmsnorm(m, lambda d, eps: nn.RMSNorm(d, eps=eps))
        return m

    out = {"rmsnorm (torch)": torch_rms, "rmsnorm (HF LlamaRMSNorm)": llama}
    for name in ("dyt", "derf", "dyisru"):
        out[f"{name} (normlab)"] = lambda a, name=name: _swapped(a, name)
    if args.device == "cuda":
        liger = _liger()
        if liger is not None:
            rms_cls, dyt_cls = liger

            def liger_rms(a):
                m = llama(a)
                _every_rmsnorm(m, lambda d, eps: rms_cls(d, eps=eps))
                return m

            def liger_dyt(a):
                m = llama(a)
                _every_rmsnorm(m, lambda d, eps: dyt_cls(d))
                return m

            out["rmsnorm (Liger)"], out["dyt (Liger)"] = liger_rms, liger_dyt
        else:
            print("liger-kernel is not installed: pip install liger-kernel for its anchors", file=sys.stderr)
    return out


def _swapped(args, name: str):
    m = llama(args)
    normlab.replace_norms(m, name)
    return m


def _liger():
    try:
        from liger_kernel.transformers.rms_norm import LigerRMSNorm
    except ImportError:
        return None
    for path in ("liger_kernel.transformers.dyt", "liger_kernel.transformers.element_wise_dyt"):
        try:
            module = __import__(path, fromlist=["LigerDyT"])
            return LigerRMSNorm, module.LigerDyT
        except ImportError:
            continue
    return None


def main() -> int:
    use_cache_of_this_cpu()  # Inductor's code cache keyed by this CPU (docs/reliability.md)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=8, help="timed steps of each variant, taken in turns")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--modes", nargs="+", default=["eager", "compile"], choices=["eager", "compile"])
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    from normlab.kernels import cpu

    if args.device == "cpu" and not cpu.ready(wait=True):
        print("the CPU kernels did not build here: normlab's rows would time the reference math", file=sys.stderr)
        return 1
    batch = torch.randint(0, args.vocab, (args.batch, args.seq), device=args.device)
    rows = []
    for mode in args.modes:
        steps = {}
        for name, build in variants(args).items():
            model = build(args)
            fused = "-"
            if mode == "eager" and "normlab" in name and args.device == "cpu":
                ops = fused_ops(lambda m=model: m(input_ids=batch, labels=batch).loss.backward())
                fused = "yes" if ops.get("normlab_cpu::pointwise_bwd", 0) == 2 * args.layers + 1 else f"no: {ops}"
                if fused != "yes":
                    print(f"{name}: not on the fused path ({fused})", file=sys.stderr)
            fwd = torch.compile(model) if mode == "compile" else model
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

            def step(fwd=fwd, opt=opt):
                loss = fwd(input_ids=batch, labels=batch).loss
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                if args.device == "cuda":
                    torch.cuda.synchronize()

            t0 = time.perf_counter()
            for _ in range(args.warmup):
                step()
            print(f"{mode:7s} {name:28s} ready ({time.perf_counter() - t0:.1f} s: warm-up, compile)", flush=True)
            steps[name] = {"step": step, "times": [], "fused": fused}
        for _ in range(args.rounds):  # in turns: each round times every variant once
            for v in steps.values():
                t0 = time.perf_counter()
                v["step"]()
                v["times"].append(time.perf_counter() - t0)
        anchor = statistics.median(steps[OWN]["times"])  # what the user has: the model's own norm
        for name, v in steps.items():
            med = statistics.median(v["times"])
            rows.append({"mode": mode, "norm": name, "median_ms": round(med * 1e3, 1),
                         "ratio_to_own_norm": round(med / anchor, 3), "fused_path": v["fused"],
                         "steps": len(v["times"])})  # fmt: skip
            print(f"{mode:7s} {name:28s} {med * 1e3:8.1f} ms  {med / anchor:6.3f}x  fused: {v['fused']}")
        steps.clear()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    stamp = {"date": datetime.date.today().isoformat(), "commit": commit.stdout.strip(), "device": device,
             "machine": cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__,
             "layers": args.layers, "width": args.width, "seq": args.seq, "batch": args.batch,
             "command": "python " + " ".join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]])}  # fmt: skip
    if not args.no_record:
        append_csv(OUT, rows, stamp)
        print(f"{len(rows)} rows appended to {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
