"""The NumPy reference ``dynamic_tanh`` of the dynamic_tanh exercise, with its exact output format."""

from __future__ import annotations

import numpy as np

__all__ = ["dynamic_tanh"]


def dynamic_tanh(x: np.typing.ArrayLike, alpha: float, gamma: np.typing.ArrayLike, beta: np.typing.ArrayLike) -> list:
    """DyT(x) = gamma * tanh(alpha * x) + beta, rounded to 4 decimals, as a nested list.

    ``x`` has shape (..., C); ``gamma`` and ``beta`` have shape (C,) and broadcast
    over the last (channel) axis; ``alpha`` is a scalar. Rounding is NumPy's
    (round half to even), applied once to the final value.

    ```python
    dynamic_tanh([[[0.14115588, 0.00372817, 0.24126647, 0.22183601]]], 0.5, [1, 1, 1, 1], [0, 0, 0, 0])
    # [[[0.0705, 0.0019, 0.1201, 0.1105]]]
    ```

    Args:
        x: An array of shape (..., C).
        alpha: A scalar.
        gamma: (C,).
        beta: (C,).
    """
    if not isinstance(alpha, (int, float, np.integer, np.floating)) or isinstance(alpha, bool):
        raise ValueError(f"dynamic_tanh: expected alpha to be a real number, got {alpha!r}")
    for name, v in (("x", x), ("gamma", gamma), ("beta", beta)):
        if np.iscomplexobj(np.asarray(v)):
            raise ValueError(f"dynamic_tanh: expected real numbers in {name}, got complex values")
    x = np.asarray(x, dtype=np.float64)
    gamma = np.asarray(gamma, dtype=np.float64)
    beta = np.asarray(beta, dtype=np.float64)
    if x.ndim == 0:
        raise ValueError("dynamic_tanh: expected x of shape (..., C), got a scalar")
    c = x.shape[-1]
    for name, p in (("gamma", gamma), ("beta", beta)):
        if p.shape != (c,):
            raise ValueError(f"dynamic_tanh: expected {name} of shape ({c},) to match x's last axis, got {p.shape}")
    if np.ndim(alpha) != 0:
        raise ValueError(f"dynamic_tanh: expected a scalar alpha, got shape {np.shape(alpha)}")
    y = gamma * np.tanh(float(alpha) * x) + beta
    return np.round(y, 4).tolist()
