"""Fitting one replacement (normlab.conversion.calibrate.fit): the float32 profile solver against the float64 L-BFGS
one."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import normlab
from normlab.conversion.calibrate.fit import fit_replacement
from normlab.conversion.calibrate.sites import per_channel_kwargs
from normlab.conversion.config import CalibrateConfig


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
    fits = {s: fit_replacement(copy.deepcopy(base), x, y, per_channel=per, config=CalibrateConfig(solver=s))
            for s in ("profile", "lbfgs")}  # fmt: skip
    assert fits["profile"].solver == "profile" and fits["lbfgs"].solver == "lbfgs"
    assert fits["profile"].ok
    assert fits["profile"].rel_error <= fits["lbfgs"].rel_error * (1 + 1e-4)


def test_derf_keeps_the_lbfgs_solver_for_its_shift():
    x, y = torch.randn(256, 16), torch.randn(256, 16).tanh()
    assert fit_replacement(normlab.create_norm("derf", 16), x, y).solver == "lbfgs"
    with pytest.raises(ValueError, match="solver"):
        fit_replacement(normlab.create_norm("derf", 16), x, y, config=CalibrateConfig(solver="profile"))


@pytest.mark.parametrize("solver", ["lbfgs", "profile"])
def test_the_solver_asked_for_is_the_solver_every_fit_ran(solver, tmp_path):
    """calibrate.solver reaches every fit, the massive tokens' copies included, from convert_norms and from the
    command line (a first version dropped it on the way to calibrate_sites)."""
    from conftest import sink_batches, tiny_hf, tiny_lm, with_sinks
    from normlab.cli import main

    record = normlab.convert_norms(with_sinks(tiny_lm()), "dyisru", calibrate=sink_batches(1), solver=solver)
    fits = [s.fit for s in record.sites] + [s.fit["massive"] for s in record.sites]
    assert {f["solver"] for f in fits} == {solver}
    text = tmp_path / "t.txt"
    text.write_text("the of and to in a is that " * 400)
    out = tmp_path / "o"
    args = ["convert", "--model", str(tiny_hf(tmp_path / "m")), "--calibrate", str(text), "--seq-len", "16",
            "--sequences", "4", "--eval-text", "none", "--no-progress", "--out", str(out), "--set",
            f"calibrate.solver={solver}"]  # fmt: skip
    assert main(args) == 0
    _, saved = normlab.load_converted(out)
    assert {s.fit["solver"] for s in saved.sites} == {solver}


@pytest.mark.parametrize("solver", ["profile", "lbfgs"])
def test_the_linear_target_fits_its_scale_by_least_squares(solver):
    """issue 87: fixed_scale, w * (alpha x) + b, is linear, so its amplitude and alpha are one number: alpha alone is
    fitted. Per channel it recovers each channel's gain; shared, the least-squares scale sum(g y) / sum(g g); the fit
    is never flagged "linear over the data", which is what it is."""
    torch.manual_seed(0)
    x = torch.randn(2048, 16) * torch.linspace(0.2, 30.0, 16)  # channels of very different sizes
    gain = torch.linspace(0.01, 0.9, 16)
    y = x * gain
    cfg = CalibrateConfig(solver=solver)
    per = normlab.create_norm("fixed_scale", 16, **per_channel_kwargs("fixed_scale"))
    out = fit_replacement(per, x, y, per_channel=True, config=cfg)
    if solver == "profile":  # the default: channel by channel, each exact (L-BFGS's joint loss barely sees the small)
        assert torch.allclose(per.alpha.detach() * per.weight.detach(), gain, rtol=1e-3), per.alpha
    assert out.ok and out.rel_error < 1e-3 and out.amplitude == 1.0 and not out.notes, out
    shared = normlab.create_norm("fixed_scale", 16)
    out = fit_replacement(shared, x, y, config=cfg)
    best = float((x * y).sum() / (x * x).sum())
    assert abs(float(shared.alpha) - best) <= 1e-3 * best and out.ok and not out.notes, (float(shared.alpha), best)
