"""The frontier: how many of a model's norms can go, and which, for a given rise in cross-entropy.

    front = normlab.conversion.frontier.frontier(model, "dyisru", calib, held)     # the whole greedy curve
    front = frontier(model, "dyisru", calib, held, budget_nats=0.5)                # stop at the budget
    front.converted, front.curve, front.within(0.1)

1. Every site is calibrated on the *original* model's activations (``sequential=False``): each fit is exact
   for that site converted alone, and one pass fits them all.
2. Its cost is the rise in next-token cross-entropy it causes alone, measured on ``rank`` (by default the
   first calibration batch: the held-out text decides nothing about the order).
3. The sites are converted cheapest first, and the held-out cross-entropy is measured after each. With
   ``budget_nats`` the walk stops before the first site that would take the held-out cross-entropy above the
   original's plus the budget, so the model it leaves never ends above its budget on ``held``. Without a
   budget it walks all the sites and puts the model back as it was (the study's curve). With ``skip=True`` a
   site that would break the budget is put back and the walk goes on to the next one (``Frontier.passed``
   lists those): every site is tried, and the model still never ends above its budget. ``normlab convert
   --budget-nats`` passes its validation split as ``held``, so the held-out text it reports chose nothing.

No training: what healing adds comes after. Baroni et al. remove a pretrained model's LayerNorms one at a time
in a chosen order for the same reason: some norms cost nearly nothing to lose, others nearly everything.
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass, field

from torch import nn

from normlab.conversion.batches import as_batches, swap
from normlab.conversion.convert import convert_norms
from normlab.conversion.record import ConversionRecord
from normlab.conversion.stream import BlockReplay, find_blocks

__all__ = ["FEW_SELECTION", "Frontier", "frontier", "site_costs"]

# Fewer validation sequences than this select a budget walk's sites poorly: on SmolLM2 (DyISRU, per channel,
# budget 0.4) 8 sequences kept 44 sites at +0.39 on them but +0.62 on 8 held-out ones and +0.55 on 32; 32 sequences
# ended within 0.03 of their budget (docs/frontier-results.md, "Selecting on few sequences").
FEW_SELECTION = 32


@dataclass
class Frontier:
    target: str
    ce_original: float  # on the held-out batches
    costs: dict[str, float]  # site -> cross-entropy rise when converted alone (on the ranking batches)
    order: list[str]  # the sites, cheapest first
    curve: list[float]  # held-out cross-entropy with the first k sites of ``converted`` converted, k = 0, 1, ...
    budget_nats: float | None = None
    converted: list[str] = field(default_factory=list)  # the sites walked and kept, in order (``order``'s prefix
    # unless ``skip``)
    seconds: float = 0.0
    skip: bool = False  # the walk went past a site that broke the budget instead of stopping there
    passed: list[str] = field(default_factory=list)  # the sites it went past (skip=True)

    def within(self, nats: float) -> int:
        """How many sites the greedy walk converts before the held-out cross-entropy first rises above
        the original's plus ``nats``."""
        k = 0
        for ce in self.curve[1:]:
            if not (ce <= self.ce_original + nats):
                break
            k += 1
        return k

    def to_dict(self) -> dict:
        return asdict(self)


def site_costs(
    model: nn.Module, fitted: dict[str, nn.Module], batches, *, progress: bool | None = None, base: float | None = None
) -> dict[str, float]:
    """The cross-entropy rise of each site of ``fitted`` (name -> calibrated replacement) swapped into ``model``
    alone, on ``batches``; ``model`` is left as it was. Each is measured from the site's block on (`BlockReplay`)."""
    from tqdm.auto import tqdm

    batches = list(as_batches(batches))
    replay = BlockReplay(model, batches, find_blocks(model, list(fitted)), list(fitted))
    first = replay.cross_entropy()
    base = first if base is None else base
    costs = {}
    for name in tqdm(
        list(fitted), desc="cost of each site alone", unit="site", disable={True: False, False: True}.get(progress)
    ):
        old = swap(model, name, fitted[name])
        try:
            costs[name] = replay.cross_entropy(replay.block_of(name), keep=False) - base
        finally:
            swap(model, name, old)
    return costs


def _note_budget(record, model, budget_nats: float, order: list, kept: set, costs: dict, originals: dict, ces) -> None:
    """The record says which sites the budget kept as they were, and why."""
    left = [n for n in order if n not in kept]
    record.notes.append(
        f"--budget-nats {budget_nats:g}: converted {len(kept)} of {len(order)} sites, cheapest "
        f"first (cross-entropy on the batches that select them {ces[0]:.3f} -> {ces[1]:.3f}); {len(left)} kept "
        "as they were"
    )
    record.skipped += [
        {
            "name": n,
            "class": type(originals.get(n) or model.get_submodule(n)).__name__,
            "reason": f"over the budget: kept as it was (alone: {costs[n]:+.3g} nats)",
        }
        for n in left
    ]


def _checked(calibrate, held, rank, budget_nats, refit) -> tuple[list, list, list]:
    """The frontier's arguments checked before any work, and its batches as lists."""
    if budget_nats is not None and not (
        isinstance(budget_nats, (int, float)) and budget_nats >= 0 and math.isfinite(budget_nats)
    ):
        raise ValueError(f"budget_nats: expected a finite number >= 0 (nats of cross-entropy), got {budget_nats!r}")
    calib = list(as_batches(calibrate))
    held = list(as_batches(held))
    rank = calib[:1] if rank is None else list(as_batches(rank))
    if not calib or not held or not rank:
        raise ValueError("frontier: the calibration, ranking and held-out batches must not be empty")
    if refit is None or isinstance(refit, bool) or not isinstance(refit, int) or refit < 0:
        raise ValueError(f"refit: expected an int >= 0 (calibration batches), got {refit!r}")
    return calib, held, rank


def _refit(model, name: str, to: str, site, batches: list, convert_kwargs: dict):
    """Convert the one site ``name`` of ``model`` in place, fitted on its input in the model as it is now;
    returns the new site record."""
    sub = convert_norms(
        model,
        to,
        calibrate=batches,
        first_token="own" if site.first_token else "shared",
        progress=False,
        include=lambda n, m: n == name,
        sequential=False,  # one site: its input in the model as it is now, from the pass that takes its target
        **{k: v for k, v in convert_kwargs.items() if k not in ("include", "first_token", "sequential")},
    )
    return sub.sites[0]


def _refit_all(model, done: list, walk: dict, held: list, ce: float) -> float:
    """Fit every converted site of ``done`` again, by one sequential calibration of those sites (the block stream:
    each on its input in the model with the sites before it refitted, against the original norm applied to that
    input, as a site's own refit; ``walk``: the originals, the site records, the target, the batches, the convert
    kwargs). Kept when the cross-entropy on ``held`` falls, undone otherwise; returns the cross-entropy the model is
    left at."""
    names = [n for n in walk["by_name"] if n in set(done)]  # the model's order
    before = {n: model.get_submodule(n) for n in names}
    records = {n: walk["by_name"][n] for n in names}
    for n in names:
        swap(model, n, walk["originals"][n])
    chosen = set(names)
    try:
        sub = convert_norms(
            model,
            walk["to"],
            calibrate=walk["batches"],
            first_token="own" if any(records[n].first_token for n in names) else "shared",
            progress=False,
            include=lambda n, m: n in chosen,
            target="local",  # as each site's own refit: the original norm on its input in the model as it is now
            **{k: v for k, v in walk["kwargs"].items() if k not in ("include", "first_token", "sequential", "target")},
        )
    except BaseException:
        for n in names:
            swap(model, n, before[n])
        raise
    walk["by_name"].update({s.name: s for s in sub.sites})
    replay = walk["replay"]
    new = replay.cross_entropy(min(replay.block_of(n) for n in names), keep=False)
    if new < ce:
        replay.commit()
        return new
    for n in names:
        swap(model, n, before[n])
    walk["by_name"].update(records)
    return ce


def frontier(
    model: nn.Module,
    to: str,
    calibrate,
    held,
    *,
    rank=None,
    budget_nats: float | None = None,
    stop_nats: float | None = None,
    refit: int = 1,
    refit_every: int = 0,
    skip: bool = False,
    progress: bool | None = None,
    **convert_kwargs,
) -> tuple[Frontier, ConversionRecord]:
    """Rank ``model``'s norms by the cost of converting each alone to ``to`` and walk them cheapest first (see
    the module docstring). Returns the `Frontier` and the conversion record of the sites it converted.

    ``budget_nats=None``: the curve (up to ``stop_nats`` above the original, if given); ``model`` is left
    unchanged. ``budget_nats=X``: ``model`` keeps the sites that fit in +X nats on ``held`` (possibly none),
    converted in place. ``refit=N``: each site, when its turn comes, is fitted again on its input in the model
    as converted so far (on the first N calibration batches), as sequential calibration does; 0 keeps the
    independent fits. ``refit_every=K``: after every K sites kept, every converted site is fitted again on its
    input in the model as it is now, and the refit is kept only where it lowers the cross-entropy on ``held``
    (so the budget still holds); 0 never. ``skip=True``: a site that breaks the budget (or ``stop_nats``) is put
    back and the walk goes on, instead of stopping there. ``convert_kwargs`` go to `convert_norms` (per, init, include,
    first_token, ...).
    """
    import time

    from tqdm.auto import tqdm

    calib, held, rank = _checked(calibrate, held, rank, budget_nats, refit)
    if isinstance(refit_every, bool) or not isinstance(refit_every, int) or refit_every < 0:
        raise ValueError(f"refit_every: expected an int >= 0 (sites between refits of all), got {refit_every!r}")
    stop_nats = budget_nats if budget_nats is not None else stop_nats
    start = time.monotonic()
    fitted_model = copy.deepcopy(model)
    record = convert_norms(fitted_model, to, calibrate=calib, sequential=False, progress=progress, **convert_kwargs)
    fitted = {s.name: fitted_model.get_submodule(s.name) for s in record.sites}
    costs = site_costs(model, fitted, rank, progress=progress)
    order = sorted(costs, key=lambda n: costs[n] if math.isfinite(costs[n]) else math.inf)
    replay = BlockReplay(model, held, find_blocks(model, order), order)  # each step measured from its block on
    ce0 = replay.cross_entropy()
    curve, done, passed, originals = [ce0], [], [], {}
    refit_batches = calib[:refit]
    by_name = {s.name: s for s in record.sites}
    walk = {"by_name": by_name, "originals": originals, "to": to, "batches": refit_batches, "kwargs": convert_kwargs,
            "replay": replay}  # fmt: skip
    bar = tqdm(
        order, desc=f"converting cheapest first to {to}", unit="site", disable={True: False, False: True}.get(progress)
    )
    try:
        for name in bar:
            if refit:  # fitted again on its input in the model as converted so far
                originals[name] = model.get_submodule(name)
                by_name[name] = _refit(model, name, to, by_name[name], refit_batches, convert_kwargs)
            else:
                originals[name] = swap(model, name, fitted[name])
            ce = replay.cross_entropy(replay.block_of(name), keep=False)
            if stop_nats is not None and not ce <= ce0 + stop_nats:
                swap(model, name, originals.pop(name))  # this one would break the budget: put it back
                if not skip:
                    break
                passed.append(name)
                continue
            replay.commit()
            done.append(name)
            if refit_every and refit and len(done) % refit_every == 0:
                ce = _refit_all(model, done, walk, held, ce)
            curve.append(ce)
            bar.set_postfix_str(
                f"{len(done)} sites, CE {ce:.3f} (+{ce - ce0:.3f})" + (f", {len(passed)} passed" if passed else "")
            )
    except BaseException:
        for name, old in originals.items():
            swap(model, name, old)
        raise
    if budget_nats is None:  # the study: the model goes back as it was
        for name, old in originals.items():
            swap(model, name, old)
    kept = set(done) if budget_nats is not None else set()
    record.sites = [by_name[s.name] for s in record.sites if s.name in kept]
    if budget_nats is not None:
        _note_budget(record, model, budget_nats, order, kept, costs, originals, (ce0, curve[-1]))
    front = Frontier(to, ce0, costs, order, curve, budget_nats, done, time.monotonic() - start, skip, passed)
    return front, record
