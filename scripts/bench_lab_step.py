"""Can the lab's tiny-model training step go faster? Each candidate against the lab's own step, in one run.

    python scripts/bench_lab_step.py                       # the `small` preset (reproduce's runs), rms_norm and dyt
    python scripts/bench_lab_step.py --norm dyt --rounds 8

The step is the trainer's: a batch, forward, backward, clipping, an optimizer step. One thread, as each of the
two sweep workers of `normlab reproduce` runs on a 2-core machine. The candidates (issue: a faster lab):

- ``eager``: the lab as it is (AdamW as `normlab.lab.optim.build_optimizer` makes it);
- ``adamw_fused``: the same with `torch.optim.AdamW(fused=True)` (a CPU kernel since torch 2.4);
- ``sdpa_math``: attention through PyTorch's math backend instead of its CPU flash kernel;
- ``compile``: `torch.compile` of the model (its compile time is reported apart, as setup);
- ``vmapN``: N models of the same shape trained as one (`torch.func.stack_module_state` + `vmap`), as the runs
  of one experiment that differ only in seed would be; its time is per model;
- ``threads2``: one model at 2 threads (one sweep worker that uses both cores);
- ``two_workers``: what `normlab reproduce` does today: two processes at one thread each, stepping at the same
  time (``--worker-steps`` each, after the other candidates); its time is a worker's median step halved, the
  time per model when two train at once.

``vs_eager`` is the time per model-step against ``eager`` alone on an idle machine; between ``threads2`` and
``two_workers`` the lower one is the better use of two cores.

Every candidate trains its own copy of the same model (the same init, the same batches, model 0 of a ``vmap``);
``loss_diff`` is its last loss against eager's, so that a faster path that changes the numbers shows it. The
candidates take turns, a few steps each, for ``--rounds`` rounds, so that drift in the machine's load hits all of
them; the median step time of each is reported. Rows go to bench/lab_step.csv with the commit, date and machine.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import statistics
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from _study import ROOT, commit, machine, stamp
from normlab.kernels.inductor_cache import use_cache_of_this_cpu
from normlab.lab import GPT, resolve_config
from normlab.lab.data import get_batch, load_corpus
from normlab.lab.optim import build_optimizer
from normlab.table import append_csv

CANDIDATES = ["eager", "adamw_fused", "sdpa_math", "compile", "vmap2", "vmap4", "threads2"]


class Candidate:
    """One way of running the step: its models, its optimizer, and how one step runs."""

    def __init__(self, name: str, cfg, n_models: int = 1) -> None:
        self.name, self.cfg, self.n = name, cfg, n_models
        self.times: list[float] = []
        t0 = time.perf_counter()
        models = []
        for seed in range(n_models):
            torch.manual_seed(seed)
            models.append(GPT(cfg.model))
        self.model = models[0]
        if name.startswith("vmap"):
            self.params, self.buffers = torch.func.stack_module_state(models)
            self.opt = torch.optim.AdamW(list(self.params.values()), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))
            base = copy.deepcopy(self.model)
            self.loss_fn = torch.vmap(lambda p, b, x, y: torch.func.functional_call(base, (p, b), (x, y))[1])
        elif name == "adamw_fused":
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=True)
        else:
            self.opt = build_optimizer(self.model, cfg, torch.device("cpu"))
        self.fwd = torch.compile(self.model) if name == "compile" else self.model
        self.setup_s = time.perf_counter() - t0

    def step(self, corpus, step: int) -> float:
        cfg, threads = self.cfg, torch.get_num_threads()
        batches = [
            get_batch(corpus.train, (cfg.batch_size, cfg.model.context), seed=s, step=step) for s in range(self.n)
        ]
        torch.set_num_threads(2 if self.name == "threads2" else 1)
        t0 = time.perf_counter()
        if self.name.startswith("vmap"):
            xs, ys = (torch.stack(z) for z in zip(*batches, strict=True))
            losses = self.loss_fn(self.params, self.buffers, xs, ys)
            losses.sum().backward()
            loss = losses[0]
        else:
            with sdpa_kernel(SDPBackend.MATH) if self.name == "sdpa_math" else contextlib.nullcontext():
                _, loss = self.fwd(*batches[0])
                loss.backward()
        if not self.name.startswith("vmap"):  # the vmapped models would need one clip each; they go unclipped
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        value = float(loss.detach())
        self.times.append((time.perf_counter() - t0) / self.n)
        torch.set_num_threads(threads)
        return value


def measure(norm: str, names: list[str], rounds: int, turn: int, preset: str, workers: int) -> list[dict]:
    cfg = resolve_config(preset, {"model.norm": norm})
    corpus = load_corpus(cfg.data or None, cfg.val_fraction)
    torch.set_num_threads(1)
    GPT(cfg.model)  # the first build imports what it needs: not any candidate's setup
    cands = [Candidate(n, cfg, int(n[4:]) if n.startswith("vmap") else 1) for n in names]
    last = {}
    for c in cands:  # warm up (compile compiles here; its time goes to setup)
        t0 = time.perf_counter()
        last[c.name] = c.step(corpus, 0)
        c.setup_s += time.perf_counter() - t0
        c.times.clear()
    step = 1
    for _ in range(rounds):
        for c in cands:
            for k in range(turn):
                last[c.name] = c.step(corpus, step + k)
        step += turn  # every candidate sees the same batches in the same order
    eager = statistics.median(next(c for c in cands if c.name == "eager").times)
    rows = []
    for c in cands:
        med = statistics.median(c.times)
        rows.append({"date": datetime.date.today().isoformat(), "commit": commit(), "machine": machine(),
                     "preset": preset, "norm": norm, "candidate": c.name, "steps": step,
                     "ms_per_model_step": round(1e3 * med, 2), "vs_eager": round(med / eager, 3),
                     "setup_s": round(c.setup_s, 2), "last_loss": round(last[c.name], 5),
                     "loss_diff": round(last[c.name] - last["eager"], 5)})  # fmt: skip
    if workers:
        med = two_workers(norm, preset, workers) / 2
        rows.append({**rows[0], "candidate": "two_workers", "steps": workers,
                     "ms_per_model_step": round(1e3 * med, 2), "vs_eager": round(med / eager, 3), "setup_s": None,
                     "last_loss": None, "loss_diff": None})  # fmt: skip
    return rows


def _worker(norm: str, preset: str, steps: int, barrier) -> float:
    """One sweep worker's eager steps at one thread, started with the other worker's; its median step seconds."""
    cfg = resolve_config(preset, {"model.norm": norm})
    corpus = load_corpus(cfg.data or None, cfg.val_fraction)
    torch.set_num_threads(1)
    c = Candidate("eager", cfg)
    c.step(corpus, 0)
    c.times.clear()
    barrier.wait()
    for step in range(1, steps + 1):
        c.step(corpus, step)
    return statistics.median(c.times)


def two_workers(norm: str, preset: str, steps: int) -> float:
    """The mean of two concurrent workers' median step seconds (spawned, as `normlab.sweep` spawns them)."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager, ProcessPoolExecutor(2, mp_context=ctx) as pool:
        barrier = manager.Barrier(2)
        futures = [pool.submit(_worker, norm, preset, steps, barrier) for _ in range(2)]
        return statistics.mean(f.result() for f in futures)


def main() -> None:
    use_cache_of_this_cpu()  # Inductor's code cache keyed by this CPU (docs/reliability.md)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--norm", nargs="+", default=["rms_norm", "dyt"])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--candidates", nargs="+", default=CANDIDATES, choices=CANDIDATES)
    ap.add_argument("--worker-steps", type=int, default=60, help="steps of each of the two workers (0: skip them)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps-per-turn", type=int, default=5)
    ap.add_argument("--csv", default=str(ROOT / "bench" / "lab_step.csv"))
    args = ap.parse_args()
    if "eager" not in args.candidates:
        ap.error("--candidates must include eager, the reference every other is compared with")
    for norm in args.norm:
        rows = measure(norm, args.candidates, args.rounds, args.steps_per_turn, args.preset, args.worker_steps)
        for r in rows:
            print(f"{norm:9s} {r['candidate']:12s} {r['ms_per_model_step']:7.2f} ms/model-step  "
                  f"x{r['vs_eager']:.3f} of eager  setup {r['setup_s'] or 0:6.2f} s  "
                  f"loss diff {r['loss_diff'] or 0:+.5f}",
                  flush=True)  # fmt: skip
        append_csv(args.csv, rows, stamp=stamp())
    print(f"appended to {args.csv}")


if __name__ == "__main__":
    main()
