"""An experiment as data: a TOML file of runs (``normlab/experiments/*.toml``, one per table of the dissection,
or a file of your own), its fields checked one by one, its references to runs and profiles resolved, and its
learning-rate sweeps expanded (`lr_variants`). `normlab.sweep` runs it."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from normlab.owner import path_segment_error
from normlab.profiles import PROFILES
from normlab.typed import check_table, hints

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["Experiment", "builtin_experiments", "load_experiment", "lr_variants", "check_experiment_fields"]


@dataclass
class Experiment:
    name: str
    title: str
    source: str
    claim: str
    runs: list[dict]
    seeds: list[int] = field(default_factory=lambda: [0])
    metrics: list[str] = field(default_factory=lambda: ["final_val_loss"])
    base: dict = field(default_factory=dict)  # overrides for every run (e.g. data = ["my.txt"])
    path: str = ""
    baseline: str | None = None  # the run *frac* and the checks measure from
    checks: list[dict] = field(default_factory=list)  # the verdicts, applied by normlab.report
    figures: list[str] = field(default_factory=lambda: ["loss"])
    guard: bool = True  # judge the checks only once the baseline has trained past the attractor
    mechanism: list[str] = field(default_factory=list)  # runs whose telemetry the "mechanism" figure draws
    profiles: list[str] | None = None  # the only profiles it runs at (the scaling study: its own); None: all


def builtin_experiments(profile: str | None = None) -> list[str]:
    """Names of the experiments shipped with normlab, in report order; with ``profile``, those that run at it
    (the scaling study runs only at its own profile, so `normlab reproduce` leaves it out).

    Args:
        profile: Keep those that run at this profile; None: every one.
    """
    order = ["phase", "pointwise", "width", "denominator", "coupling", "coupling_sweep", "rank", "beyond"]
    found = {p.name[:-5] for p in resources.files("normlab.experiments").iterdir() if p.name.endswith(".toml")}
    names = [n for n in order if n in found] + sorted(found - set(order))
    if profile is None:
        return names
    return [n for n in names if (ps := load_experiment(n).profiles) is None or profile in ps]


class _Top:
    """An experiment TOML's keys and their kinds (`normlab.typed.check_table`)."""

    name: str
    title: str
    source: str
    claim: str
    runs: list[dict]
    seeds: list[int]
    metrics: list[str]
    base: dict
    baseline: str
    checks: list[dict]
    figures: list[str]
    guard: bool
    mechanism: list[str]
    profiles: list[str]


class _Run:
    """A run's keys and their kinds; a run's own extra keys (paper, flags, cell, ...) are free metadata."""

    name: str
    label: str
    set: dict
    shape: str
    profiles: list[str]
    budget: int
    lrs: list[float]
    lr_field: str


def check_experiment_fields(d: dict, where: str) -> None:
    """Each field of an experiment TOML has its kind (``_Top``, ``_Run``): else one line naming the file and the
    field, what was expected and what was given, before any run is expanded.

    Args:
        d: The parsed TOML.
        where: The file, named in errors.
    """
    missing = [k for k in ("name", "runs") if k not in d]
    if missing:
        raise ValueError(f"{where}: missing {', '.join(missing)}")
    check_table(d, _Top, where)
    if (why := path_segment_error(d["name"])) is not None:  # figures are named after it, inside the report's root
        raise ValueError(f"{where}: name {why}")
    if set(d.get("base", {})) - {"set"} or not isinstance(d.get("base", {}).get("set", {}), dict):
        raise ValueError(
            f"{where}: base must be a table with one table, set (e.g. base = {{ set = {{ lr = 1e-3 }} }})"
            f", got {d['base']!r}"
        )
    for i, r in enumerate(d["runs"]):
        for key in ("name", "set"):
            if key not in r:
                raise ValueError(f"{where}: run {i} needs 'name' and 'set'")
        known = {k: v for k, v in r.items() if k in hints(_Run)}  # the others are the run's metadata
        check_table(known, _Run, f"{where}: run {i} ({r.get('name')!r})")


def _read_toml(name_or_path: str) -> tuple[dict, str]:
    """A built-in experiment's or a file's TOML, parsed, and where it came from (for messages)."""
    p = Path(name_or_path)
    if p.suffix == ".toml" or p.exists():
        if not p.is_file():
            raise FileNotFoundError(f"experiment file {name_or_path!r} does not exist")
        text, where = p.read_text(), str(p)
    else:
        res = resources.files("normlab.experiments") / f"{name_or_path}.toml"
        if not res.is_file():
            raise ValueError(
                f"unknown experiment {name_or_path!r}; built-in: {', '.join(builtin_experiments())}, "
                "or pass a path to a .toml file"
            )
        text, where = res.read_text(), f"normlab/experiments/{name_or_path}.toml"
    try:
        return tomllib.loads(text), where
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{where}: not valid TOML ({e})") from None


def _check_runs(d: dict, where: str) -> None:
    """Each run's profiles, learning-rate grid, budget, and a name of its own."""
    seen: set[str] = set()
    for r in d["runs"]:
        unknown = [p for p in r.get("profiles", []) if p not in PROFILES]
        if unknown:
            raise ValueError(
                f"{where}: run {r['name']!r}: unknown profile {unknown[0]!r}; valid: {', '.join(PROFILES)}"
            )
        lrs = r.get("lrs")
        if lrs is not None and (len(lrs) < 2 or len(set(lrs)) != len(lrs) or not all(v > 0 for v in lrs)):
            raise ValueError(
                f"{where}: run {r['name']!r}: lrs must be a list of at least two distinct learning "
                f"rates > 0 (the grid its best is chosen from), got {lrs!r}"
            )
        if r.get("lr_field", "lr") not in ("lr", "muon_lr"):
            raise ValueError(f"{where}: run {r['name']!r}: lr_field must be 'lr' or 'muon_lr', got {r['lr_field']!r}")
        if r.get("budget", 1) < 1:
            raise ValueError(
                f"{where}: run {r['name']!r}: budget (a multiple of the profile's steps) must be an "
                f"int >= 1, got {r['budget']!r}"
            )
        if r["name"] in seen:
            raise ValueError(
                f"{where}: two runs are named {r['name']!r}; each run needs its own name (the report "
                "would average them as seeds of one run)"
            )
        seen.add(r["name"])


def _check_references(d: dict, where: str) -> None:
    """What the experiment names beyond its runs: the mechanism runs, profiles, baseline, checks and figures."""
    from normlab.report import CHECKS, FIGURES  # the kinds a report can apply: known before any run trains

    names = {r["name"] for r in d["runs"]}
    seeds = d.get("seeds", [0])
    if not seeds or len(set(seeds)) != len(seeds) or any(isinstance(s, bool) or s < 0 for s in seeds):
        raise ValueError(
            f"{where}: seeds must list at least one distinct int >= 0 (each run trains once per seed), got {seeds!r}"
        )
    missing_runs = [n for n in d.get("mechanism", []) if n not in names]
    if missing_runs:
        raise ValueError(f"{where}: mechanism names a run that does not exist: {missing_runs[0]!r}")
    profiles = d.get("profiles")
    if profiles is not None and not all(p in PROFILES for p in profiles):
        raise ValueError(f"{where}: profiles must name profiles ({', '.join(PROFILES)}), got {profiles!r}")
    if d.get("baseline") is not None and d["baseline"] not in names:
        raise ValueError(f"{where}: baseline {d['baseline']!r} is not one of its runs ({', '.join(sorted(names))})")
    for i, c in enumerate(d.get("checks", [])):
        if "kind" not in c:
            raise ValueError(f"{where}: check {i} needs a 'kind'")
        if c["kind"] not in CHECKS:
            raise ValueError(f"{where}: check {i}: unknown kind {c['kind']!r}; known: {', '.join(sorted(CHECKS))}")
        unknown = [c[k] for k in ("run", "a", "b") if k in c and c[k] not in names]
        if unknown:
            raise ValueError(f"{where}: check {i} ({c['kind']}) names a run that does not exist: {unknown[0]!r}")
    unknown_figs = [f for f in d.get("figures", []) if f not in FIGURES]
    if unknown_figs:
        raise ValueError(f"{where}: figures: unknown figure {unknown_figs[0]!r}; known: {', '.join(sorted(FIGURES))}")


def load_experiment(name_or_path: str) -> Experiment:
    """A built-in experiment by name, or a TOML file by path; a malformed file raises a clear error.

    Args:
        name_or_path: A built-in experiment's name or a TOML file.
    """
    d, where = _read_toml(name_or_path)
    check_experiment_fields(d, where)
    _check_runs(d, where)
    _check_references(d, where)
    return Experiment(
        name=d["name"],
        title=d.get("title", d["name"]),
        source=d.get("source", ""),
        claim=d.get("claim", ""),
        runs=d["runs"],
        seeds=d.get("seeds", [0, 1, 2]),
        metrics=d.get("metrics", ["final_val_loss"]),
        base=d.get("base", {}).get("set", {}),
        path=where,
        baseline=d.get("baseline"),
        checks=d.get("checks", []),
        figures=d.get("figures", ["loss"]),
        guard=d.get("guard", True),
        mechanism=d.get("mechanism", []),
        profiles=d.get("profiles"),
    )


def lr_variants(run: dict) -> list[tuple[str, str, dict, dict]]:
    """The runs one TOML entry stands for: itself, or with ``lrs = [...]`` one run per learning rate, named
    ``name@lr=0.002`` (``lr_field`` = "muon_lr" sweeps Muon's rate instead). Each variant's meta names the
    sweep it belongs to (``sweep``) and its rate, so the report can pick the best and draw the curve.

    Args:
        run: One ``[[runs]]`` entry of an experiment TOML.
    """
    meta = {k: v for k, v in run.items() if k not in ("name", "label", "set", "lrs")}
    label = run.get("label", run["name"])
    if not run.get("lrs"):
        return [(run["name"], label, {}, meta)]
    field_ = run.get("lr_field", "lr")
    return [
        (
            f"{run['name']}@{field_}={lr:g}",
            f"{label}, {field_} {lr:g}",
            {field_: lr},
            {**meta, "sweep": run["name"], "lr": lr, "lr_field": field_},
        )
        for lr in sorted(run["lrs"])
    ]
