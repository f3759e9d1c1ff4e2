"""A distillation step with the live teacher against one with the teacher cache, on SmolLM2, in one run.

    python scripts/bench_teacher_cache.py                 # batch 4 x 128, k = 64 128 512, 5 rounds
    python scripts/bench_teacher_cache.py --k 128 --rounds 3

What a heal step costs (`normlab.conversion.heal.distill.distill`): the original's forward, the converted model's
forward
and backward (norms trained), Adam. With `heal.teacher_top_k` a sequence seen before skips the original. This
times, alternating round by round on the same batches, a step with the live teacher (the full KL) and a step
whose teacher is already cached (the top-k KL), for each k; the median is reported in seconds per step and as a
ratio to the live step, with the hardware. The batches are Shakespeare in SmolLM2's tokenizer; the model is
converted to DyISRU at its default init (speed does not depend on the fitted values). It also prints the mean
probability the original leaves outside its top k on those batches: the tail the top-k KL merges into one
outcome. Rows go to bench/teacher_cache.csv.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import statistics
import time

import torch

import normlab
from _study import stamp
from bench_kernels import cpu_name  # scripts/ is on the path when a script runs
from normlab.conversion.heal.distill import distill_loss
from normlab.conversion.heal.loop import frozen, make_optimizer, trainable
from normlab.conversion.heal.teacher import TeacherCache, teacher_top_k
from normlab.table import append_csv, format_table
from normlab.version import code_version


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, nargs="+", default=[64, 128, 512], help="top-k values to time")
    ap.add_argument("--batch", type=int, default=4, help="sequences per step (the heal's default)")
    ap.add_argument("--rounds", type=int, default=5, help="every provider is timed once per round")
    ap.add_argument("--csv", default="bench/teacher_cache.csv")
    args = ap.parse_args()
    from normlab.conversion.data.fixtures import smollm2
    from normlab.conversion.data.models import load_model
    from normlab.conversion.data.texts import text_splits
    from normlab.corpus import fetch_shakespeare
    from normlab.kernels import cpu

    cpu.ready(wait=True)
    original, tok = load_model(smollm2())
    model = copy.deepcopy(original)
    normlab.convert_norms(model, "dyisru")
    splits = text_splits(fetch_shakespeare(), tok, original.config.vocab_size)
    batches = [splits.stream.next(args.batch) for _ in range(args.rounds)]
    with frozen(original, model):
        params = trainable(model, "norms")
        for p in params:
            p.requires_grad_(True)
        opt = make_optimizer(params, 1e-9, model)  # a step that changes (almost) nothing: each provider sees one model
        caches = {k: TeacherCache(original, k) for k in args.k}
        for ids in batches:  # warm: every batch cached for every k
            for c in caches.values():
                c.targets(ids)
        tails = {k: float(1 - teacher_top_k(original, batches[0], k)[0].exp().sum(-1).mean()) for k in args.k}
        steps = {"live teacher (full KL)": lambda ids: distill_loss(original, model, ids)}
        steps |= {f"cached, k = {k}": (lambda ids, c=c: c.loss(model, ids)) for k, c in caches.items()}
        times = {name: [] for name in steps}
        for ids in batches:
            for name, loss_of in steps.items():
                t = time.perf_counter()
                loss = loss_of(ids)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                times[name].append(time.perf_counter() - t)
    base = statistics.median(times["live teacher (full KL)"])
    machine = f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    commit = code_version().get("git_commit", "unknown")[:12]
    rows, records = [], []
    for name, t in times.items():
        s = statistics.median(t)
        k = int(name.split("= ")[1]) if "=" in name else None
        tail = f"{tails[k]:.3f}" if k else ""
        rows.append([name, f"{s:.2f}", f"{s / base:.2f}", tail])
        records.append({"provider": name, "batch": args.batch, "seq_len": batches[0].shape[1],
                        "s_per_step": round(s, 3), "vs_live": round(s / base, 3), "tail_mass": tail,
                        "rounds": args.rounds, "commit": commit, "date": datetime.date.today().isoformat(),
                        "machine": machine})  # fmt: skip
    print(f"one distillation step, {args.batch} x {batches[0].shape[1]} tokens, SmolLM2 to DyISRU; {machine}")
    print(format_table(["provider", "s per step", "vs live", "teacher mass outside the top k"], rows, markdown=True))
    append_csv(args.csv, records, stamp=stamp())


if __name__ == "__main__":
    main()
