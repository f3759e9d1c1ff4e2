"""Figures of the theory tools (matplotlib, written to PNG; no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from normlab.theory.fit import predict  # noqa: E402
from normlab.theory.simulate import OutlierSimulation  # noqa: E402

COLORS = {"dyt": "tab:red", "dyisru": "tab:blue"}


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_outlier_steps(sim: OutlierSimulation, path: str | Path) -> Path:
    """Fig. 2 of the DyISRU paper's LayerNorm version / Fig. 3 (top) of the DyISRU paper: the sample and its
    normalization at S = 0, 1, 2 and the last step."""
    shown = sorted({0, 1, min(2, sim.steps), sim.steps})
    fig, axes = plt.subplots(1, len(shown), figsize=(3.6 * len(shown), 3.4), sharey=True)
    o = sim.outlier_index
    lim = sim.amplitude * 1.1
    for ax, s in zip(np.atleast_1d(axes), shown):
        rest = np.arange(sim.C) != o
        ax.scatter(sim.xs[s, rest], sim.ys[s, rest], facecolors="none", edgecolors="gray", s=14, label="sample")
        style = {"color": "black"} if s else {"facecolors": "none", "edgecolors": "black"}
        ax.scatter(sim.xs[s, o], sim.ys[s, o], s=30, **style, label="largest entry")
        for sgn in (-1, 1):
            ax.axhline(sgn * sim.amplitude, ls=":", c="k", lw=0.8)
        ax.set_title(f"S = {s}")
        ax.set_xlabel("x")
        ax.set_ylim(-lim, lim)
    np.atleast_1d(axes)[0].set_ylabel(f"y = {sim.norm}(x)")
    np.atleast_1d(axes)[0].legend(loc="upper left", fontsize=8)
    fig.suptitle(f"Stepwise outlier simulation: C={sim.C}, step {sim.step}, {sim.norm}", y=1.04)
    return _save(fig, path)


def plot_outlier_fit(sim: OutlierSimulation, path: str | Path) -> Path:
    """The DyISRU paper Fig. 3 (center, bottom): DyT and DyISRU fitted on the outliers, and their residuals."""
    fig, (top, bot) = plt.subplots(2, 1, figsize=(7, 7), height_ratios=[2.2, 1], sharex=True)
    o = sim.outlier_index
    rest = np.arange(sim.C) != o
    top.scatter(sim.xs[:, rest].ravel(), sim.ys[:, rest].ravel(), facecolors="none", edgecolors="lightgray", s=10)
    ox, oy = sim.outlier_x, sim.outlier_y
    top.scatter(np.r_[ox, -ox], np.r_[oy, -oy], c="black", s=22, zorder=3, label="outliers (and mirrored)")
    grid = np.linspace(-1.1 * ox.max(), 1.1 * ox.max(), 400)
    for fit in (sim.dyt, sim.dyisru):
        if fit.converged:
            label = f"{fit.kind}: {fit.param_name} = {fit.param.item():.4g}, mean |res| = {fit.mean_abs_residual:.3g}"
            top.plot(grid, predict(fit.kind, grid, fit.param, fit.amplitude), c=COLORS[fit.kind], label=label)
            bot.plot(ox, fit.residuals, "o-", c=COLORS[fit.kind], label=fit.kind)
    for sgn in (-1, 1):
        top.axhline(sgn * sim.amplitude, ls=":", c="k", lw=0.8)
    top.set_ylabel("y")
    top.legend(fontsize=8, loc="upper left")
    top.set_title(f"Fits to the outliers of {sim.norm}, C={sim.C}, amplitude sqrt({sim.scale})")
    bot.axhline(0, c="k", lw=0.8)
    bot.set_xlabel("x (outlier)")
    bot.set_ylabel("fit - data")
    bot.legend(fontsize=8)
    return _save(fig, path)


def plot_gain(
    curves: dict,
    sigmas: np.ndarray,
    path: str | Path,
    *,
    dim: int,
    limits: dict | None = None,
    rms_closed_form: np.ndarray | None = None,
) -> Path:
    """The dissection's forward gain: Monte Carlo G(sigma) per norm, log-log, with the closed forms dashed."""
    fig, ax = plt.subplots(figsize=(7, 5))
    for i, (name, (mean, sem)) in enumerate(curves.items()):
        color = f"C{i}"
        ax.errorbar(sigmas, mean, yerr=sem, marker="o", ms=3, c=color, label=name)
        if limits and limits.get(name) is not None:
            ax.axhline(limits[name], c=color, ls=":", lw=1)
    if rms_closed_form is not None:
        ax.plot(sigmas, rms_closed_form, "k--", lw=1.5, zorder=5, label="Theorem 2 (RMSNorm): 1/sqrt(sigma^2 + eps)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("input std sigma")
    ax.set_ylabel("G(sigma) = E ||N(x)|| / ||x||")
    ax.set_title(f"Forward gain at width {dim} (dotted: Theorem 1 limit |f'(0)|)")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    return _save(fig, path)
