"""Two parts of the budget walk timed on a real model, each against what it replaces, in one run:

- the ranking: each site's cost alone (its KL to the original, `normlab.conversion.measure.fidelity.ReferenceKL`)
  with the output layer on every position and on every ``--every``-th, with how far the two rankings agree;
- a refit's massive rows: the inputs and outputs of a site at the ``[t, t]`` pairs in one pass of the model
  (``early_rows(..., "both")``, what each refit of a routed site now takes) against a pass for each.

    python scripts/bench_walk.py [--model smollm2] [--every 4]

The sites are fitted as the walk fits them (on the original's activations, per channel), on the calibration batches
of ``normlab convert``'s defaults, and ranked on its first ``budget.rank_batches``. Rows go to bench/walk.csv
(command, commit, machine, date).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

from scipy.stats import spearmanr

from _study import stamp  # scripts/ is on the path when a script runs
from normlab.conversion.batches import autocast_dtype, sharing_copy
from normlab.conversion.calibrate.massive import early_rows, early_token_batches
from normlab.conversion.checks import check_inputs
from normlab.conversion.config import BudgetConfig, HealConfig, resolve_convert_config
from normlab.conversion.convert import convert_norms
from normlab.conversion.data.models import load_model
from normlab.conversion.data.texts import conversion_texts
from normlab.conversion.frontier import site_costs
from normlab.conversion.measure.fidelity import ReferenceKL
from normlab.corpus import fetch_shakespeare
from normlab.table import append_csv

ROOT = Path(__file__).resolve().parent.parent


def _cheapest(costs: dict, n: int) -> set:
    return set(sorted(costs, key=costs.get)[:n])


def _massive_rows(net, batches: list, fitted: dict, model: str) -> dict:
    """A refit's massive rows (one batch, as ``budget.refit_batches=1``) for the site two thirds of the way in: two
    passes against one, best of 3 each, and whether they agree bit for bit."""
    name = list(fitted)[2 * len(fitted) // 3]
    pairs = early_token_batches(batches, 4096)
    dims = {name: -1}
    best = {"two": float("inf"), "one": float("inf")}
    for _ in range(3):
        t0 = time.perf_counter()
        x, y = early_rows(net, pairs, dims, "in")[name], early_rows(net, pairs, dims, "out")[name]
        best["two"] = min(best["two"], time.perf_counter() - t0)
        t0 = time.perf_counter()
        both = early_rows(net, pairs, dims, "both")[name]
        best["one"] = min(best["one"], time.perf_counter() - t0)
    same = bool((both[:, 0] == x).all() and (both[:, 1] == y).all())
    return {"part": "massive rows", "model": model, "site": name, "pairs": sum(len(p) for p in pairs),
            "seconds": round(best["one"], 3), "reference_seconds": round(best["two"], 3),
            "speedup": round(best["two"] / best["one"], 2), "identical": same}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--csv", type=Path, default=ROOT / "bench" / "walk.csv")
    args = p.parse_args()
    cfg = resolve_convert_config(
        model=args.model, to="dyisru", per="channel", **{"budget.nats": 0.02, "budget.metric": "kl"}
    )
    net, tokenizer = load_model(check_inputs(cfg), progress=False)
    texts = conversion_texts(cfg, fetch_shakespeare(), tokenizer, net.get_input_embeddings().num_embeddings)
    host = sharing_copy(net)  # the independent fits, as the walk makes them
    plain = dataclasses.replace(cfg, heal=HealConfig(), budget=BudgetConfig())
    plain = dataclasses.replace(plain, calibrate=dataclasses.replace(cfg.calibrate, sequential=False))
    record = convert_norms(host, calibrate=texts.calib, config=plain, progress=False)
    fitted = {s.name: host.get_submodule(s.name) for s in record.sites}
    dtype, precision = autocast_dtype("auto", net, "budget.precision")
    rank = texts.calib[: BudgetConfig().rank_batches]
    costs, seconds = {}, {}
    for every in (1, args.every):
        t0 = time.perf_counter()
        costs[every] = site_costs(net, fitted, rank, progress=False, dtype=dtype, metric=ReferenceKL(every=every))
        seconds[every] = time.perf_counter() - t0
    full, thin = costs[1], costs[args.every]
    rho = float(spearmanr([full[n] for n in full], [thin[n] for n in full]).statistic)
    rows = [_massive_rows(net, texts.calib[:1], fitted, args.model)]
    print(rows[-1], flush=True)
    for every in (1, args.every):
        rows.append({"part": "ranking",
            "model": args.model, "every": every, "sites": len(fitted), "seconds": round(seconds[every], 1),
            "seconds_per_site": round(seconds[every] / len(fitted), 2),
            "speedup": round(seconds[1] / seconds[every], 2),
            "spearman_vs_every_1": round(rho, 4) if every != 1 else 1.0,
            "cheapest_10_shared": len(_cheapest(full, 10) & _cheapest(costs[every], 10)),
            "cheapest_20_shared": len(_cheapest(full, 20) & _cheapest(costs[every], 20)),
            "precision": precision.split(" (")[0],
        })  # fmt: skip
        print(rows[-1], flush=True)
    append_csv(args.csv, rows, stamp=stamp())


if __name__ == "__main__":
    main()
