"""Experiments as data, and a sweep runner that survives failure.

An experiment is a small TOML file listing runs (``normlab/experiments/*.toml``, one per
table of the dissection, or a file of your own). A *profile* scales every experiment to a
machine: ``quick`` (minutes), ``default`` (the CPU subset of ``normlab reproduce``),
``full`` (the ``cpu`` preset) and ``gpu`` (the dissection's shapes).

A run's directory is ``<root>/runs/<norm>-<hash>-s<seed>``, named by the hash of its
resolved config, so identical runs in several tables are trained once. The runner
skips runs that finished (completed or diverged), resumes a run killed midway from its
checkpoint, records an exception as ``failed`` and goes on, and shards with ``shard=(i, n)``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import sys
import traceback
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from tqdm.auto import tqdm

from normlab.lab.config import TrainConfig, resolve_config
from normlab.lab.runs import SUMMARY, TERMINAL, RunFolder, RunLocked, read_summary
from normlab.owner import path_segment_error
from normlab.profiles import PROFILES

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["PROFILES", "Experiment", "RunSpec", "Workers", "builtin_experiments", "load_experiment", "expand",
           "run_sweep", "parse_shard", "lr_variants", "check_experiment_fields"]  # fmt: skip


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


@dataclass
class RunSpec:
    experiment: str
    name: str
    label: str
    seed: int
    config: TrainConfig
    meta: dict

    @property
    def run_id(self) -> str:
        d = self.config.to_dict()
        d.pop("out")
        digest = hashlib.sha1(json.dumps(d, sort_keys=True).encode()).hexdigest()[:10]
        return f"{self.config.model.norm}-{digest}-s{self.seed}"


def builtin_experiments(profile: str | None = None) -> list[str]:
    """Names of the experiments shipped with normlab, in report order; with ``profile``, those that run at it
    (the scaling study runs only at its own profile, so `normlab reproduce` leaves it out)."""
    order = ["phase", "pointwise", "width", "denominator", "coupling", "coupling_sweep", "rank", "beyond"]
    found = {p.name[:-5] for p in resources.files("normlab.experiments").iterdir() if p.name.endswith(".toml")}
    names = [n for n in order if n in found] + sorted(found - set(order))
    if profile is None:
        return names
    return [n for n in names if (ps := load_experiment(n).profiles) is None or profile in ps]


# An experiment TOML's fields and their kinds; a run's own extra keys (paper, flags, cell, ...) are free metadata.
_TOP = {"name": "str", "title": "str", "source": "str", "claim": "str", "runs": "list[table]", "seeds": "list[int]",
        "metrics": "list[str]", "base": "table", "baseline": "str", "checks": "list[table]", "figures": "list[str]",
        "guard": "bool", "mechanism": "list[str]", "profiles": "list[str]"}  # fmt: skip
_RUN = {"name": "str", "label": "str", "set": "table", "shape": "str", "profiles": "list[str]", "budget": "int",
        "lrs": "list[number]", "lr_field": "str"}  # fmt: skip
_KINDS = {"str": str, "int": int, "bool": bool, "table": dict, "number": (int, float)}


def _is(value, kind: str) -> bool:
    if kind.startswith("list["):
        return isinstance(value, list) and all(_is(v, kind[5:-1]) for v in value)
    want = _KINDS[kind]
    return isinstance(value, want) and not (kind in ("int", "number") and isinstance(value, bool))


def check_experiment_fields(d: dict, where: str) -> None:
    """Each field of an experiment TOML has its kind (``_TOP``, ``_RUN``): else one line naming the file and the
    field, what was expected and what was given, before any run is expanded."""
    missing = [k for k in ("name", "runs") if k not in d]
    if missing:
        raise ValueError(f"{where}: missing {', '.join(missing)}")
    unknown = sorted(set(d) - set(_TOP))
    if unknown:
        raise ValueError(f"{where}: unknown field {unknown[0]!r}; an experiment has {', '.join(_TOP)}")
    for key, kind in _TOP.items():
        if key in d and not _is(d[key], kind):
            raise ValueError(f"{where}: {key} must be {kind.replace('table', 'a table')}, got {d[key]!r}")
    if (why := path_segment_error(d["name"])) is not None:  # figures are named after it, inside the report's root
        raise ValueError(f"{where}: name {why}")
    if set(d.get("base", {})) - {"set"} or not _is(d.get("base", {}).get("set", {}), "table"):
        raise ValueError(
            f"{where}: base must be a table with one table, set (e.g. base = {{ set = {{ lr = 1e-3 }} }})"
            f", got {d['base']!r}"
        )
    for i, r in enumerate(d["runs"]):
        for key in ("name", "set"):
            if key not in r:
                raise ValueError(f"{where}: run {i} needs 'name' and 'set'")
        for key, kind in _RUN.items():
            if key in r and not _is(r[key], kind):
                raise ValueError(
                    f"{where}: run {i} ({r.get('name')!r}): {key} must be "
                    f"{kind.replace('table', 'a table')}, got {r[key]!r}"
                )


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
    """A built-in experiment by name, or a TOML file by path; a malformed file raises a clear error."""
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


def expand(exp: Experiment, profile: str, root: str | Path, extra: dict | None = None) -> list[RunSpec]:
    """The runs of ``exp`` at ``profile``, each with a resolved, validated config.

    Overrides apply in order: the profile, the run's shape, the experiment's [base], the run's set, ``extra``.
    A run's ``budget = k`` multiplies the profile's steps by k (16x the default's tokens at ``long``'s 4x);
    a run's ``profiles = [...]`` names the only profiles it runs at (a long cell the demo cannot afford).
    """
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}; valid: {', '.join(PROFILES)}")
    if exp.profiles is not None and profile not in exp.profiles:
        raise ValueError(
            f"{exp.path}: experiment {exp.name!r} runs only at profile {', '.join(exp.profiles)} (not "
            f"{profile!r}): pass --profile {exp.profiles[0]}"
        )
    prof = PROFILES[profile]
    seeds = exp.seeds[: prof["seeds"]] if prof["seeds"] else exp.seeds
    specs = []
    for run in exp.runs:
        if profile not in run.get("profiles", PROFILES):
            continue
        overrides = dict(prof["set"])
        if "shape" in run:
            if run["shape"] not in prof["shapes"]:
                raise ValueError(f"{exp.path}: run {run['name']!r} has unknown shape {run['shape']!r}")
            overrides.update(prof["shapes"][run["shape"]])
        overrides.update(exp.base)
        overrides.update(run["set"])
        overrides.update(extra or {})
        if run.get("budget", 1) != 1:
            overrides["steps"] = run["budget"] * resolve_config(prof["preset"], dict(prof["set"])).steps
        for name, label, lr_set, meta in lr_variants(run):
            for seed in seeds:
                try:
                    cfg = resolve_config(prof["preset"], {**overrides, **lr_set, "seed": seed})
                except (ValueError, TypeError) as e:
                    raise ValueError(f"{exp.path}: run {run['name']!r}: {e}") from None
                if run.get("beta_rms_gain"):  # beta0 = C * sigma0^2 with sigma0 = 0.02: RMSNorm's gain at init
                    cfg.model.norm_kwargs = {**cfg.model.norm_kwargs, "beta_init": cfg.model.width * 0.02**2}
                spec = RunSpec(exp.name, name, label, seed, cfg, meta)
                cfg.out = str(Path(root) / "runs" / spec.run_id)
                specs.append(spec)
    return specs


def lr_variants(run: dict) -> list[tuple[str, str, dict, dict]]:
    """The runs one TOML entry stands for: itself, or with ``lrs = [...]`` one run per learning rate, named
    ``name@lr=0.002`` (``lr_field`` = "muon_lr" sweeps Muon's rate instead). Each variant's meta names the
    sweep it belongs to (``sweep``) and its rate, so the report can pick the best and draw the curve."""
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


@dataclass(frozen=True)
class Workers:
    """How a sweep's runs are spread: ``jobs`` at a time in this process's pool, and this machine's ``shard``
    (i, n): every n-th run from the i-th (``--shard i/n``)."""

    jobs: int = 1
    shard: tuple[int, int] = (0, 1)


def parse_shard(text: str | None) -> tuple[int, int]:
    if not text:
        return 0, 1
    try:
        i, n = (int(v) for v in text.split("/"))
    except ValueError:
        raise ValueError(f"--shard expects i/n (e.g. 0/4), got {text!r}") from None
    if not (n >= 1 and 0 <= i < n):
        raise ValueError(f"--shard i/n needs 0 <= i < n, got {text!r}")
    return i, n


def _run_one(spec: RunSpec) -> tuple[str, str, str]:
    """Train one run (resuming it if it has a checkpoint); any exception becomes a 'failed' record."""
    from normlab.lab.train import train

    folder = RunFolder(spec.config.out)
    resume = folder.checkpoint.exists()  # else: killed before its first checkpoint, or failed before: start over
    try:
        return spec.run_id, train(spec.config, resume=resume, overwrite=not resume, progress=False)["status"], ""
    except RunLocked as e:  # another sweep process is training it: leave it alone
        return spec.run_id, "running elsewhere", str(e)
    except Exception as e:  # noqa: BLE001  (a failed run is recorded; the sweep goes on)
        error = f"{type(e).__name__}: {e}"
        record = {"status": "failed", "error": error, "traceback": traceback.format_exc()}
        folder.path.mkdir(parents=True, exist_ok=True)
        try:
            with folder:  # the failure is written only by the folder's owner, and never over a finished run
                current = read_summary(folder.path) or {}
                if current.get("status") in TERMINAL:  # another process finished it meanwhile
                    return spec.run_id, current["status"], ""
                folder.write_json(SUMMARY, record)
        except RunLocked as locked:
            return spec.run_id, "running elsewhere", str(locked)
        return spec.run_id, "failed", error


def _worker_init(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    try:  # Linux: die with the sweep, so that a killed sweep leaves no run half-owned by an orphan
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def default_jobs() -> int:
    """Parallel runs: one per core on a CPU (tiny models use one thread well), one on a GPU."""
    import torch

    return 1 if torch.cuda.is_available() else max(1, min(os.cpu_count() or 1, 8))


def run_sweep(
    specs: list[RunSpec], *, workers: Workers = Workers(), progress: bool = True, on_done=None
) -> dict[str, str]:
    """Run every spec of this shard that has not finished, ``jobs`` at a time (``workers``); returns
    {run_id: status}.

    ``on_done(spec, status)``, if given, is called in this process as each run ends (a study records it there)."""
    shard, jobs = workers.shard, workers.jobs
    unique = list({s.run_id: s for s in specs}.values())  # a run shared by several tables runs once
    mine = unique[shard[0] :: shard[1]]
    statuses, todo = {}, []
    for spec in mine:
        summary = read_summary(spec.config.out)
        if summary and summary.get("status") in TERMINAL:
            statuses[spec.run_id] = summary["status"]
        else:
            todo.append(spec)
    names = {s.run_id: f"{s.experiment}/{s.name} (seed {s.seed})" for s in todo}
    bar = tqdm(
        total=len(mine), initial=len(statuses), disable=not progress, desc="sweep", unit="run", dynamic_ncols=True
    )

    by_id = {s.run_id: s for s in todo}

    def done(run_id: str, status: str, error: str) -> None:
        statuses[run_id] = status
        if on_done is not None:
            on_done(by_id[run_id], status)
        if error:
            tqdm.write(f"run {names[run_id]} failed: {error}")
        bar.set_postfix_str(f"last: {names[run_id]} {status}")
        bar.update(1)

    if todo and any(s.config.device != "cuda" for s in todo):
        from normlab.kernels import auto_choice, cpu

        if auto_choice() != "reference":
            cpu.ready(wait=True)  # the one-time build of the CPU kernels (if any) once, before the workers start
    try:
        if jobs <= 1:
            for spec in todo:
                bar.set_postfix_str(f"running {names[spec.run_id]}")
                done(*_run_one(spec))
                if statuses[spec.run_id] == "interrupted":  # Ctrl-C / SIGTERM: the run has its checkpoint
                    raise KeyboardInterrupt
        elif todo:
            import multiprocessing as mp

            threads = max(1, (os.cpu_count() or 1) // jobs)
            pool = ProcessPoolExecutor(
                jobs, mp_context=mp.get_context("spawn"), initializer=_worker_init, initargs=(threads,)
            )
            try:
                futures = [pool.submit(_run_one, spec) for spec in todo]
                for fut in as_completed(futures):
                    done(*fut.result())
                    if statuses[fut.result()[0]] == "interrupted":
                        raise KeyboardInterrupt
            finally:  # on Ctrl-C too: it reaches the workers, each checkpoints its run, and none starts another
                pool.shutdown(wait=True, cancel_futures=True)
    except KeyboardInterrupt:
        bar.close()
        finished = sum(1 for v in statuses.values() if v in TERMINAL)
        again = shlex.join(["normlab", *sys.argv[1:]]) if sys.argv[1:] else "the same call"
        tqdm.write(
            f"\nsweep interrupted: {finished} of {len(mine)} runs finished; the runs in flight keep their "
            f"checkpoints. Continue with: {again}",
            file=sys.stderr,
        )
        raise
    bar.close()
    return statuses


def write_index(experiments: list[Experiment], profile: str, root: str | Path) -> Path:
    """<root>/index.json: for each experiment, its runs and their directories (the report reads this)."""
    index = {"profile": profile, "experiments": []}
    for exp in experiments:
        runs = [
            {"name": s.name, "label": s.label, "seed": s.seed, "run_id": s.run_id, "meta": s.meta}
            for s in expand(exp, profile, root)
        ]
        index["experiments"].append(
            {
                "name": exp.name,
                "title": exp.title,
                "source": exp.source,
                "claim": exp.claim,
                "metrics": exp.metrics,
                "baseline": exp.baseline,
                "checks": exp.checks,
                "figures": exp.figures,
                "guard": exp.guard,
                "mechanism": exp.mechanism,
                "runs": runs,
            }
        )
    path = Path(root) / "index.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(index, indent=2) + "\n")
    return path
