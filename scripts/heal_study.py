"""Which heal, at equal CPU minutes: objective (distill | blocks) x what is trained (norms | lora | all).

    python scripts/heal_study.py --minutes 4                   # the six combinations, 4 min each, DyISRU
    python scripts/heal_study.py --minutes 4 --only distill:lora blocks:norms
    python scripts/heal_study.py --replot                      # redraw docs/figures/heal_curves.png

SmolLM2-135M-Instruct, every site converted to DyISRU and calibrated exactly as ``normlab convert`` does (32
sequences of 128 tokens from the start of the Shakespeare corpus), then healed from the stream of the text
(normlab.conversion.hf.text_splits: every sequence but the 32 held out at the end and the 8 of the validation
split) for the same wall time on the same machine, one combination after another, nothing else running. Each row
of bench/heal_study.csv: the held-out cross-entropy of the kept state (the 32 held-out sequences), the
tokens, the minutes, the stream sequences drawn, and the validation curve (JSON). The calibrated model is cached
under $NORMLAB_CACHE/heal_study/ so that each combination starts from the same state.
"""

from __future__ import annotations

import argparse
import copy
import csv
import datetime
import json
import time
from pathlib import Path

from _study import ROOT, commit, machine, save

CSV = ROOT / "bench" / "heal_study.csv"
FIG = ROOT / "docs" / "figures" / "heal_curves.png"
FIELDS = ["commit", "date", "machine", "to", "objective", "train", "minutes", "tokens", "sequences", "seconds",
          "ce_original", "ce_calibrated", "ce_healed", "val_start", "val_best", "curve"]  # fmt: skip


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.2))
    for r in rows:
        curve = json.loads(r["curve"])
        label = f"{r['objective']}, {r['train']} ({float(r['minutes']):g} min): held-out {float(r['ce_healed']):.2f}"
        ax.plot([max(p["tokens"], 1000) for p in curve], [p["val_ce"] for p in curve], marker=".", label=label)
        tl = [(p["tokens"], p["train_loss"]) for p in curve if p["train_loss"] == p["train_loss"]]
        if tl:
            bx.plot(*zip(*tl), marker=".", label=f"{r['objective']}, {r['train']}")
    if rows:
        ax.axhline(float(rows[-1]["ce_original"]), color="black", lw=0.8, ls="--", label="original")
    threads = sorted({r["machine"].split(", ")[1] for r in rows if ", " in r["machine"]})
    ax.set_xscale("log")
    ax.set_xlabel(
        f"tokens trained (the start drawn at 1,000; {float(rows[0]['minutes']):g} min each, {' / '.join(threads)})"
        if rows
        else "tokens trained"
    )
    ax.set_ylabel("validation CE (nats/token)")
    ax.set_title("SmolLM2-135M, every norm DyISRU: healing from the stream")
    ax.legend(fontsize=7)
    bx.set_xlabel("tokens trained")
    bx.set_xscale("log")
    bx.set_ylabel("KL (distill); block rel. error (blocks)")
    bx.set_yscale("log")
    bx.set_title("train loss (the block error rises with depth)")
    bx.legend(fontsize=7)
    save(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=4.0)
    ap.add_argument("--to", default="dyisru")
    ap.add_argument("--only", nargs="*", help="objective:train pairs (default: all six)")
    ap.add_argument("--replot", action="store_true")
    ap.add_argument("--last", type=int, default=6, help="with --replot: the newest N rows (default 6: one study)")
    args = ap.parse_args()
    if args.replot:
        plot(list(csv.DictReader(CSV.open()))[-args.last :], FIG)
        return

    import torch

    import normlab
    from normlab.conversion.fidelity import cross_entropy
    from normlab.conversion.heal import OBJECTIVES, TRAINS, heal
    from normlab.conversion.hf import load_model, smollm2, text_splits
    from normlab.corpus import cache_dir, fetch_shakespeare

    combos = [tuple(c.split(":")) for c in args.only] if args.only else [(o, t) for o in OBJECTIVES for t in TRAINS]
    torch.manual_seed(0)
    original, tok = load_model(smollm2())
    splits = text_splits(fetch_shakespeare(), tok, original.config.vocab_size, 128, 32, 32)
    print(
        f"stream: {len(splits.stream):,} sequences of 128 tokens; validation {sum(len(b) for b in splits.val)}; "
        f"held out {sum(len(b) for b in splits.held)}",
        flush=True,
    )
    saved = cache_dir() / "heal_study" / f"{args.to}_calibrated.pt"
    converted = copy.deepcopy(original)
    if saved.exists():
        state = torch.load(saved, weights_only=False)
        record = normlab.ConversionRecord.from_dict(state["record"])
        from normlab.conversion.saving import apply_record

        apply_record(converted, record)
        converted.load_state_dict(state["model"])
    else:
        record = normlab.convert_norms(converted, args.to, calibrate=splits.calib, progress=True)
        saved.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"record": record.to_dict(), "model": converted.state_dict()}, saved)
    ce0, ce1 = cross_entropy(original, splits.held), cross_entropy(converted, splits.held)
    print(f"held-out CE: original {ce0:.3f}, calibrated {args.to} {ce1:.3f}", flush=True)
    where = machine()
    new = not CSV.exists()
    CSV.parent.mkdir(parents=True, exist_ok=True)
    for objective, train in combos:
        model = copy.deepcopy(converted)
        splits.stream.load_state({**splits.stream.state(), "epoch": 0, "pos": 0, "drawn": 0})
        t = time.monotonic()
        rep = heal(
            original,
            model,
            splits.stream,
            record,
            val=splits.val,
            minutes=args.minutes,
            objective=objective,
            train=train,
            progress=True,
        )
        seconds = time.monotonic() - t
        ce = cross_entropy(model, splits.held)
        row = {"commit": commit(), "date": datetime.date.today().isoformat(), "machine": where, "to": args.to,
               "objective": objective, "train": train, "minutes": args.minutes, "tokens": rep.tokens,
               "sequences": rep.sequences, "seconds": round(seconds, 1), "ce_original": round(ce0, 4),
               "ce_calibrated": round(ce1, 4), "ce_healed": round(ce, 4), "val_start": rep.curve[0]["val_ce"],
               "val_best": rep.best["val_ce"] if rep.best else "", "curve": json.dumps(rep.curve)}  # fmt: skip
        print(
            f"{objective:8s} {train:6s}: held-out CE {ce:.3f} (+{ce - ce0:.3f}); {rep.tokens:,} tokens, "
            f"{seconds / 60:.1f} min; validation {rep.curve[0]['val_ce']:.3f} -> best "
            f"{row['val_best'] if row['val_best'] == '' else round(row['val_best'], 3)}",
            flush=True,
        )
        with CSV.open("a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=FIELDS)
            if new:
                w.writeheader()
                new = False
            w.writerow(row)
        del model
    plot(list(csv.DictReader(CSV.open()))[-len(combos) :], FIG)


if __name__ == "__main__":
    main()
