"""Inference speed on the CPU: SmolLM2-135M as shipped (RMSNorm), converted (every site element-wise), and folded.

    python scripts/bench_fold.py                        # DyT and DyISRU, prompt 128 tokens, 32 decoded
    python scripts/bench_fold.py --to dyt --rounds 5
    python scripts/bench_fold.py --to dyisru --converted OUT   # and a conversion saved by normlab convert --out OUT

Three models in one process: the original, a copy with every norm converted to the target (default init: speed
does not depend on the fitted values), and a copy of that folded with normlab.fold (gamma in the linear layers,
each site a bare f). Each round times every model in turn (alternating, so that the machine's drift hits all
alike; the order rotates from round to round): prompt processing (one forward of a batch-1 prompt, tokens/s) and
decoding (greedy, KV cache, tokens/s of the new tokens). The median over rounds is reported, with the hardware, and
rows go to bench/fold.csv; so is the median of each round's decode speed over the original's in the same round
(paired, with its range).

At decode the norms are about 1% of a step, and on a shared VM a round's ratio moves by 10-20%: rounds cannot tell a
1% difference. So the script also times single decode steps with the models taking turns step by step (each model
holds its own KV cache; the order rotates every step; every model restarts from the prompt after --new steps, so
step s has the same context length for all): the geometric mean over steps of the original's step time over the
model's, with a 95% interval from a bootstrap over blocks of --new consecutive steps (neighbouring steps share the
machine's moment; blocks keep that dependence). A model whose interval lies above 1 decodes faster than the
original on this machine; one whose interval holds 1 is level within what the run can resolve. The interval does not
hold everything that moves between two models in one process: a copy of the original, timed as one more model (the
control, on unless --no-control), has read 0.999 [0.993, 1.006] and 1.008 [1.006, 1.010] in two runs, so a
difference under about 1% is not resolved even when its interval excludes 1. Every model timed, the original too, is
a deep copy of the model as loaded: against the loaded model itself a copy read 1.02 in two runs.

The fold is checked on a probe in the model's float32, and an uncalibrated conversion is so ill-conditioned
that float32 rounding moves its logits by percents (tests/conversion/test_real_model.py checks the fold in
float64), so this script loosens the check and prints the probe's difference instead.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import inspect
import statistics
import time
from pathlib import Path

import numpy as np
import torch

import normlab
from _study import stamp
from bench_kernels import cpu_name  # scripts/ is on the path when a script runs
from normlab.conversion.data.fixtures import smollm2
from normlab.conversion.data.models import load_model
from normlab.conversion.export.saving import load_converted
from normlab.table import append_csv, format_table
from normlab.version import code_version


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def decode_steps(models: dict, prompt: torch.Tensor, steps: int, horizon: int) -> dict[str, list[float]]:
    """Seconds per decode step of each model, the models taking turns step by step (the order rotating). Each
    model keeps its own KV cache and greedy token; after ``horizon`` steps all restart from the prompt (untimed)."""
    names, state = list(models), {}
    # transformers 5 names the KV cache `cache`; 4.x `past_key_values`
    key = "cache" if "cache" in inspect.signature(models[names[0]].forward).parameters else "past_key_values"

    def prefill(name: str) -> None:
        out = models[name](prompt, use_cache=True)
        state[name] = (out[key], out.logits[:, -1:].argmax(-1))

    times = {name: [] for name in names}
    for s in range(steps):
        if s % horizon == 0:
            for name in names:
                prefill(name)
        k = s % len(names)
        for name in names[k:] + names[:k]:
            cache, token = state[name]
            t = time.perf_counter()
            out = models[name](token, use_cache=True, **{key: cache})
            times[name].append(time.perf_counter() - t)
            state[name] = (out[key], out.logits[:, -1:].argmax(-1))
    return times


def paired_speed(
    model: list[float], original: list[float], block: int, draws: int = 2000
) -> tuple[float, float, float]:
    """Geometric mean over steps of original / model step time (above 1: the model is faster), and a 95% interval
    from a bootstrap over blocks of ``block`` consecutive steps."""
    logs = np.log(np.asarray(original) / np.asarray(model))
    blocks = logs[: len(logs) // block * block].reshape(-1, block).mean(axis=1)
    rng = np.random.default_rng(0)
    means = blocks[rng.integers(0, len(blocks), (draws, len(blocks)))].mean(axis=1)
    lo, hi = np.quantile(means, [0.025, 0.975])
    return float(np.exp(logs.mean())), float(np.exp(lo)), float(np.exp(hi))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--to", nargs="+", default=["dyt", "dyisru"], help="conversion targets")
    ap.add_argument("--prompt", type=int, default=128, help="prompt length in tokens")
    ap.add_argument("--new", type=int, default=32, help="tokens decoded per round")
    ap.add_argument("--rounds", type=int, default=5, help="rounds; every model is timed once per round")
    ap.add_argument("--steps", type=int, default=320, help="decode steps timed one by one, models taking turns")
    ap.add_argument("--no-control", action="store_true", help="leave out the control, a copy of the original")
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

    loaded, _ = load_model(smollm2())
    # every model timed is a deep copy of the loaded one, the original too: a copy has read up to 2% faster than the
    # model as loaded (its tensors laid out anew), which would otherwise count against the converted models
    original = copy.deepcopy(loaded)
    models = {"original (RMSNorm)": original}
    if not args.no_control:  # the same model again: how far two identical models read apart in this run
        models["original, a copy (control)"] = copy.deepcopy(loaded)
    differences = {}
    for to in args.to:
        conv = copy.deepcopy(loaded)
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
    del loaded
    prompt = torch.randint(0, original.config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    times = {name: {"prompt": [], "decode": []} for name in models}
    gen = dict(max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        for m in models.values():  # warm-up
            m(prompt[:, :8])
        names = list(models)
        for r in range(args.rounds):  # the order rotates: in a fixed order the first model read faster than the rest
            for name in names[r % len(names) :] + names[: r % len(names)]:
                m = models[name]
                times[name]["prompt"].append(args.prompt / timed(lambda m=m: m(prompt)))
                times[name]["decode"].append(args.new / timed(lambda m=m: m.generate(prompt, **gen)))
        steps = decode_steps(models, prompt, args.steps, args.new)
    machine = f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    commit = code_version().get("git_commit", "unknown")[:12]
    rows, records = [], []
    base = {k: statistics.median(v) for k, v in times["original (RMSNorm)"].items()}
    for name, t in times.items():
        p, d = statistics.median(t["prompt"]), statistics.median(t["decode"])
        # paired: each round's decode speed over the original's in the same round (a drift of the machine cancels)
        paired = [a / b for a, b in zip(t["decode"], times["original (RMSNorm)"]["decode"], strict=True)]
        spread = f"{statistics.median(paired):.3f} [{min(paired):.3f}, {max(paired):.3f}]"
        speed, lo, hi = paired_speed(steps[name], steps["original (RMSNorm)"], args.new)
        step = f"{speed:.4f} [{lo:.4f}, {hi:.4f}]"
        rows.append([name, f"{p:,.0f}", f"{p / base['prompt']:.3f}", f"{d:,.1f}", f"{d / base['decode']:.3f}", spread,
                     f"{1e3 * statistics.median(steps[name]):.1f}", step])  # fmt: skip
        records.append({"model": name, "prompt_tok_s": round(p, 1), "decode_tok_s": round(d, 2),
                        "decode_vs_original_paired": round(statistics.median(paired), 4),
                        "step_ms": round(1e3 * statistics.median(steps[name]), 2),
                        "step_speed_vs_original": round(speed, 4), "step_speed_ci95": f"{lo:.4f}-{hi:.4f}",
                        "steps": args.steps,
                        "prompt_tokens": args.prompt, "new_tokens": args.new, "rounds": args.rounds,
                        "commit": commit, "date": datetime.date.today().isoformat(),
                        "machine": machine})  # fmt: skip
    heads = ["model", "prompt tok/s", "vs original", "decode tok/s", "vs original", "decode / original, per round",
             "step ms", "step speed / original [95%]"]  # fmt: skip
    print(format_table(heads, rows, markdown=True))
    print(f"\nmedian of {args.rounds} alternating rounds; prompt {args.prompt} tokens, {args.new} decoded; {machine}")
    print(
        f"step: {args.steps} single decode steps per model, taking turns; geometric mean of original / model step "
        f"time, 95% block bootstrap (blocks of {args.new} steps)"
    )
    print("probe difference of each fold (float32, uncalibrated):", {k: f"{v:.3g}" for k, v in differences.items()})
    append_csv(args.csv, records, stamp=stamp())


if __name__ == "__main__":
    main()
