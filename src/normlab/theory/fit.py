"""Fit DyT's alpha or DyISRU's beta to (x, y) pairs from any normalization (the DyISRU paper, Sec. 4.2).

The models are the papers' element-wise forms with an amplitude a:

    dyt:     y = a * tanh(alpha * x)           (the DyISRU paper eq. 12 with a = sqrt(C))
    dyisru:  y = a * x / sqrt(beta + x^2)      (the DyISRU paper eq. 16 with a = sqrt(C))

``a`` is fixed (``scale=`` a number, or "C" / "C-1" for sqrt(C) / sqrt(C-1) of
the channel count) or fitted along with the parameter (``scale=None``). The fit
is by least squares (scipy), globally, per channel, or per group of channels.
The formulas themselves come from `normlab.functional`.

A fit that does not converge is reported in the result (``converged=False``
with a message), never raised, so that a caller fitting many sites goes on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
from scipy.optimize import least_squares

import normlab.functional as FN

__all__ = ["FitResult", "fit_elementwise", "predict"]

Kind = Literal["dyt", "dyisru"]
Per = Literal["global", "channel", "group"]


def predict(kind: Kind, x: np.ndarray, param: np.ndarray | float, amplitude: np.ndarray | float) -> np.ndarray:
    """The fitted model's output, through the reference functions of `normlab.functional`."""
    xt = torch.as_tensor(np.asarray(x, dtype=np.float64))
    p = torch.as_tensor(np.asarray(param, dtype=np.float64))
    a = np.asarray(amplitude, dtype=np.float64)
    if kind == "dyt":
        return a * FN.dyt(xt, p).numpy()
    if kind == "dyisru":  # dyisru(x, beta) carries sqrt(C); divide it out to get the unit-amplitude form
        return a * FN.dyisru(xt, p, scale="C").numpy() / math.sqrt(xt.shape[-1])
    raise ValueError(f"unknown fit kind {kind!r}: expected 'dyt' or 'dyisru'")


@dataclass
class FitResult:
    """The outcome of `fit_elementwise`.

    ``param`` is alpha (dyt) or beta (dyisru): a 0-d array for a global fit,
    shape (C,) per channel, or (n_groups,) per group; ``amplitude`` likewise.
    ``residuals`` = prediction - y, with y's shape.
    """

    kind: str
    per: str
    param: np.ndarray
    amplitude: np.ndarray
    residuals: np.ndarray
    mean_abs_residual: float
    rel_error: float
    converged: bool
    message: str = ""
    group_size: int | None = None
    failed_units: list[int] = field(default_factory=list)

    @property
    def param_name(self) -> str:
        return "alpha" if self.kind == "dyt" else "beta"

    def summary(self) -> dict:
        p = self.param
        out = {
            "kind": self.kind,
            "per": self.per,
            self.param_name: float(p) if p.ndim == 0 else {"mean": float(np.nanmean(p)), "min": float(np.nanmin(p)),
                                                              "max": float(np.nanmax(p))},
            "amplitude": float(self.amplitude) if self.amplitude.ndim == 0 else float(np.nanmean(self.amplitude)),
            "mean_abs_residual": self.mean_abs_residual,
            "rel_error": self.rel_error,
            "converged": self.converged,
        }  # fmt: skip
        if self.message:
            out["message"] = self.message
        return out


MAX_NFEV = 2000  # function evaluations each least-squares fit may take


def _resolve_scale(scale, channels: int) -> float | None:
    if scale is None:
        return None
    if isinstance(scale, str):
        return FN.channel_scale(channels, scale)
    if not math.isfinite(float(scale)) or float(scale) <= 0:
        raise ValueError(f"expected scale to be a number > 0, 'C', 'C-1' or None (fit it), got {scale!r}")
    return float(scale)


def _fit_unit(kind: Kind, x: np.ndarray, y: np.ndarray, amp: float | None, max_nfev: int):
    """Fit one unit (all points of one channel, group, or the whole data). Returns (param, amp, ok, msg)."""
    keep = np.isfinite(x) & np.isfinite(y)
    x, y = x[keep], y[keep]
    if x.size < (1 if amp is not None else 2) or not np.any(x != 0):
        return math.nan, math.nan, False, "not enough non-zero points to fit"
    with np.errstate(over="ignore", invalid="ignore"):
        xx, xy = np.dot(x, x), np.dot(x, y)
    if not (np.isfinite(xx) and np.isfinite(xy)):
        return (
            math.nan,
            math.nan,
            False,
            (
                f"the data overflow float64 (largest |x| {np.abs(x).max():.3g}, |y| "
                f"{np.abs(y).max():.3g}): use smaller inputs (a smaller sigma or outlier)"
            ),
        )
    slope = float(xy / xx)  # a linear fit gives the scale of the slope at 0
    if not math.isfinite(slope) or slope <= 0:
        return math.nan, math.nan, False, f"the data have no positive slope (least-squares slope {slope:.3g})"
    a0 = amp if amp is not None else 1.05 * float(np.abs(y).max())
    p0 = slope / a0 if kind == "dyt" else (a0 / slope) ** 2  # the slope at 0: a * alpha, or a / sqrt(beta)
    model = lambda p, a: predict(kind, x, p, a)  # noqa: E731  (the functional forms, evaluated in float64)
    # fit log(param) (and log(amplitude)): both must stay positive, and both span orders of magnitude
    if amp is None:
        fun = lambda t: model(math.exp(t[0]), math.exp(t[1])) - y  # noqa: E731
        t0 = [math.log(p0), math.log(a0)]
    else:
        fun = lambda t: model(math.exp(t[0]), amp) - y  # noqa: E731
        t0 = [math.log(p0)]
    try:
        res = least_squares(fun, t0, method="lm" if x.size >= len(t0) else "trf", max_nfev=max_nfev)
    except (ValueError, FloatingPointError) as e:
        return math.nan, math.nan, False, f"least squares failed: {e}"
    p = math.exp(res.x[0])
    a = math.exp(res.x[1]) if amp is None else amp
    ok = bool(res.success) and math.isfinite(p) and math.isfinite(a) and 1e-300 < p < 1e300
    return p, a, ok, "" if ok else f"did not converge: {res.message}"


def fit_elementwise(
    x: np.ndarray | torch.Tensor,
    y: np.ndarray | torch.Tensor,
    kind: Kind = "dyisru",
    *,
    scale: float | str | None = "C",
    per: Per = "global",
    group_size: int | None = None,
) -> FitResult:
    """Fit ``kind`` ("dyt": alpha, "dyisru": beta) so that model(x) reproduces y.

    x, y: arrays of one shape. For ``per="channel"`` or ``"group"`` the last axis is the channel axis. ``scale``:
    the amplitude, a number, None (fitted too), or "C" / "C-1" for sqrt(x.shape[-1]) / sqrt(x.shape[-1] - 1). Each fit
    is bounded by `MAX_NFEV` evaluations.

    Args:
        x: The norm's inputs, an array or tensor.
        y: Its outputs, of x's shape.
        kind: "dyt" (fits alpha) or "dyisru" (fits beta).
        scale: The amplitude: a number, None (fitted too), or "C" / "C-1".
        per: "global" (one parameter), "channel" (one per channel, the last axis) or "group".
        group_size: Channels per group, for ``per="group"``.
    """
    if kind not in ("dyt", "dyisru"):
        raise ValueError(f"unknown fit kind {kind!r}: expected 'dyt' or 'dyisru'")
    if per not in ("global", "channel", "group"):
        raise ValueError(f"per must be 'global', 'channel' or 'group', got {per!r}")
    x = np.asarray(x.detach().cpu() if isinstance(x, torch.Tensor) else x, dtype=np.float64)
    y = np.asarray(y.detach().cpu() if isinstance(y, torch.Tensor) else y, dtype=np.float64)
    if x.shape != y.shape or x.size == 0:
        raise ValueError(f"expected x and y of one non-empty shape, got {x.shape} and {y.shape}")
    c = x.shape[-1] if x.ndim else 1
    amp = _resolve_scale(scale, c)

    if per == "global":
        units = [np.arange(c)] if x.ndim else [np.arange(1)]
        flat = True
    else:
        if x.ndim < 1:
            raise ValueError("per-channel or per-group fits need x of shape (..., C)")
        g = 1 if per == "channel" else group_size
        if per == "group" and (not isinstance(g, int) or g < 1):
            raise ValueError(f"per='group' needs group_size, an int >= 1, got {group_size!r}")
        units = [np.arange(s, min(s + g, c)) for s in range(0, c, g)]
        flat = False

    params, amps, failed, msgs = [], [], [], []
    pred = np.empty_like(y)
    for u, idx in enumerate(units):
        xu, yu = (x.ravel(), y.ravel()) if flat else (x[..., idx].ravel(), y[..., idx].ravel())
        p, a, ok, msg = _fit_unit(kind, xu, yu, amp, MAX_NFEV)
        params.append(p)
        amps.append(a)
        if not ok:
            failed.append(u)
            msgs.append(msg)
        if flat:
            pred = predict(kind, x, p, a) if ok else np.full_like(y, np.nan)
        else:
            pred[..., idx] = predict(kind, x[..., idx], p, a) if ok else np.nan

    resid = pred - y
    converged = not failed
    denom = float(np.linalg.norm(y))
    message = ""
    if failed:
        message = f"{len(failed)} of {len(units)} fit(s) did not converge; first: {msgs[0]}"
    return FitResult(
        kind=kind,
        per=per,
        param=np.array(params[0]) if flat else np.array(params),
        amplitude=np.array(amps[0]) if flat else np.array(amps),
        residuals=resid,
        mean_abs_residual=float(np.nanmean(np.abs(resid))) if converged else math.nan,
        rel_error=float(np.linalg.norm(resid) / denom) if converged and denom > 0 else math.nan,
        converged=converged,
        message=message,
        group_size=group_size if per == "group" else None,
        failed_units=failed,
    )
