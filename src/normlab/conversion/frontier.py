"""The frontier: how many of a model's norms can go, and which, for a given rise in cross-entropy.

    front, _ = normlab.conversion.frontier.frontier(model, "dyisru", calib, held)          # the whole greedy curve
    front, record = frontier(model, "dyisru", calib, held, budget=BudgetConfig(nats=0.5))  # keep what fits
    front.converted, front.curve, front.within(0.1)

The walk's settings are `normlab.conversion.config.BudgetConfig`, the ``budget`` section of ``normlab convert``'s
config, so the function and the command walk alike by construction.

1. Every site is calibrated on the *original* model's activations (``sequential=False``): each fit is exact
   for that site converted alone, and one pass fits them all.
2. Its cost is the rise in next-token cross-entropy it causes alone, measured on the first ``rank_batches``
   calibration batches (the held-out text decides nothing about the order); with ``budget.metric="kl"``, the mean
   KL divergence to the original it causes alone (`ReferenceKL`), and every later measurement is that KL. The KL
   reads every n-th position (``budget.rank_every``, ``step_every``), by default as the model's shape says
   (`kl_every`): every one, unless the output layer outweighs the blocks (a 262,144-token vocabulary).
3. The sites are converted cheapest first, and the held-out cross-entropy is measured after each. With
   ``nats`` the walk never keeps a site that would take the held-out cross-entropy above the original's plus the
   budget, so the model it leaves never ends above its budget on ``held`` as the walk measures it (in bf16 where
   ``budget.precision`` chooses it: within about 0.003 nats of float32 on SmolLM2): ``walk="stop"`` stops before
   the first such site, ``walk="skip"`` puts it back and goes on to the next one (``Frontier.passed`` lists
   those). Without a budget it walks all the sites and puts the model back as it was (the study's curve). ``normlab
   convert --budget-nats`` passes its validation split as ``held`` (``data.walk="self"``: the original's own
   samples), so the held-out text it reports chose nothing.

No training: what healing adds comes after. Baroni et al. remove a pretrained model's LayerNorms one at a time
in a chosen order for the same reason: some norms cost nearly nothing to lose, others nearly everything.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from normlab.conversion.batches import as_batches, autocast_dtype, sharing_copy
from normlab.conversion.calibrate.stream import BlockReplay, find_blocks
from normlab.conversion.config import BudgetConfig, CalibrateConfig
from normlab.conversion.convert import convert_norms
from normlab.conversion.measure.fidelity import ReferenceKL, kl_every
from normlab.record import ConversionRecord
from normlab.sites import swap

__all__ = ["FEW_SELECTION", "METRICS", "Frontier", "frontier", "site_costs", "measure_of"]

# Fewer validation sequences than this select a budget walk's sites poorly: on SmolLM2 (DyISRU, per channel,
# budget 0.4) 8 sequences kept 44 sites at +0.39 on them but +0.62 on 8 held-out ones and +0.55 on 32; 32 sequences
# ended within 0.03 of their budget (docs/heal-measurements.md, the frontier).
FEW_SELECTION = 32
METRICS = {"ce": "cross-entropy", "kl": "KL to the original"}  # BudgetConfig.metric -> what it measures, in words
DEFER_FLOOR = 0.01  # nats: a site's cost alone below this counts as this much (budget.defer)


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
    deferred: list[str] = field(default_factory=list)  # the sites put back once for rising steeply (budget.defer)
    precision: str = "float32"  # the arithmetic of the walk's measurements, and why (batches.autocast_dtype)
    metric: str = "ce"  # what the walk measures (BudgetConfig.metric): "ce", or "kl" to the original, whose
    # ``ce_original`` is then 0 and whose ``curve`` and ``costs`` are KLs
    every: tuple[int, int] = (1, 1)  # the KL's every n-th position: the ranking's, the steps' (`kl_every`)
    stage_seconds: dict[str, float] = field(default_factory=dict)  # "fits", "costs" (each site alone), "steps"

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
    model: nn.Module,
    fitted: dict[str, nn.Module],
    batches: list,
    *,
    progress: bool | None = None,
    dtype: torch.dtype | None = None,
    metric: str | Callable[[nn.Module, list], float] = "ce",
) -> dict[str, float]:
    """The cross-entropy rise (``metric="kl"``: the KL to the original) of each site of ``fitted`` (name ->
    calibrated replacement) swapped into ``model`` alone, on ``batches``; ``model`` is left as it was. Each is
    measured from the site's block on (`BlockReplay`), autocast to ``dtype`` when given.

    Args:
        model: The original model (left as it was).
        fitted: Site name -> its calibrated replacement.
        batches: The measurement batches.
        progress: Show a progress bar; None: when stderr is a terminal.
        dtype: The autocast dtype of the measurements (bf16), or None for float32.
        metric: "ce" or "kl" (`BudgetConfig.metric`), or a fresh measure (``ReferenceKL(every=4)``).
    """
    from tqdm.auto import tqdm

    batches = list(as_batches(batches))
    measure = metric if callable(metric) else measure_of(metric)
    replay = BlockReplay(model, batches, find_blocks(model, list(fitted)), list(fitted), dtype, measure)
    base = replay.measure()  # the original's (0 for the KL: its first measurement records the reference)
    costs = {}
    for name in tqdm(
        list(fitted), desc="cost of each site alone", unit="site", disable={True: False, False: True}.get(progress)
    ):
        old = swap(model, name, fitted[name])
        try:
            costs[name] = replay.measure(replay.block_of(name), keep=False) - base
        finally:
            swap(model, name, old)
    return costs


def measure_of(metric: str, every: int = 1) -> Callable[[nn.Module, list], float] | None:
    """The `BlockReplay` measure of a walk's ``metric``: None (its default, the cross-entropy) for "ce", a fresh
    `ReferenceKL` for "kl" (each replay records its own batches' reference on its first measurement, the original's).

    Args:
        metric: "ce" or "kl" (`BudgetConfig.metric`).
        every: The KL's every n-th position (`BudgetConfig.rank_every` for the ranking, ``step_every`` for the steps).
    """
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {sorted(METRICS)}, got {metric!r}")
    return ReferenceKL(every=every) if metric == "kl" else None


def _note_budget(record, model, front: Frontier, originals: dict) -> None:
    """The record says which sites the budget kept as they were, and why."""
    left = [n for n in front.order if n not in set(front.converted)]
    record.notes.append(
        f"--budget-nats {front.budget_nats:g}: converted {len(front.converted)} of {len(front.order)} sites, cheapest "
        f"first ({METRICS[front.metric]} on the batches that select them {front.ce_original:.3f} -> "
        f"{front.curve[-1]:.3f}, "
        f"measured in {front.precision}); "
        f"{len(left)} kept as they were"
    )
    record.skipped += [
        {
            "name": n,
            "class": type(originals.get(n) or model.get_submodule(n)).__name__,
            "reason": f"over the budget: kept as it was (alone: {front.costs[n]:+.3g} nats)",
        }
        for n in left
    ]


def _checked(calibrate, held, budget: BudgetConfig | None) -> tuple[BudgetConfig, list, list, list]:
    """The frontier's arguments checked before any work: the walk's settings and its batches as lists (the
    calibration, the held-out and the ranking batches)."""
    budget = BudgetConfig() if budget is None else budget
    if not isinstance(budget, BudgetConfig):
        raise TypeError(f"budget: expected a BudgetConfig, got {type(budget).__name__}")
    budget.check()
    calib = list(as_batches(calibrate))
    held = list(as_batches(held))
    rank = calib[: budget.rank_batches]
    if not calib or not held:
        raise ValueError("frontier: the calibration and held-out batches must not be empty")
    return budget, calib, held, rank


def _setting(convert_kwargs: dict, **fields: object) -> dict:
    """``convert_kwargs`` with ``fields`` (of the calibrate section) set for one internal call: in the config when
    one is given, since `convert_norms` refuses a keyword that contradicts its config, else as keywords."""
    rest = {k: v for k, v in convert_kwargs.items() if k not in fields}
    cfg = rest.get("config")
    if cfg is None:
        return {**rest, **fields}
    if isinstance(cfg, CalibrateConfig):
        return {**rest, "config": dataclasses.replace(cfg, **fields)}
    return {**rest, "config": dataclasses.replace(cfg, calibrate=dataclasses.replace(cfg.calibrate, **fields))}


@dataclasses.dataclass(frozen=True)
class _Walk:
    """What the walk works with: the target, the refit batches, the convert keywords, the replay that measures each
    step, and each site's independent fit (fixed), and the sites' records and the original norms of the sites
    swapped so far (they grow as the walk goes)."""

    to: str
    batches: list
    kwargs: dict
    replay: BlockReplay
    fitted: dict
    by_name: dict
    originals: dict = dataclasses.field(default_factory=dict)


def _refit(model, name: str, walk: _Walk):
    """Convert the one site ``name`` of ``model`` in place to ``walk.to``, fitted on its input in the model as it is
    now (``walk.batches``, ``walk.kwargs``); returns the new site record."""
    kwargs = {k: v for k, v in walk.kwargs.items() if k != "include"}
    # one site: its input in the model as it is now, from the pass that takes its target
    kwargs = _setting(kwargs, massive_tokens="route" if walk.by_name[name].massive else "shared", sequential=False)

    def only(n: str, m: nn.Module) -> bool:
        return n == name

    return convert_norms(model, walk.to, calibrate=walk.batches, progress=False, include=only, **kwargs).sites[0]


def _refit_all(model, done: list, walk: _Walk, ce: float) -> float:
    """Fit every converted site of ``done`` again, by one sequential calibration of those sites (the block stream:
    each on its input in the model with the sites before it refitted, against the original norm applied to that
    input, as a site's own refit; ``walk``: the originals, the site records, the target, the batches, the convert
    kwargs). Kept when the cross-entropy on ``held`` falls, undone otherwise; returns the cross-entropy the model is
    left at."""
    names = [n for n in walk.by_name if n in set(done)]  # the model's order
    before = {n: model.get_submodule(n) for n in names}
    records = {n: walk.by_name[n] for n in names}
    for n in names:
        swap(model, n, walk.originals[n])
    chosen = set(names)
    try:
        kwargs = {k: v for k, v in walk.kwargs.items() if k not in ("include", "sequential")}
        # as each site's own refit: the original norm on its input in the model as it is now
        kwargs = _setting(
            kwargs, massive_tokens="route" if any(records[n].massive for n in names) else "shared", target="local"
        )
        sub = convert_norms(
            model, walk.to, calibrate=walk.batches, progress=False, include=lambda n, m: n in chosen, **kwargs
        )
    except BaseException:
        for n in names:
            swap(model, n, before[n])
        raise
    walk.by_name.update({s.name: s for s in sub.sites})
    replay = walk.replay
    new = replay.measure(min(replay.block_of(n) for n in names), keep=False)
    if new < ce:
        replay.commit()
        return new
    for n in names:
        swap(model, n, before[n])
    walk.by_name.update(records)
    return ce


def frontier(
    model: nn.Module,
    to: str,
    calibrate: Iterable,
    held: Iterable,
    *,
    budget: BudgetConfig | None = None,
    progress: bool | None = None,
    **convert_kwargs: object,
) -> tuple[Frontier, ConversionRecord]:
    """Rank ``model``'s norms by the cost of converting each alone to ``to`` and walk them cheapest first (see
    the module docstring).

    Args:
        model: the model; with a budget it keeps the sites that fit, converted in place; without one it is left
            unchanged.
        to: a registered norm the sites become.
        calibrate: calibration batches (token ids): every site's fit, and the first ``rank_batches`` of them rank.
        held: the batches the walk measures each step on (``normlab convert`` passes its validation split, or
            the original's own samples with ``data.walk="self"``).
        budget: the walk's settings, the ``budget`` section of ``normlab convert``'s config (default: its
            defaults). ``nats=None`` walks the whole curve; ``nats=X`` keeps the sites that fit in +X nats on
            ``held`` (possibly none). ``walk="skip"`` puts a site over the budget back and goes on, ``"stop"`` ends
            the walk there. ``refit_batches=N`` fits each site again, when its turn comes, on its input in the model
            as converted so far (0 keeps the independent fits). ``refit_every=K`` fits every kept site again after
            every K, keeping the refit only where it lowers the cross-entropy on ``held``.
        progress: progress bars (None: only on a terminal).
        **convert_kwargs: for `convert_norms` (``per``, ``init``, ``include``, ``massive_tokens``).

    Returns:
        The `Frontier` (costs, order, curve, the sites kept and passed, seconds) and the conversion record of the
        sites it converted.
    """
    import time

    budget, calib, held, rank = _checked(calibrate, held, budget)
    dtype, precision = autocast_dtype(budget.precision, model, "budget.precision")
    start = time.monotonic()
    fitted_model = sharing_copy(model)  # a host for the independent fits: its norms are swapped, its matrices shared
    record = convert_norms(
        fitted_model, to, calibrate=calib, progress=progress, **_setting(convert_kwargs, sequential=False)
    )
    fitted = {s.name: fitted_model.get_submodule(s.name) for s in record.sites}
    fits = time.monotonic()
    every = (budget.rank_every, budget.step_every)
    every = tuple(e or kl_every(model) for e in every) if budget.metric == "kl" else (1, 1)  # the output layer's
    ranking = measure_of(budget.metric, every[0]) or budget.metric  # share bounded: every n-th position
    costs = site_costs(model, fitted, rank, progress=progress, dtype=dtype, metric=ranking)
    order = sorted(costs, key=lambda n: costs[n] if math.isfinite(costs[n]) else math.inf)
    ranked = time.monotonic()
    # each step measured from its block on
    measure = measure_of(budget.metric, every[1])
    replay = BlockReplay(model, held, find_blocks(model, order), order, dtype, measure)
    skip = budget.walk == "skip"
    now = replay.measure()
    front = Frontier(
        to,
        now,
        costs,
        order,
        [],
        budget.nats,
        skip=skip,
        precision=precision,
        metric=budget.metric,
        every=every,
    )
    front.curve.append(now)
    by_name = {s.name: s for s in record.sites}
    walk = _Walk(to, calib[: budget.refit_batches], convert_kwargs, replay, fitted, by_name)
    try:
        _walk(model, front, budget, walk, progress)
    except BaseException:
        for name, old in walk.originals.items():
            swap(model, name, old)
        raise
    if budget.nats is None:  # the study: the model goes back as it was
        for name, old in walk.originals.items():
            swap(model, name, old)
    kept = set(front.converted) if budget.nats is not None else set()
    record.sites = [by_name[s.name] for s in record.sites if s.name in kept]
    if budget.nats is not None:
        _note_budget(record, model, front, walk.originals)
    front.seconds = time.monotonic() - start
    front.stage_seconds = {"fits": fits - start, "costs": ranked - fits, "steps": start + front.seconds - ranked}
    return front, record


def _walk(model: nn.Module, front: Frontier, budget: BudgetConfig, walk: _Walk, progress: bool | None) -> None:
    """The greedy walk itself, cheapest first: each site swapped in (fitted again first, with ``refit_batches``),
    measured from its block on, and kept or put back; ``front`` grows its curve, ``converted`` and ``passed``."""
    from tqdm.auto import tqdm

    replay, by_name, originals = walk.replay, walk.by_name, walk.originals
    ce0 = front.ce_original
    bar = tqdm(
        total=len(front.order),
        desc=f"converting cheapest first to {front.target}",
        unit="site",
        disable={True: False, False: True}.get(progress),
    )
    queue = list(front.order)
    while queue:
        name = queue.pop(0)
        if budget.refit_batches:  # fitted again on its input in the model as converted so far
            originals[name] = model.get_submodule(name)
            by_name[name] = _refit(model, name, walk)
        else:
            originals[name] = swap(model, name, walk.fitted[name])
        ce = replay.measure(replay.block_of(name), keep=False)
        over = budget.nats is not None and not ce <= ce0 + budget.nats
        steep = (
            budget.defer
            and name not in front.deferred
            and ce - front.curve[-1] > budget.defer * max(front.costs[name], DEFER_FLOOR)
        )
        if over or steep:
            swap(model, name, originals.pop(name))  # put it back: over the budget, or to be tried again at the end
            if steep and not over:
                front.deferred.append(name)
                queue.append(name)
                continue
            if budget.walk == "stop":
                break
            front.passed.append(name)
            bar.update(1)
            continue
        bar.update(1)
        replay.commit()
        front.converted.append(name)
        if budget.refit_every and budget.refit_batches and len(front.converted) % budget.refit_every == 0:
            ce = _refit_all(model, front.converted, walk, ce)
        front.curve.append(ce)
        bar.set_postfix_str(
            f"{len(front.converted)} sites, CE {ce:.3f} (+{ce - ce0:.3f})"
            + (f", {len(front.passed)} passed" if front.passed else "")
        )
