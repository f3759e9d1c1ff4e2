"""``normlab reproduce``: the theory checks, a sweep covering every table of the dissection, and the report."""

from __future__ import annotations

import json
import time
from pathlib import Path

from normlab.owner import check_folder
from normlab.sweep import Workers, builtin_experiments, expand, load_experiment, run_sweep, write_index

__all__ = ["run_theory", "reproduce"]


def run_theory(root: str | Path, seeds: int = 20) -> Path:
    """The DyISRU paper's outlier fits (both versions) over ``seeds`` samples, the dissection's Jacobian table and
    gain curves."""
    import numpy as np

    from normlab.theory.gain import gain_curves, rms_norm_gain
    from normlab.theory.jacobian import jacobian_table
    from normlab.theory.plots import plot_gain, plot_outlier_fit
    from normlab.theory.simulate import simulate_many, simulate_outliers

    out = Path(root) / "theory"
    out.mkdir(parents=True, exist_ok=True)
    result = {"simulate": {}, "jacobian": jacobian_table(["rms_norm", "dyt"], [1024, 2048], std=0.02,
                                                         init={"alpha_init": 1.0})}  # fmt: skip
    for norm in ("rms_norm", "layer_norm"):
        many = simulate_many(range(seeds), norm=norm)
        result["simulate"][norm] = {"n_seeds": seeds, "stats": many["stats"], "failed": many["failed"]}
        plot_outlier_fit(simulate_outliers(norm=norm), out / f"outlier_fit_{norm}.png")
    names, width = ["rms_norm", "l1_norm", "dyt", "dyt_hardtanh", "dyisru", "sign_sqrt"], 1024
    sigmas = np.logspace(-3, 1, 13)
    curves, limits = gain_curves(names, sigmas, dim=width, init={"alpha_init": 1.0}, samples=32)
    plot_gain(curves, sigmas, out / "gain.png", dim=width, limits=limits, rms_closed_form=rms_norm_gain(sigmas))
    result["gain"] = {n: {"sigma": sigmas.tolist(), "gain": c[0].tolist()} for n, c in curves.items()}
    path = out / "theory.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


def reproduce(
    root: str | Path,
    profile: str = "default",
    *,
    experiments: list[str] | None = None,
    workers: Workers | None = None,
    progress: bool = True,
    compare: str | Path | None = None,
) -> Path:
    """Theory, then every experiment at ``profile`` (spread as ``workers`` says), then REPORT.md. Returns the
    report's path.

    ``compare``: the root of the same experiments at another budget; the report then states each verdict
    at both (see `normlab.report.write_report`).
    """
    from normlab.report import write_report

    workers = workers or Workers()

    t0 = time.perf_counter()
    if compare is not None and not (Path(compare) / "index.json").is_file():  # checked before any run, not after
        raise FileNotFoundError(f"--compare {compare}: no index.json there (run `normlab reproduce` for it first)")
    root = Path(root)
    check_folder(root, "--root")
    exps = [load_experiment(e) for e in (experiments or builtin_experiments(profile))]
    specs = [s for e in exps for s in expand(e, profile, root)]  # validates every config before any work
    write_index(exps, profile, root)
    from normlab.kernels import auto_choice, cpu

    if auto_choice() != "reference":
        cpu.ready(wait=False)  # on a machine without the CPU kernels, their one-time build overlaps the theory checks
    print(f"[1/3] theory checks -> {root / 'theory'}", flush=True)
    run_theory(root, seeds=20 if profile != "quick" else 5)
    n_unique = len({s.run_id for s in specs})
    print(
        f"[2/3] {len(exps)} experiments, {n_unique} distinct runs at profile '{profile}', {workers.jobs} at a time",
        flush=True,
    )
    statuses = run_sweep(specs, workers=workers, progress=progress)
    counts = {s: list(statuses.values()).count(s) for s in sorted(set(statuses.values()))}
    print(f"      runs: {counts}", flush=True)
    elapsed = time.perf_counter() - t0
    report = write_report(root, elapsed_s=elapsed, compare=compare)
    print(f"[3/3] report -> {report}  (total {elapsed / 60:.1f} min)", flush=True)
    return report
