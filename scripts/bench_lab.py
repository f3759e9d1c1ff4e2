"""What the lab's machinery costs: the trainer against a bare training loop, in one run, as ratios.

    python scripts/bench_lab.py --preset cpu --steps 100

1. bare loop: batch, forward, backward, clip, AdamW step; nothing else.
2. normlab train(): the same model, data, optimizer and steps, with its logging, progress bar,
   checkpoints and metric probes at their default intervals (evaluation cut to 1 batch at the end).
3. the metric probe alone: a probed step vs a plain step, amortized over ``metrics_every``.
4. the lab's GPT with LayerNorm at every site against a nanoGPT-style model written here at the same
   shapes (pre-norm, LayerNorm through ``F.layer_norm``, bias-free linears, GELU MLP, tied embeddings,
   causal SDPA, AdamW): training steps timed alternating in one process, median step time of each.

    python scripts/bench_lab.py --preset cpu --steps 100 --nanogpt-steps 30

Both loops are timed end to end, setup included. A row is appended to bench/lab.csv with the
hardware, commit and date. On CPU only the ratios mean something.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import platform
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn

from _study import stamp
from normlab.lab import GPT, resolve_config, train
from normlab.lab.data import get_batch, load_corpus
from normlab.lab.metrics import Probe, norm_parameters, projection_ranks
from normlab.lab.optim import build_optimizer, lr_at
from normlab.table import append_csv
from normlab.version import code_version


def bare_loop(cfg, steps: int) -> float:
    t0 = time.perf_counter()
    corpus = load_corpus(cfg.data or None, cfg.val_fraction)
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model)
    opt = build_optimizer(model, cfg, torch.device("cpu"))
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        x, y = get_batch(corpus.train, (cfg.batch_size, cfg.model.context), seed=cfg.seed, step=step)
        _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        float(loss.detach())
    return time.perf_counter() - t0


def lab_loop(cfg, steps: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        run = dataclasses.replace(cfg, steps=steps, eval_batches=1, out=f"{tmp}/run")
        run.validate()
        t0 = time.perf_counter()
        train(run, progress=True)
        return time.perf_counter() - t0


def probe_cost(cfg, reps: int = 5) -> tuple[float, float]:
    """Seconds of a plain step and of a probed step (hooks + results + ranks + norm params)."""
    corpus = load_corpus(cfg.data or None, cfg.val_fraction)
    model = GPT(cfg.model)
    x, y = get_batch(corpus.train, (cfg.batch_size, cfg.model.context), seed=0, step=0)

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


class _LayerNorm(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(c)), nn.Parameter(torch.zeros(c))

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class _Block(nn.Module):
    def __init__(self, c: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = _LayerNorm(c), _LayerNorm(c)
        self.c_attn, self.c_proj = nn.Linear(c, 3 * c, bias=False), nn.Linear(c, c, bias=False)
        self.c_fc, self.mlp_proj = nn.Linear(c, 4 * c, bias=False), nn.Linear(4 * c, c, bias=False)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.c_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class NanoGPTStyle(nn.Module):
    """A GPT as nanoGPT writes it, at the lab's shapes: the speed reference for the lab's own model."""

    def __init__(self, vocab: int, width: int, depth: int, heads: int, context: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.h = nn.ModuleList(_Block(width, heads) for _ in range(depth))
        self.ln_f = _LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, 0.0, 0.02 / (2 * depth) ** 0.5 if name.endswith("proj.weight") else 0.02)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def versus_nanogpt(preset: str, steps: int, rounds: int = 5) -> dict:
    """Median training-step seconds of the lab GPT (LayerNorm) and the nanoGPT-style model, alternating."""
    import statistics

    cfg = resolve_config(preset, {"model.norm": "layer_norm"})
    m = cfg.model
    corpus = load_corpus(cfg.data or None, cfg.val_fraction)
    torch.manual_seed(0)
    models = {"lab": GPT(m), "nanogpt_style": NanoGPTStyle(m.vocab_size, m.width, m.depth, m.heads, m.context)}
    opts = {k: build_optimizer(v, cfg, torch.device("cpu")) for k, v in models.items()}
    n_params = {k: sum(p.numel() for p in v.parameters()) for k, v in models.items()}
    assert n_params["lab"] == n_params["nanogpt_style"], n_params  # the same model, written two ways
    times = {k: [] for k in models}
    step = 0
    for _ in range(rounds):
        for name, model in models.items():
            for _ in range(max(1, steps // rounds)):
                x, y = get_batch(corpus.train, (cfg.batch_size, m.context), seed=0, step=step)
                step += 1
                t0 = time.perf_counter()
                _, loss = model(x, y)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
                opts[name].step()
                opts[name].zero_grad(set_to_none=True)
                float(loss.detach())
                times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v[1:]) for k, v in times.items()}
    return {
        "lab_step_ms": round(1e3 * med["lab"], 2),
        "nanogpt_step_ms": round(1e3 * med["nanogpt_style"], 2),
        "lab_over_nanogpt": round(med["lab"] / med["nanogpt_style"], 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="cpu")
    ap.add_argument("--norm", default="rms_norm")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=2, help="alternate bare/lab this many times; best of each")
    ap.add_argument("--nanogpt-steps", type=int, default=30, help="steps of each model in the nanoGPT comparison")
    ap.add_argument("--csv", default="bench/lab.csv")
    args = ap.parse_args()

    overrides = {"model.norm": args.norm}
    cfg = resolve_config(args.preset, overrides)
    bare, lab = [], []
    for _ in range(args.repeats):  # alternate, so that drift in machine load hits both
        bare.append(bare_loop(cfg, args.steps))
        lab.append(lab_loop(cfg, args.steps))
    plain, probed = probe_cost(cfg)
    nano = versus_nanogpt(args.preset, args.nanogpt_steps)
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
        **nano,
    }
    for k, v in row.items():
        print(f"{k:28s} {v}")
    print(f"appended to {append_csv(args.csv, [row], stamp=stamp())}")


if __name__ == "__main__":
    main()
