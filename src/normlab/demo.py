"""The norm table: every registered norm on one input, with its gain and a Jacobian check."""

from __future__ import annotations

import torch

from normlab.registry import create_norm, list_norms, norm_spec
from normlab.theory.jacobian import autograd_jacobian, decompose, numerical_jacobian

HEADERS = ["norm", "pointwise", "out RMS", "gain", "|J|_F", "coupling |K|_F", "max|J_autograd - J_numeric|", "note"]


def norm_table(dim: int = 256, std: float = 0.02, seed: int = 0) -> list[list]:
    """One row per registered norm at default init, on one token x ~ N(0, std^2 I_dim), in float64.

    gain is ||N(x)|| / ||x|| (the dissection's forward gain on this token). The last
    numeric column compares the gradient the layer defines (autograd) with
    central finite differences of its forward: ~1e-8 where the backward is the
    true derivative; large, on purpose, for rms_detached.
    """
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(dim, generator=g, dtype=torch.float64) * std
    rows = []
    for name in list_norms():
        spec = norm_spec(name)
        m = create_norm(name, dim).double().eval()
        with torch.no_grad():
            y = m(x)
        jac = autograd_jacobian(m, x)
        err = float((jac - numerical_jacobian(m, x)).abs().max())
        parts = decompose(jac)
        note = ""
        if not spec.exact_grad:
            note = "surrogate backward by design" if err > 1e-4 else "exact at default settings"
        if name == "rms_ema":
            note += " (running_ms = 1 before training)"
        rows.append(
            [
                name,
                "yes" if spec.pointwise else "no",
                float(y.pow(2).mean().sqrt()),
                float(y.norm() / x.norm()),
                parts.total,
                parts.coupling,
                err,
                note,
            ]
        )
    return rows
