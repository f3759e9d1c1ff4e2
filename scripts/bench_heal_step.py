"""A heal step of the self recipe on SmolLM2, four ways, in one run: eager float32 (what the heal does), bf16 matmuls
under CPU autocast, ``torch.compile`` of the student, and both.

    python scripts/bench_heal_step.py                  # batch 4 x 128, 5 rounds, the machine's threads
    python scripts/bench_heal_step.py --threads 1

The step is the recipe's (`normlab.conversion.heal.teacher.TeacherCache` with k = 1024, the norms trained, Adam): the
converted model's forward and backward against the original's cached top-k. Every provider takes the same batches,
alternating round by round; the median counts, in seconds per step and tokens per second, beside each
provider's loss on the first batch (a faster step that computes another loss is not the same heal). bf16 on this
CPU needs ``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16`` (AMX is advertised but not enabled in this VM: a bf16 matmul with
it dies with SIGILL); the script sets it before torch loads. Rows go to bench/heal_step.csv. A benchmark, not a
test: nothing is asserted.
"""

from __future__ import annotations

import os

os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")  # before torch: see the docstring

import argparse  # noqa: E402
import contextlib  # noqa: E402
import copy  # noqa: E402
import datetime  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

import normlab  # noqa: E402
from _study import commit, stamp  # noqa: E402
from bench_kernels import cpu_name  # noqa: E402  (scripts/ is on the path when a script runs)
from normlab.conversion.heal.loop import frozen, make_optimizer, trainable  # noqa: E402
from normlab.conversion.heal.teacher import TeacherCache  # noqa: E402
from normlab.kernels.inductor_cache import use_cache_of_this_cpu  # noqa: E402
from normlab.table import append_csv, format_table  # noqa: E402


def _providers(model) -> dict:
    """name -> (the student to call, the autocast context)."""
    bf16 = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    compiled = torch.compile(model)
    return {
        "eager float32": (model, contextlib.nullcontext),
        "bf16 autocast": (model, bf16),
        "torch.compile": (compiled, contextlib.nullcontext),
        "torch.compile + bf16": (compiled, bf16),
    }


def main(argv: list[str] | None = None) -> int:
    use_cache_of_this_cpu()  # Inductor's code cache keyed by this CPU (docs/reliability.md)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=4, help="sequences per step (the heal's default)")
    ap.add_argument("--rounds", type=int, default=5, help="every provider is timed once per round")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--k", type=int, default=1024, help="the teacher cache's top k (the recipe's 1024)")
    ap.add_argument("--csv", default="bench/heal_step.csv")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from normlab.conversion.data.fixtures import smollm2
    from normlab.conversion.data.models import load_model
    from normlab.conversion.data.texts import text_splits
    from normlab.corpus import fetch_shakespeare
    from normlab.kernels import cpu

    cpu.ready(wait=True)
    original, tok = load_model(smollm2(), progress=False)
    model = copy.deepcopy(original)
    normlab.convert_norms(model, "dyisru", per="channel", progress=False)
    splits = text_splits(fetch_shakespeare(), tok, original.config.vocab_size)
    batches = [splits.stream.next(args.batch) for _ in range(args.rounds + 1)]  # the first one warms up
    times, losses = {}, {}
    with frozen(original, model):
        params = trainable(model, "norms")
        for p in params:
            p.requires_grad_(True)
        opt = make_optimizer(params, 1e-9, model)  # a step that changes (almost) nothing: each provider, one model
        cache = TeacherCache(original, args.k)
        for ids in batches:
            cache.targets(ids)
        providers = _providers(model)
        for r, ids in enumerate(batches):
            for name, (student, autocast) in providers.items():
                t = time.perf_counter()
                with autocast():
                    loss = cache.loss(student, ids)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                if r == 0:
                    losses[name] = float(loss)
                else:
                    times.setdefault(name, []).append(time.perf_counter() - t)
    tokens = args.batch * batches[0].shape[1]
    machine = f"{cpu_name()}, {args.threads} threads, torch {torch.__version__}"
    base = statistics.median(times["eager float32"])
    rows, records = [], []
    for name, t in times.items():
        s = statistics.median(t)
        rows.append([name, f"{s:.2f}", f"{tokens / s:.0f}", f"{base / s:.2f}", f"{losses[name]:.4f}"])
        records.append({"date": datetime.date.today().isoformat(), "machine": machine, "commit": commit(),
                        "provider": name, "batch": args.batch, "seq_len": batches[0].shape[1], "k": args.k,
                        "s_per_step": round(s, 3), "tokens_per_s": round(tokens / s, 1),
                        "loss_first_batch": round(losses[name], 5), "rounds": args.rounds})  # fmt: skip
    print(f"one heal step (cached teacher, k = {args.k}), {args.batch} x {batches[0].shape[1]} tokens; {machine}")
    print(format_table(["provider", "s per step", "tokens/s", "speed-up", "loss, first batch"], rows))
    append_csv(args.csv, records, stamp=stamp())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
