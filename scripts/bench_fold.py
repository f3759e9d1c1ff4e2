"""Inference speed on the CPU: SmolLM2-135M as shipped (RMSNorm), converted (every site element-wise), and folded.

    python scripts/bench_fold.py                        # DyT and DyISRU, prompt 128 tokens, 32 decoded
    python scripts/bench_fold.py --to dyt --rounds 5
    python scripts/bench_fold.py --to dyisru --converted OUT   # and a conversion saved by normlab convert --out OUT

Three models in one process: the original, a copy with every norm converted to the target (default init: speed
does not depend on the fitted values), and a copy of that folded with normlab.fold (gamma in the linear layers,
each site a bare f). Each round times every model in turn (alternating, so that the machine's drift hits all
alike): prompt processing (one forward of a batch-1 prompt, tokens/s) and decoding (greedy, KV cache, tokens/s
of the new tokens). The median over rounds is reported, with the hardware, and rows go to bench/fold.csv; so is
the median of each round's decode speed over the original's in the same round (paired, with its range): at decode
the norms are about 1% of a step, so only pairing and many rounds tell a model's difference from the machine's.

The fold is checked on a probe in the model's float32, and an uncalibrated conversion is so ill-conditioned
that float32 rounding moves its logits by percents (tests/conversion/test_real_model.py checks the fold in
float64), so this script loosens the check and prints the probe's difference instead.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import statistics
import time
from pathlib import Path

import torch

import normlab
from bench_kernels import cpu_name  # scripts/ is on the path when a script runs
from normlab.conversion.hf import load_model, smollm2
from normlab.conversion.saving import load_converted
from normlab.lab.runs import code_version
from normlab.table import append_csv, format_table


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--to", nargs="+", default=["dyt", "dyisru"], help="conversion targets")
    ap.add_argument("--prompt", type=int, default=128, help="prompt length in tokens")
    ap.add_argument("--new", type=int, default=32, help="tokens decoded per round")
    ap.add_argument("--rounds", type=int, default=5, help="rounds; every model is timed once per round")
    ap.add_argument("--csv", default="bench/fold.csv", help="where rows are appended")
    ap.add_argument(
        "--converted",
        nargs="+",
        default=[],
        metavar="DIR",
        help="also time these saved conversions (normlab convert --out DIR), converted and folded: fitted values, "
        "not the default init",
    )
    args = ap.parse_args()

    original, _ = load_model(smollm2())
    models = {"original (RMSNorm)": original}
    differences = {}
    for to in args.to:
        conv = copy.deepcopy(original)
        normlab.convert_norms(conv, to, progress=False)
        folded = copy.deepcopy(conv)
        differences[to] = normlab.fold(folded, tolerance=float("inf")).max_difference
        models[f"{to}, converted"] = conv
        models[f"{to}, folded"] = folded
    for folder in args.converted:
        conv, record = load_converted(folder)
        folded = copy.deepcopy(conv.float().eval())
        name = f"{record.target} from {Path(folder).name}"
        differences[name] = normlab.fold(folded, tolerance=float("inf")).max_difference
        models[f"{name}, converted"] = conv
        models[f"{name}, folded"] = folded
    prompt = torch.randint(0, original.config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    times = {name: {"prompt": [], "decode": []} for name in models}
    gen = dict(max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        for m in models.values():  # warm-up
            m(prompt[:, :8])
        for _ in range(args.rounds):
            for name, m in models.items():
                times[name]["prompt"].append(args.prompt / timed(lambda m=m: m(prompt)))
                times[name]["decode"].append(args.new / timed(lambda m=m: m.generate(prompt, **gen)))
    machine = f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    commit = code_version().get("git_commit", "unknown")[:12]
    rows, records = [], []
    base = {k: statistics.median(v) for k, v in times["original (RMSNorm)"].items()}
    for name, t in times.items():
        p, d = statistics.median(t["prompt"]), statistics.median(t["decode"])
        # paired: each round's decode speed over the original's in the same round (a drift of the machine cancels)
        paired = [a / b for a, b in zip(t["decode"], times["original (RMSNorm)"]["decode"], strict=True)]
        spread = f"{statistics.median(paired):.3f} [{min(paired):.3f}, {max(paired):.3f}]"
        rows.append([name, f"{p:,.0f}", f"{p / base['prompt']:.3f}", f"{d:,.1f}", f"{d / base['decode']:.3f}", spread])
        records.append({"model": name, "prompt_tok_s": round(p, 1), "decode_tok_s": round(d, 2),
                        "decode_vs_original_paired": round(statistics.median(paired), 4),
                        "prompt_tokens": args.prompt, "new_tokens": args.new, "rounds": args.rounds,
                        "commit": commit, "date": datetime.date.today().isoformat(),
                        "machine": machine})  # fmt: skip
    heads = ["model", "prompt tok/s", "vs original", "decode tok/s", "vs original", "decode / original, per round"]
    print(format_table(heads, rows, markdown=True))
    print(f"\nmedian of {args.rounds} alternating rounds; prompt {args.prompt} tokens, {args.new} decoded; {machine}")
    print("probe difference of each fold (float32, uncalibrated):", {k: f"{v:.3g}" for k, v in differences.items()})
    append_csv(args.csv, records)


if __name__ == "__main__":
    main()
