"""The outlier simulation of the DyISRU paper (both versions) (Sec. 4), with DyT and DyISRU fits.

Procedure (the DyISRU paper eqs. 17-18): draw x ~ N(mu, sigma^2) with C channels; for
S = 0, 1, ..., steps set the largest entry to x_o + step * S and normalize
(RMSNorm, the DyISRU paper, or LayerNorm, the DyISRU paper's LayerNorm version). The outlier points (x_o, y_o) for
S >= 1, mirrored to (-x, -y) as the papers do, are fitted by scaled DyT
(eq. 12) and DyISRU (eq. 16) with the amplitude sqrt(C) (RMSNorm) or
sqrt(C-1) (LayerNorm, the DyISRU paper's LayerNorm version eqs. 11 and 15).

For RMSNorm, Theorem 3 predicts the exact DyISRU parameter: beta =
||x without the outlier||^2, which does not change with S. For LayerNorm,
Theorem 4 of the DyISRU paper's LayerNorm version/002 gives beta_i = (C-1) sigma_{!=i}^2 - sigma^2 for the
centered form, and it changes with S, so no single beta is exact.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import numpy as np
import torch

import normlab.functional as FN
from normlab.theory.fit import FitResult, fit_elementwise, predict

__all__ = ["Sample", "OutlierSimulation", "simulate_outliers", "simulate_many", "load_vector"]

NormName = Literal["rms_norm", "layer_norm"]


@dataclass(frozen=True)
class Sample:
    """The token before its outlier grows: ``C`` channels drawn i.i.d. from N(``mu``, ``sigma``^2) with ``seed``
    (the DyISRU paper's eq. 17: C = 100, sigma = 2, mu = 0)."""

    C: int = 100
    sigma: float = 2.0
    mu: float = 0.0
    seed: int | None = 0

    def draw(self) -> np.ndarray:
        return np.random.default_rng(self.seed).normal(self.mu, self.sigma, size=self.C)


@dataclass
class OutlierSimulation:
    C: int
    sigma: float | None
    mu: float | None
    step: float
    steps: int
    norm: str
    scale: str
    seed: int | None
    x: np.ndarray  # (C,) the sample at S = 0
    outlier_index: int
    xs: np.ndarray  # (steps + 1, C) input at each S
    ys: np.ndarray  # (steps + 1, C) normalized output at each S
    dyt: FitResult
    dyisru: FitResult
    reference_beta: float | None  # Theorem 3 (RMSNorm only)
    reference_mean_abs_residual: float | None  # DyISRU with reference_beta on the outliers

    @property
    def outlier_x(self) -> np.ndarray:
        return self.xs[1:, self.outlier_index]

    @property
    def outlier_y(self) -> np.ndarray:
        return self.ys[1:, self.outlier_index]

    @property
    def amplitude(self) -> float:
        return FN.channel_scale(self.C, self.scale)

    def to_dict(self) -> dict:
        return {
            "config": {
                "C": self.C,
                "sigma": self.sigma,
                "mu": self.mu,
                "step": self.step,
                "steps": self.steps,
                "norm": self.norm,
                "scale": self.scale,
                "seed": self.seed,
            },
            "outlier_index": self.outlier_index,
            "outliers": {"x": self.outlier_x.tolist(), "y": self.outlier_y.tolist()},
            "dyt": self.dyt.summary(),
            "dyisru": self.dyisru.summary(),
            "reference_beta": self.reference_beta,
            "reference_mean_abs_residual": self.reference_mean_abs_residual,
            "sample": self.x.tolist(),
        }


def load_vector(path: str | Path) -> np.ndarray:
    """A 1-d sample from a .npy file or a text file of numbers (whitespace or comma separated)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"sample file {str(p)!r} does not exist")
    try:
        if p.suffix == ".npy":
            v = np.load(p, allow_pickle=False)
        elif p.suffix == ".json":
            v = np.asarray(json.loads(p.read_text()), dtype=float)
        else:
            text = p.read_text()
            v = np.loadtxt(p, delimiter="," if "," in text else None, dtype=float)
        return np.asarray(v, dtype=np.float64)
    except (ValueError, TypeError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(
            f"sample file {str(p)!r} is not a list of numbers ({type(e).__name__}: {str(e)[:120]}); "
            "give a .npy array, a JSON list, or text with one number per entry"
        ) from None


def _check(sample: Sample | np.ndarray, step: float, steps: int) -> None:
    if isinstance(sample, np.ndarray):
        x = sample
        if x.ndim != 1:
            raise ValueError(f"expected the sample x to be a vector of shape (C,), got shape {x.shape}")
        if x.shape[0] < 2:
            raise ValueError(f"expected a sample of C >= 2 channels, got C = {x.shape[0]}")
        if not np.all(np.isfinite(x)):
            raise ValueError("the sample x contains non-finite values")
    elif not isinstance(sample, Sample):
        raise TypeError(f"sample: expected a Sample or a vector (C,), got {type(sample).__name__}")
    elif not isinstance(sample.C, int) or sample.C < 2:
        raise ValueError(
            f"expected C (channels) to be an int >= 2, got {sample.C!r}: with one channel there is no outlier"
        )
    elif not math.isfinite(sample.sigma) or sample.sigma <= 0:
        raise ValueError(f"expected sigma > 0, got {sample.sigma!r}")
    if not math.isfinite(step) or step <= 0:
        raise ValueError(f"expected step > 0, got {step!r}")
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"expected steps (S) to be an int >= 1, got {steps!r}")


def _check_range(x: np.ndarray, step: float, steps: int) -> None:
    """Refuse a sample whose sum of squares (the norms' statistic, Theorem 3's beta) overflows float64 once the
    outlier has grown: every row would read inf or NaN."""
    top = float(np.max(np.abs(x))) + step * steps
    if not math.isfinite(top * top * x.shape[0]):
        limit = math.sqrt(np.finfo(np.float64).max / x.shape[0]) / 10
        raise ValueError(
            f"the sample is too large for float64: its largest entry with the outlier grown is {top:.3g}, and the "
            f"sum of squares of C = {x.shape[0]} such entries overflows; keep |x| (sigma, mu, the step) below "
            f"{limit:.2g}"
        )


def simulate_outliers(
    sample: Sample | np.ndarray = Sample(),
    *,
    step: float = 5.0,
    steps: int = 9,
    norm: NormName = "rms_norm",
    scale: str | None = None,
) -> OutlierSimulation:
    """Run the simulation on a seeded `Sample`, or on a given vector (C,) (then C comes from it, and sigma, mu and
    the seed are None): its largest entry grows by ``step``, ``steps`` times (eq. 18), through ``norm``; the fits'
    amplitude is sqrt(``scale``) ("C" or "C-1"; default: the norm's own).

    Args:
        sample: A seeded `Sample`, or a vector (C,).
        step: How much the largest entry grows each step.
        steps: How many steps.
        norm: The norm simulated: "rms_norm" or "layer_norm".
        scale: The fits' amplitude, sqrt("C") or sqrt("C-1"); None: the norm's own.
    """
    if norm not in ("rms_norm", "layer_norm"):
        raise ValueError(
            f"norm must be 'rms_norm' (the DyISRU paper) or 'layer_norm' (its LayerNorm version), got {norm!r}"
        )
    scale = scale or ("C" if norm == "rms_norm" else "C-1")
    if scale not in ("C", "C-1"):
        raise ValueError(f"scale must be 'C' (sqrt(C)) or 'C-1' (sqrt(C-1)), got {scale!r}")
    if not isinstance(sample, Sample):
        sample = np.asarray(sample, dtype=np.float64)
    _check(sample, step, steps)
    if isinstance(sample, Sample):
        x, (C, sigma, mu, seed) = sample.draw(), (sample.C, sample.sigma, sample.mu, sample.seed)
    else:
        x, (C, sigma, mu, seed) = sample, (sample.shape[0], None, None, None)
    _check_range(x, step, steps)
    o = int(np.argmax(x))
    xs = np.repeat(x[None], steps + 1, axis=0)
    xs[:, o] += step * np.arange(steps + 1)  # eq. (18)
    fn = FN.rms_norm if norm == "rms_norm" else FN.layer_norm
    ys = fn(torch.from_numpy(xs), eps=0.0).numpy()

    ox, oy = xs[1:, o], ys[1:, o]
    fx, fy = np.concatenate([ox, -ox]), np.concatenate([oy, -oy])  # mirrored points, as in the papers
    amp = FN.channel_scale(C, scale)
    fits = {}
    for kind in ("dyt", "dyisru"):
        f = fit_elementwise(fx, fy, kind, scale=amp)
        f.residuals = f.residuals[: len(ox)]  # report the positive outliers, as the papers' figures do
        f.mean_abs_residual = float(np.mean(np.abs(f.residuals))) if f.converged else math.nan
        fits[kind] = f

    ref_beta = ref_mar = None
    if norm == "rms_norm":
        ref_beta = float(np.sum(np.delete(x, o) ** 2))  # Theorem 3: ||x without the outlier||^2
        ref_mar = float(np.mean(np.abs(predict("dyisru", ox, ref_beta, amp) - oy)))
    return OutlierSimulation(
        C, sigma, mu, step, steps, norm, scale, seed, x, o, xs, ys, fits["dyt"], fits["dyisru"], ref_beta, ref_mar
    )


def simulate_many(seeds: Iterable[int], sample: Sample = Sample(), **kwargs: object) -> dict:
    """Run `simulate_outliers` on ``sample`` drawn with each seed; the spread of alpha, beta and the residuals.

    Args:
        seeds: The seeds, one simulation each.
        sample: The sample drawn with each seed.
        **kwargs: `simulate_outliers`'s keywords.
    """
    sims = [simulate_outliers(replace(sample, seed=s), **kwargs) for s in seeds]
    cols = {
        "alpha": [s.dyt.param.item() for s in sims],
        "beta": [s.dyisru.param.item() for s in sims],
        "dyt_mean_abs_residual": [s.dyt.mean_abs_residual for s in sims],
        "dyisru_mean_abs_residual": [s.dyisru.mean_abs_residual for s in sims],
    }
    stats = {
        k: {
            "mean": float(np.nanmean(v)),
            "std": float(np.nanstd(v)),
            "min": float(np.nanmin(v)),
            "max": float(np.nanmax(v)),
        }
        for k, v in cols.items()
    }
    return {
        "seeds": list(seeds),
        "per_seed": cols,
        "stats": stats,
        "failed": [s.seed for s in sims if not (s.dyt.converged and s.dyisru.converged)],
    }
