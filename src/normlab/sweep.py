"""A sweep runner that survives failure, over experiments as data (`normlab.experiment`).

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

import contextlib
import hashlib
import json
import os
import shlex
import sys
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from normlab.experiment import Experiment, builtin_experiments, check_experiment_fields, load_experiment, lr_variants
from normlab.lab.config import TrainConfig, resolve_config
from normlab.lab.runs import SUMMARY, TERMINAL, RunFolder, RunLocked, read_summary
from normlab.profiles import PROFILES

__all__ = ["PROFILES", "Experiment", "RunSpec", "Workers", "builtin_experiments", "load_experiment", "expand",
           "run_sweep", "parse_shard", "lr_variants", "check_experiment_fields", "heartbeat"]  # fmt: skip

HEARTBEAT_SECONDS = 30.0  # how often a sweep's bar is redrawn while no run ends (a default run takes minutes)


@contextlib.contextmanager
def heartbeat(bar: tqdm, every: float = HEARTBEAT_SECONDS, status: Callable[[], str] | None = None):
    """Redraw ``bar`` every ``every`` seconds while the block runs, so that its elapsed time moves between the
    runs' ends: with two runs in flight for minutes, a bar redrawn only when one ends looks stuck at 0/98.

    Args:
        bar: A tqdm bar (a disabled one draws nothing).
        every: Seconds between redraws.
        status: Called before each redraw; what it returns becomes the bar's postfix (None: the postfix is kept).
    """
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(every):
            if status is not None:
                bar.set_postfix_str(status(), refresh=False)
            bar.refresh()

    thread = threading.Thread(target=beat, name="sweep-heartbeat", daemon=True)
    thread.start()
    try:
        yield bar
    finally:
        stop.set()
        thread.join()


def run_fraction(spec: RunSpec) -> float:
    """How much of ``spec``'s training is done, 0 to 1, from the last step its metrics log records.

    Args:
        spec: A run of the sweep.
    """
    steps = [r["step"] for r in RunFolder(spec.config.out).metrics() if isinstance(r.get("step"), int)]
    return min(1.0, max(steps, default=0) / max(1, spec.config.steps))


def eta_text(todo: list[RunSpec], ended: set[str], start: dict[str, float], seconds: float) -> str:
    """The heartbeat's postfix: the steps done by the runs in flight and, from this sweep's pace so far, the time
    left for its runs, before the first of them ends (tqdm's own rate waits for whole runs).

    Args:
        todo: The runs this sweep trains.
        ended: The run ids among them that ended.
        start: Each run's fraction done when this sweep started (`run_fraction`): a resumed run's earlier steps are
            not this sweep's pace.
        seconds: Seconds since this sweep started them.
    """
    left = [s for s in todo if s.run_id not in ended]
    flying = [(s, run_fraction(s)) for s in left]
    done = sum(1.0 - start.get(i, 0.0) for i in ended) + sum(max(0.0, f - start.get(s.run_id, 0.0)) for s, f in flying)
    busy = [f for _, f in flying if f > 0]
    text = f"in flight: {len(busy)} at {100 * sum(busy) / len(busy):.0f}% of their steps" if busy else ""
    text = text or "no run in flight"
    if done <= 0.01 or not left:
        return text
    remaining = sum(1.0 - f for _, f in flying)
    return f"{text}; about {max(1, round(seconds * remaining / done / 60))} min left"


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


def expand(exp: Experiment, profile: str, root: str | Path, extra: dict | None = None) -> list[RunSpec]:
    """The runs of ``exp`` at ``profile``, each with a resolved, validated config.

    Overrides apply in order: the profile, the run's shape, the experiment's [base], the run's set, ``extra``.
    A run's ``budget = k`` multiplies the profile's steps by k (16x the default's tokens at ``long``'s 4x);
    a run's ``profiles = [...]`` names the only profiles it runs at (a long cell the demo cannot afford).

    Args:
        exp: The experiment.
        profile: A profile name (``default``, ``quick``, ...).
        root: The sweep's output folder.
        extra: Overrides applied last (dotted keys).
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


@dataclass(frozen=True)
class Workers:
    """How a sweep's runs are spread: ``jobs`` at a time in this process's pool, and this machine's ``shard``
    (i, n): every n-th run from the i-th (``--shard i/n``)."""

    jobs: int = 1
    shard: tuple[int, int] = (0, 1)


def parse_shard(text: str | None) -> tuple[int, int]:
    """``--shard i/n`` as (i, n): this machine runs every n-th run from the i-th; None or empty: (0, 1).

    Args:
        text: ``i/n``, or None.
    """

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
    specs: list[RunSpec],
    *,
    workers: Workers = Workers(),
    progress: bool = True,
    on_done: Callable[[RunSpec, str], None] | None = None,
) -> dict[str, str]:
    """Run every spec of this shard that has not finished, ``jobs`` at a time (``workers``); returns
    {run_id: status}.

    ``on_done(spec, status)``, if given, is called in this process as each run ends (a study records it there).

    Args:
        specs: The runs (`expand`).
        workers: Runs at a time and this machine's shard.
        progress: Show a progress bar.
        on_done: Called as ``on_done(spec, status)`` as each run ends; None: nothing.
    """
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
        start, began = {s.run_id: run_fraction(s) for s in todo}, time.monotonic()

        def status() -> str:
            return eta_text(todo, {i for i in by_id if i in statuses}, start, time.monotonic() - began)

        with heartbeat(bar, every=HEARTBEAT_SECONDS, status=status):  # the bar moves while no run ends
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
