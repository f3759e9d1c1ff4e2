"""Forward gain G(sigma) = E[ ||N(x)|| / ||x|| ], x ~ N(0, sigma^2 I_d) (the dissection, "The forward gain problem").

Closed forms from the dissection:

* Theorem 1: a point-wise norm N(x)_i = f(x_i) with f(0) = 0 has
  G(sigma) -> |f'(0)| as sigma -> 0 (with a channel affine, the RMS of
  gamma_i f_i'(0)). Its gain is bounded, whatever d.
* Theorem 2: RMSNorm (gamma = 1) has G(sigma) = 1 / sqrt(sigma^2 + eps) to leading
  order, -> 1/sigma. (The seed prints a factor sqrt(d) in front; that contradicts
  its own limit 1/sigma and its proof, ||N(x)|| ~ sqrt(d) over ||x|| ~ sigma sqrt(d),
  so normlab uses the form without it, and tests it against Monte Carlo.)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

import normlab.functional as FN

__all__ = ["gain_curve", "gain_curves", "pointwise_gain_limit", "rms_norm_gain"]


def _total() -> int:
    from normlab.errors import machine_memory

    return machine_memory()


@torch.no_grad()
def gain_curve(
    norm: nn.Module,
    sigmas: Sequence[float],
    *,
    dim: int,
    samples: int = 256,
    seed: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """Monte Carlo G(sigma) and its standard error, for each sigma, from ``samples`` tokens of width ``dim``.

    Args:
        norm: A norm module.
        sigmas: The input standard deviations, each > 0.
        dim: The token width C.
        samples: Tokens per sigma (at least 2).
        seed: Of the tokens.
    """
    sig = np.asarray(sigmas, dtype=float)
    if sig.ndim != 1 or len(sig) == 0 or not np.all(np.isfinite(sig)) or np.any(sig <= 0):
        raise ValueError(f"expected a non-empty list of sigmas > 0, got {list(np.atleast_1d(sig))}")
    if samples < 2:
        raise ValueError(f"expected samples >= 2, got {samples}")
    from normlab.errors import check_memory

    check_memory(
        5 * 8 * samples * dim,
        f"--samples {samples} at width {dim}",
        f"use --samples <= {max(2, int(0.8 * _total() / (40 * dim)))}",
    )  # the tokens, x, y, two norms
    g = torch.Generator().manual_seed(seed)
    p = next(iter(norm.parameters()), None)
    dtype = p.dtype if p is not None else torch.float64
    z = torch.randn(samples, dim, generator=g, dtype=torch.float64)
    means, sems = [], []
    for s in sig:
        x = (z * s).to(dtype)
        ratio = (norm(x).double().norm(dim=-1) / x.double().norm(dim=-1)).numpy()
        means.append(ratio.mean())
        sems.append(ratio.std(ddof=1) / math.sqrt(samples))
    return np.array(means), np.array(sems)


def pointwise_gain_limit(norm: nn.Module, dim: int) -> float:
    """Theorem 1's small-sigma limit for a point-wise norm: the RMS over channels of N_i'(0).

    With a scalar slope f'(0) and gamma = 1 this is |f'(0)|. The bias must be zero
    (f(0) = 0 is the theorem's assumption); a non-zero bias raises.

    Args:
        norm: A point-wise norm module with zero bias.
        dim: The token width C.
    """
    bias = getattr(norm, "bias", None)
    if bias is not None and bool((bias != 0).any()):
        raise ValueError("Theorem 1 assumes f(0) = 0: the layer has a non-zero bias")
    p = next(iter(norm.parameters()), None)
    # the slope at 0+ (sign_sqrt's f is discontinuous at exactly 0, its f'(0+) = 1 / (2 sqrt(eps)))
    x = torch.full((1, dim), 1e-20, dtype=p.dtype if p is not None else torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad(norm(x).sum(), x)  # the diagonal Jacobian of a point-wise map
    return float(grad.double().pow(2).mean().sqrt())


def gain_curves(
    names: Sequence[str],
    sigmas: Sequence[float],
    *,
    dim: int,
    init: dict | None = None,
    samples: int = 256,
    seed: int = 0,
) -> tuple[dict, dict]:
    """G(sigma) of each registered norm (float64, default init plus the keys of ``init`` it takes), and
    Theorem 1's limit for the point-wise ones (None for the others): ({name: (mean, sem)}, {name: limit})."""
    from normlab.registry import create_norm, norm_spec

    curves, limits = {}, {}
    for name in names:
        m = create_norm(name, dim, strict=False, **(init or {})).double().eval()
        curves[name] = gain_curve(m, sigmas, dim=dim, samples=samples, seed=seed)
        limits[name] = pointwise_gain_limit(m, dim) if norm_spec(name).pointwise else None
    return curves, limits


def rms_norm_gain(sigma: np.ndarray | float, eps: float = FN.EPS) -> np.ndarray:
    """Theorem 2: RMSNorm's gain 1 / sqrt(sigma^2 + eps), -> 1/sigma as eps -> 0.

    Args:
        sigma: The input standard deviation(s).
        eps: Added to the mean square under the root.
    """
    return 1.0 / np.sqrt(np.asarray(sigma, dtype=float) ** 2 + eps)
