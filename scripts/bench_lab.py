"""What the lab's machinery costs: the trainer against a bare training loop, in one run, as ratios.

    python scripts/bench_lab.py --preset cpu --steps 100

1. bare loop: batch, forward, backward, clip, AdamW step; nothing else.
2. normlab train(): the same model, data, optimizer and steps, with its logging, progress bar,
   checkpoints and metric probes at their default intervals (evaluation cut to 1 batch at the end).
3. the metric probe alone: a probed step vs a plain step, amortized over ``metrics_every``.

Both loops are timed end to end, setup included. A row is appended to bench/lab.csv with the
hardware, commit and date. On CPU only the ratios mean something.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import tempfile
import time

import torch

from normlab._table import append_csv
from normlab.lab import GPT, resolve_config, train
from normlab.lab.data import get_batch, load_corpus
from normlab.lab.metrics import Probe, norm_parameters, projection_ranks
from normlab.lab.runs import code_version
from normlab.lab.train import _optimizer, lr_at


def bare_loop(cfg, steps: int) -> float:
    t0 = time.perf_counter()
    corpus = load_corpus(cfg.data or None, cfg.val_fraction)
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model)
    opt = _optimizer(model, cfg, torch.device("cpu"))
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        x, y = get_batch(corpus.train, cfg.batch_size, cfg.model.context, seed=cfg.seed, step=step)
        _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        float(loss)
    return time.perf_counter() - t0


def lab_loop(cfg, steps: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        run = resolve_config(cfg._preset, {**cfg._overrides, "steps": steps, "eval_batches": 1}, out=f"{tmp}/run")
        t0 = time.perf_counter()
        train(run, progress=True)
        return time.perf_counter() - t0


def probe_cost(cfg, reps: int = 5) -> tuple[float, float]:
    """Seconds of a plain step and of a probed step (hooks + results + ranks + norm params)."""
    corpus = load_corpus(cfg.data or None, cfg.val_fraction)
    model = GPT(cfg.model)
    x, y = get_batch(corpus.train, cfg.batch_size, cfg.model.context, seed=0, step=0)

    def plain():
        model(x, y)[1].backward()
        model.zero_grad(set_to_none=True)

    def probed():
        with Probe(model, cfg.jacobian_site) as p:
            model(x, y)[1].backward()
        p.results(), projection_ranks(model), norm_parameters(model)
        model.zero_grad(set_to_none=True)

    times = {}
    for name, fn in (("plain", plain), ("probed", probed)):
        fn()  # warm up
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        times[name] = (time.perf_counter() - t0) / reps
    return times["plain"], times["probed"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="cpu")
    ap.add_argument("--norm", default="rms_norm")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=2, help="alternate bare/lab this many times; best of each")
    ap.add_argument("--csv", default="bench/lab.csv")
    args = ap.parse_args()

    overrides = {"model.norm": args.norm}
    cfg = resolve_config(args.preset, overrides)
    cfg._preset, cfg._overrides = args.preset, overrides
    bare, lab = [], []
    for _ in range(args.repeats):  # alternate, so that drift in machine load hits both
        bare.append(bare_loop(cfg, args.steps))
        lab.append(lab_loop(cfg, args.steps))
    plain, probed = probe_cost(cfg)
    tokens = cfg.batch_size * cfg.model.context * args.steps
    row = {
        "date": datetime.date.today().isoformat(),
        "commit": code_version().get("git_commit", "unknown")[:12],
        "hardware": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
        "preset": args.preset,
        "norm": args.norm,
        "steps": args.steps,
        "bare_tokens_per_s": round(tokens / min(bare)),
        "lab_tokens_per_s": round(tokens / min(lab)),
        "lab_over_bare_time": round(min(lab) / min(bare), 4),
        "probe_step_ratio": round(probed / plain, 3),
        "probe_overhead_amortized": round((probed - plain) / (plain * cfg.metrics_every), 4),
    }
    for k, v in row.items():
        print(f"{k:28s} {v}")
    print(f"appended to {append_csv(args.csv, [row])}")


if __name__ == "__main__":
    main()
