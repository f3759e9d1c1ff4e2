"""Does a swapped Hugging Face Llama learn? The model as transformers initialises it (std 0.02), its RMSNorms swapped
through `normlab.replace_norms` with each recipe, trained with AdamW on the bytes of Shakespeare's plays against the
unswapped model, same seed, same batches.

    python scripts/bench_swap_learns.py                          # 2 blocks x 128, AdamW 1e-3, 200 steps, 2 seeds
    python scripts/bench_swap_learns.py --steps 50 --seeds 0 --variants rms_norm auto --csv /tmp/x.csv

Each variant's loss at every step goes to the CSV (default bench/swap_learns.csv) with the hardware and commit; the
summary prints the mean of the last 10 steps at step 50 and at the end, minus RMSNorm's. ``--plot`` draws the curves
(docs/figures/swap_learns.png).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import normlab  # noqa: E402
from _study import stamp  # noqa: E402  (scripts/ is on the path when a script runs)
from normlab.corpus import fetch_shakespeare  # noqa: E402
from normlab.table import append_csv  # noqa: E402

#: variant -> replace_norms' init (None: the model as it ships, RMSNorm)
VARIANTS = {
    "rms_norm": None,
    "auto": "auto",
    "default": "default",
    "dyt_paper": "dyt_paper",
    "dyt_paper+match_rms": ["dyt_paper", "match_rms"],
}


def llama(seed: int, width: int, layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=256, hidden_size=width, intermediate_size=int(width * 2.6875),
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=128)  # fmt: skip
    return LlamaForCausalLM(config)


def batches(steps: int, seed: int, batch: int = 16, seq: int = 64) -> list[torch.Tensor]:
    data = torch.tensor(list(Path(fetch_shakespeare()).read_bytes()[:500_000]))
    g = torch.Generator().manual_seed(1000 + seed)
    starts = torch.randint(0, len(data) - seq, (steps, batch), generator=g)
    return [torch.stack([data[s : s + seq] for s in row]) for row in starts]


def train(variant: str, seed: int, steps: int, lr: float, width: int = 128, layers: int = 2) -> list[float]:
    """The losses of ``steps`` AdamW steps of the variant's model; the swap happens before the optimizer is built."""
    model = llama(seed, width, layers)
    data = batches(steps, seed)
    init = VARIANTS[variant]
    if init is not None:  # match_rms measures on the first training batch, as a user would pass one
        sample = {"sample": data[0]} if "match_rms" in init else {}
        normlab.replace_norms(model, "dyt", init=init, **sample)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for ids in data:
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for variant in VARIANTS:
        curves = [r for r in rows if r["variant"] == variant]
        if not curves:
            continue
        steps = sorted({int(r["step"]) for r in curves})
        mean = [sum(float(r["loss"]) for r in curves if int(r["step"]) == s) / len({r["seed"] for r in curves})
                for s in steps]  # fmt: skip
        ax.plot(steps, mean, label=variant, lw=1.4)
    ax.set(xlabel="step", ylabel="training loss (nats, mean over seeds)", ylim=(2.0, 9.0))
    ax.set_title("HF Llama, 2 x 128, std-0.02 init, AdamW 1e-3: RMSNorm and DyT by recipe", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--csv", default=str(ROOT / "bench" / "swap_learns.csv"))
    ap.add_argument("--plot", help="draw the curves of --csv into this PNG")
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    rows, ends = [], {}
    for seed in args.seeds:
        for variant in args.variants:
            losses = train(variant, seed, args.steps, args.lr)
            rows += [{"variant": variant, "seed": seed, "lr": args.lr, "step": i + 1, "loss": round(v, 5)}
                     for i, v in enumerate(losses)]  # fmt: skip
            ends[variant, seed] = (sum(losses[40:50]) / 10, sum(losses[-10:]) / 10)
            print(f"seed {seed} {variant:20s} step 50: {ends[variant, seed][0]:.3f}  step {args.steps}: "
                  f"{ends[variant, seed][1]:.3f}", flush=True)  # fmt: skip
    if "rms_norm" in args.variants:
        for (variant, seed), (at50, end) in ends.items():
            base = ends["rms_norm", seed]
            print(f"seed {seed} {variant:20s} minus RMSNorm: {at50 - base[0]:+.3f} at 50, {end - base[1]:+.3f} at end")
    print(f"appended {len(rows)} rows to {append_csv(args.csv, rows, stamp=stamp())}")
    if args.plot:
        import csv

        plot(list(csv.DictReader(open(args.csv))), Path(args.plot))


if __name__ == "__main__":
    main()
