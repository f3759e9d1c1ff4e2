"""How many of SmolLM2's 61 norms can go with no training: the greedy frontier, per target.

    python scripts/frontier_study.py                      # DyISRU, DyT, Derf (about 15 min each on 2 CPU cores)
    python scripts/frontier_study.py --to dyisru          # one target
    python scripts/frontier_study.py --to dyisru --refit-every 4 --skip   # refit all every 4 sites; go past
    python scripts/frontier_study.py --to dyisru --refit-every 4 --skip --select-on validation --budget 0.5
    python scripts/frontier_study.py --to dyisru --skip --per channel   # one beta and amplitude per channel
    python scripts/frontier_study.py --to dyisru --skip --rank-batches 4  # rank on 4 batches (32 sequences), not 1
    python scripts/frontier_study.py --replot             # redraw the figure from bench/frontier.json

For each target (normlab.conversion.frontier): every site calibrated on the original model's activations, its cost
alone measured on the first calibration batch (8 sequences), then the sites converted cheapest first, each fitted
again on its input in the model converted so far (``--refit``), the held-out cross-entropy measured after each
until it rises above the original's by ``--stop`` nats (SmolLM2's 32 held-out Shakespeare sequences of 128 tokens, the
numbers of docs/frontier-results.md). No training.

``--select-on validation`` is the honest count: the walk selects on 32 validation sequences of the text (between
calibration and held-out, as ``normlab convert --budget-nats`` does) with ``--budget`` as its budget, and the 32
held-out sequences, which chose nothing, measure the model it keeps. The default (``held``) selects and reports
on the same held-out sequences: its counts are the curve's, an upper bound on what a budget would keep.
Each target's result is written to bench/frontier.json as soon as it is done (with the commit, the date and the
machine); docs/figures/frontier.png plots CE against the number of converted sites.
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

from _study import ROOT, commit, machine, save

OUT = ROOT / "bench" / "frontier.json"
FIG = ROOT / "docs" / "figures" / "frontier.png"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, zoom) = plt.subplots(1, 2, figsize=(15, 4.8))
    markers = iter("os^vDP*X")
    for to, r in results.items():
        if "curve" not in r:  # a --select-on validation entry: one point, the sites kept and their held-out rise
            rise = r["ce_held"] - r["ce_held_original"]
            zoom.plot(
                r["sites_kept"],
                rise,
                marker=next(markers, "o"),
                ls="",
                ms=8,
                label=f"{to.replace('selected on validation, ', '')}: {rise:+.2f}",
            )
            continue
        ks = range(len(r["curve"]))
        rise = [c - r["ce_original"] for c in r["curve"]]
        for a in (ax, zoom):
            a.plot(ks, rise, marker=".", label=f"{to} ({r['within_0.1']} / {r['within_0.5']} sites in +0.1 / +0.5)")
    ax.set_yscale("symlog", linthresh=0.1)
    zoom.set_ylim(-0.05, 1.0)
    for a in (ax, zoom):
        for y in (0.1, 0.5):
            a.axhline(y, color="grey", lw=0.8, ls="--")
        a.set_xlabel("sites converted, cheapest first (calibrated, no training)")
        a.set_ylabel("held-out CE - original's (nats/token)")
    ax.set_title("SmolLM2-135M: the greedy frontier")
    zoom.set_title("up to +1 nat; points: kept on validation, measured held out")
    zoom.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    save(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--to", nargs="+", default=["dyisru", "dyt", "derf"])
    ap.add_argument("--stop", type=float, default=1.0, help="end the walk at this rise in nats (default 1.0)")
    ap.add_argument("--refit", type=int, default=1, help="calibration batches each site is refitted on (0: none)")
    ap.add_argument(
        "--refit-every", type=int, default=0, help="refit every converted site after each K kept (0: never)"
    )
    ap.add_argument("--skip", action="store_true", help="go past a site over --stop instead of ending the walk")
    ap.add_argument(
        "--select-on",
        choices=["held", "validation"],
        default="held",
        help="what the walk selects on: the held-out sequences it reports (the curve), or a validation split, "
        "with the held-out ones measuring the kept model (default held)",
    )
    ap.add_argument("--budget", type=float, default=0.5, help="the budget in nats with --select-on validation")
    ap.add_argument(
        "--rank-batches",
        type=int,
        default=1,
        help="calibration batches of 8 sequences each site's cost alone is measured on, for the order (default 1)",
    )
    ap.add_argument("--per", choices=["global", "channel"], default="global",
                    help="one fitted parameter per site (default), or one per channel (calibrate.per)")  # fmt: skip
    ap.add_argument("--replot", action="store_true")
    args = ap.parse_args()
    if args.rank_batches < 1:
        ap.error(f"--rank-batches must be at least 1 (calibration batches of 8 sequences), got {args.rank_batches}")
    results = json.loads(OUT.read_text())["targets"] if OUT.exists() else {}
    if args.replot:
        plot(results, FIG)
        return

    import torch

    from normlab.conversion.frontier import frontier
    from normlab.conversion.hf import load_model, smollm2, text_batches
    from normlab.corpus import fetch_shakespeare

    torch.manual_seed(0)
    model, tok = load_model(smollm2())
    if args.select_on == "validation":
        honest(model, tok, args)
        return
    calib, held = text_batches(fetch_shakespeare(), tok, model.config.vocab_size, 128, 32, 32)
    for to in args.to:
        front, _ = frontier(model, to, calib, held, stop_nats=args.stop, refit=args.refit,
                            refit_every=args.refit_every, skip=args.skip, per=args.per,
                            rank=calib[: args.rank_batches], progress=True)  # fmt: skip
        r = front.to_dict()
        r["within_0.1"], r["within_0.5"] = front.within(0.1), front.within(0.5)
        r["stop_nats"], r["refit"], r["refit_every"] = args.stop, args.refit, args.refit_every
        r.update(commit=commit(), date=datetime.date.today().isoformat(), machine=machine())
        key = f"{to} ({', '.join(variant(args))})" if variant(args) else to  # the plain walk keeps its old key
        results = write(key, r)
        print(
            f"{key}: {r['within_0.1']} sites within +0.1 nats, {r['within_0.5']} within +0.5 "
            f"(of {len(front.order)}; original CE {front.ce_original:.3f}, {front.curve[-1]:.3f} with "
            f"{len(front.curve) - 1} converted where the walk stopped; "
            f"{front.seconds / 60:.1f} min)",
            flush=True,
        )
    plot(results, FIG)


def variant(args) -> list[str]:
    """What the walk did beyond the plain one, for the result's key."""
    return ([f"refit all every {args.refit_every}"] * bool(args.refit_every) + ["skip"] * args.skip
            + ["per channel"] * (args.per == "channel")
            + [f"ranked on {args.rank_batches} batches"] * (args.rank_batches != 1))  # fmt: skip


def write(key: str, entry: dict) -> dict:
    """Put one target's result into bench/frontier.json under its lock, read afresh there so that a study running
    beside this one keeps its entries; returns every target's result."""
    from normlab.owner import hold

    OUT.parent.mkdir(parents=True, exist_ok=True)
    with hold(OUT, "the frontier results", wait=True):
        results = json.loads(OUT.read_text())["targets"] if OUT.exists() else {}
        results[key] = entry
        stamp = {"commit": commit(), "date": datetime.date.today().isoformat(), "machine": machine()}
        OUT.write_text(json.dumps({**stamp, "targets": results}, indent=1) + "\n")
    return results


def honest(model, tok, args) -> None:
    """Select on a validation split under ``args.budget``, measure the kept model on the held-out sequences."""
    import copy

    from normlab.conversion.fidelity import cross_entropy
    from normlab.conversion.frontier import frontier
    from normlab.conversion.hf import text_splits
    from normlab.corpus import fetch_shakespeare

    splits = text_splits(fetch_shakespeare(), tok, model.config.vocab_size, 128, 32, 32, n_val=32)
    ce_held = cross_entropy(model, splits.held)
    for to in args.to:
        kept = copy.deepcopy(model)
        front, _ = frontier(kept, to, splits.calib, splits.val, budget_nats=args.budget, refit=args.refit,
                            refit_every=args.refit_every, skip=args.skip, per=args.per,
                            rank=splits.calib[: args.rank_batches], progress=True)  # fmt: skip
        held = cross_entropy(kept, splits.held)
        key = f"{to} ({', '.join(variant(args) + [f'selected on validation, budget {args.budget:g}'])})"
        entry = {
            "target": to,
            "sites_kept": len(front.converted),
            "budget_nats": args.budget,
            "ce_validation_original": front.ce_original,
            "ce_validation": front.curve[-1],
            "ce_held_original": ce_held,
            "ce_held": held,
            "converted": front.converted,
            "passed": front.passed,
            "refit": args.refit,
            "refit_every": args.refit_every,
            "skip": args.skip,
            "per": args.per,
            "rank_batches": args.rank_batches,
            "seconds": front.seconds,
            "commit": commit(),
            "date": datetime.date.today().isoformat(),
            "machine": machine(),
        }
        print(
            f"{key}: kept {len(front.converted)} of {len(front.order)} sites; validation {front.ce_original:.3f} -> "
            f"{front.curve[-1]:.3f}; held-out (chose nothing) {ce_held:.3f} -> {held:.3f} (+{held - ce_held:.3f}); "
            f"{front.seconds / 60:.1f} min",
            flush=True,
        )
        write(key, entry)


if __name__ == "__main__":
    main()
