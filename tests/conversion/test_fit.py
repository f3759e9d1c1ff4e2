"""Fitting one replacement (normlab.conversion.fit): the float32 profile solver against the float64 L-BFGS one."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import normlab
from normlab.conversion.calibrate import per_channel_kwargs
from normlab.conversion.fit import fit_replacement


@pytest.mark.parametrize("to", ["dyisru", "eln", "dyt", "scaled_dyt"])
@pytest.mark.parametrize("per", [False, True])
def test_the_float32_profile_solver_is_as_accurate_as_float64_lbfgs_on_a_massive_channel(to, per):
    """An ill-conditioned site: one channel 300x the others and every 50th token 20x (SmolLM2's sites look like
    this). The profile search (float32) ends at the float64 L-BFGS error or below it."""
    g = torch.Generator().manual_seed(0)
    n, c = 2048, 96
    x = torch.randn(n, c, generator=g)
    x[:, 7] *= 300.0
    x[::50] *= 20.0
    w = torch.rand(c, generator=g) + 0.5
    y = nn.functional.rms_norm(x, (c,), eps=1e-5) * w
    base = normlab.create_norm(to, c, **(per_channel_kwargs(to) if per else {}))
    with torch.no_grad():
        base.weight.copy_(w)
    fits = {s: fit_replacement(copy.deepcopy(base), x, y, per_channel=per, solver=s) for s in ("profile", "lbfgs")}
    assert fits["profile"].solver == "profile" and fits["lbfgs"].solver == "lbfgs"
    assert fits["profile"].ok
    assert fits["profile"].rel_error <= fits["lbfgs"].rel_error * (1 + 1e-4)


def test_derf_keeps_the_lbfgs_solver_for_its_shift():
    x, y = torch.randn(256, 16), torch.randn(256, 16).tanh()
    assert fit_replacement(normlab.create_norm("derf", 16), x, y).solver == "lbfgs"
    with pytest.raises(ValueError, match="solver"):
        fit_replacement(normlab.create_norm("derf", 16), x, y, solver="profile")
