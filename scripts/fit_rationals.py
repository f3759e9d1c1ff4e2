"""Fit the CPU kernels' tanh and erf: odd rationals z P(z^2) / Q(z^2), one accuracy per storage dtype.

    python scripts/fit_rationals.py

Each function is fitted on (0, range] by Lawson's algorithm (iteratively reweighted least squares on the linearised
relative error, keeping the best maximum), with P(0) fixed at the function's exact slope at 0 and Q(0) = 1. Each
fitted rational rises a little above 1 before it turns back down; the kernel evaluates it at z clamped to a point
``clamp`` where it is already above 1 (by two float32 ulps, a margin for the reciprocal's own error) and then takes
min(., 1): every |z| >= clamp gives sign(z) itself, with no comparison or blend. The script finds the smallest such
clamp (in steps of 0.01, below the rational's maximum) and prints it with the coefficients as C++ for
src/normlab/kernels/csrc/cpu_norms.cpp, and the maximum relative error of the whole function (the rational evaluated
in float32 with fused multiply-adds, then min(., 1)) over two million points from 1e-30 to twice the clamp.
tests/kernels/test_cpu_edges.py measures the compiled kernels the same way.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.polynomial import polynomial as P
from scipy.special import erf

# name: (function, slope at 0, degree of P and of Q in z^2, fitted range), for float32 and bfloat16 / float16 inputs.
# TANH16 is fitted past its clamp: a [2/3] rational fitted on (0, 6] peaks at 0.99998 and never reaches 1, and one that
# reaches 1 ([2/3] on (0, 6.5], 1.3e-5) put the fp16 alpha gradient of a 1 x 128 DyT 5.2e-3 of its size off (the
# tolerance is 4e-3; test_pointwise_family); [3/3] on (0, 7] is 1.6e-6 for one more multiply-add.
FITS = {
    "TANH32": (np.tanh, 1.0, 4, 4, 9.0),
    "TANH16": (np.tanh, 1.0, 3, 3, 7.0),
    "ERF32": (erf, 2 / math.sqrt(math.pi), 5, 5, 3.92),
    "ERF16": (erf, 2 / math.sqrt(math.pi), 3, 3, 3.3),
}
ABOVE_ONE = np.float32(1 + 2**-22)  # the rational at the clamp is at least this: two ulps above 1


def fit(f, slope: float, n_p: int, n_q: int, cut: float, iters: int = 200) -> tuple[np.ndarray, np.ndarray]:
    z = np.sort(np.concatenate([np.linspace(1e-3, cut, 6000), np.geomspace(1e-3, 0.5, 500)]))
    s, t = z * z, f(z)
    weights, best = np.ones_like(z), None
    for _ in range(iters):
        # z P(s) / Q(s) = t  <=>  z (P(s) - slope) / t - (Q(s) - 1) = 1 - slope z / t, linear in the unknowns
        a = np.hstack([(z[:, None] * s[:, None] ** np.arange(1, n_p + 1)) / t[:, None],
                       -(s[:, None] ** np.arange(1, n_q + 1))])  # fmt: skip
        w = np.sqrt(weights)[:, None]
        coef = np.linalg.lstsq(a * w, (1 - slope * z / t) * w[:, 0], rcond=None)[0]
        p, q = np.concatenate([[slope], coef[:n_p]]), np.concatenate([[1.0], coef[n_p:]])
        err = np.abs(z * P.polyval(s, p) / P.polyval(s, q) / t - 1)
        if best is None or err.max() < best[0]:
            best = (err.max(), p, q)
        weights = weights * (err + 1e-30)
        weights /= weights.sum()
    return best[1].astype(np.float32), best[2].astype(np.float32)


def horner(c: np.ndarray, s: np.ndarray) -> np.ndarray:
    acc = np.full_like(s, c[-1])
    for ck in c[-2::-1]:  # a fused multiply-add: one rounding of the exact product and sum
        acc = (acc.astype(np.float64) * s + np.float64(ck)).astype(np.float32)
    return acc


def rational(p: np.ndarray, q: np.ndarray, z: np.ndarray) -> np.ndarray:
    s = (z * z).astype(np.float32)
    return (z * horner(p, s) / horner(q, s)).astype(np.float32)


def clamp_point(p: np.ndarray, q: np.ndarray, start: float) -> float:
    """The smallest multiple of 0.01 from ``start`` / 2 where the rational is at least ABOVE_ONE. It must lie below the
    rational's peak, where the rational still rises, so that every z between 1's crossing and the clamp gives 1."""
    z = np.arange(round(start * 50), round(start * 600)) / 100.0
    r = rational(p, q, z.astype(np.float32))
    first = int(np.argmax(r >= ABOVE_ONE))
    if r[first] < ABOVE_ONE or z[int(np.argmax(r))] <= z[first]:
        raise RuntimeError("the rational does not rise above 1 before its peak: fit it on a longer range")
    return float(z[first])


def max_relative_error(f, p, q, clamp: float) -> float:
    z = np.geomspace(1e-30, 2 * clamp, 2_000_000).astype(np.float32)
    got = np.minimum(rational(p, q, np.minimum(z, np.float32(clamp))), np.float32(1.0))
    want = f(z.astype(np.float64))
    return float(np.max(np.abs(got / want - 1)))


def literal(v: float) -> str:
    text = f"{v:.9g}"
    return f"{text}f" if any(ch in text for ch in ".e") else f"{text}.0f"


def main() -> None:
    for name, (f, slope, n_p, n_q, cut) in FITS.items():
        p, q = fit(f, slope, n_p, n_q, cut)
        clamp = clamp_point(p, q, cut * 0.8)
        err = max_relative_error(f, p, q, clamp)
        print(f"// {name}: [{n_p}/{n_q}] fitted on (0, {cut}], clamped at {clamp}: "
              f"max relative error {err:.3g} ({err / 2**-23:.2f} eps)")  # fmt: skip
        for part, c in (("P", p), ("Q", q)):
            print(f"constexpr float {name}_{part}[] = {{{', '.join(literal(v) for v in c)}}};")
        print(f"constexpr float {name}_CLAMP = {literal(clamp)};")


if __name__ == "__main__":
    main()
