"""Greedy decoding speed of SmolLM2-135M-Instruct in ONNX Runtime: the converted model (DyISRU per channel, first-token
copies, folded) beside the original, both exported by normlab.export_onnx, and both in PyTorch, in one run.

    python scripts/bench_onnx.py                     # 16-token prompt, 128 new tokens, 3 repeats
    python scripts/bench_onnx.py --threads 1

Each engine decodes the same prompt (held-out Shakespeare) one token at a time with its KV cache, batch 1, and the
median of the repeats counts. PyTorch runs the model's forward with its cache in a plain loop (what
`normlab.conversion.data.samples` does), the converted one on normlab's fused CPU kernels. Rows go to
bench/onnx_decode.csv with the machine and the commit. A benchmark, not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import normlab
from _study import commit, stamp
from bench_kernels import cpu_name  # scripts/ is on the path when a script runs
from normlab.conversion.batches import cache_kwarg
from normlab.conversion.data.fixtures import smollm2
from normlab.conversion.data.models import load_model, quiet
from normlab.conversion.data.texts import TextCut, text_batches
from normlab.conversion.export.onnx_export import OnnxCheck, OnnxLM
from normlab.corpus import fetch_shakespeare
from normlab.table import append_csv, format_table

ROOT = Path(__file__).resolve().parent.parent


def _torch_decode(model, prompt: torch.Tensor, new: int) -> tuple[float, float]:
    """Seconds of the prompt's pass and of the ``new`` steps after it."""
    key = cache_kwarg(model)
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model(input_ids=prompt, use_cache=True)
        t1 = time.perf_counter()
        for _ in range(new):
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            out = model(input_ids=nxt, use_cache=True, **{key: out[key]})
        return t1 - t0, time.perf_counter() - t1


def _onnx_decode(runner: OnnxLM, prompt: np.ndarray, new: int) -> tuple[float, float]:
    t0 = time.perf_counter()
    logits, past = runner.step(prompt, runner.empty_past(1))
    t1 = time.perf_counter()
    for _ in range(new):
        nxt = logits[:, -1].argmax(-1)[:, None].astype(np.int64)
        logits, past = runner.step(nxt, past)
    return t1 - t0, time.perf_counter() - t1


def _median(fn, repeats: int) -> tuple[float, float]:
    fn()  # warm-up
    runs = [fn() for _ in range(repeats)]
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=128, help="tokens decoded after the prompt")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="for PyTorch and ONNX Runtime")
    ap.add_argument("--csv", default=str(ROOT / "bench" / "onnx_decode.csv"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    original, tok = load_model(smollm2(), progress=False)
    calib, held = text_batches(fetch_shakespeare(), tok, original.config.vocab_size, TextCut(n_held=4))
    converted = copy.deepcopy(original)
    normlab.convert_norms(converted, "dyisru", calibrate=calib, per="channel", progress=False)
    prompt = held[0][:1, : args.prompt]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, model in (("original", original), ("converted dyisru per channel", converted)):
            with quiet():
                report = normlab.export_onnx(model, Path(tmp) / f"{name.split()[0]}.onnx", check=OnnxCheck(held[0][:2]))
            print(report.summary(), flush=True)
            runner = OnnxLM(report.path, threads=args.threads)
            engines = {
                "onnxruntime": lambda r=runner: _onnx_decode(r, prompt.numpy(), args.new_tokens),
                "pytorch": lambda m=model: _torch_decode(m, prompt, args.new_tokens),
            }
            for engine, fn in engines.items():
                prefill, decode = _median(fn, args.repeats)
                rows.append({
                    "model": name, "engine": engine, "tokens_per_s": round(args.new_tokens / decode, 1),
                    "prefill_ms": round(1000 * prefill, 1), "prompt": args.prompt, "new_tokens": args.new_tokens,
                    "logit_diff": f"{report.max_logit_difference:.2e}", "greedy_equal": report.greedy_equal,
                })  # fmt: skip
                print(f"{name}, {engine}: {rows[-1]['tokens_per_s']} tokens/s", flush=True)
    machine = f"{cpu_name()}, {args.threads} threads, torch {torch.__version__}"
    measured = {"date": datetime.date.today().isoformat(), "machine": machine, "commit": commit()}
    append_csv(args.csv, [{**measured, **r} for r in rows], stamp=stamp())
    cols = ["model", "engine", "tokens_per_s", "prefill_ms", "logit_diff", "greedy_equal"]
    print(format_table(cols, [[r[k] for k in cols] for r in rows]))
    print(f"\n{machine}; rows appended to {args.csv}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
