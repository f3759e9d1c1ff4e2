"""The theorems of the DyISRU paper-003 as tests, and the paper's numbers from the outlier simulation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import normlab
import normlab.functional as FN
from normlab.theory import (
    Sample,
    autograd_jacobian,
    decompose,
    derf_jacobian,
    dyisru_jacobian,
    dyt_jacobian,
    fit_elementwise,
    gain_curve,
    jacobian_table,
    layer_norm_jacobian,
    numerical_jacobian,
    pointwise_gain_limit,
    rms_norm_gain,
    rms_norm_jacobian,
    rms_norm_jacobian_eq6,
    rms_norm_terms,
    scaled_dyt_jacobian,
    simulate_many,
    simulate_outliers,
)

WIDTHS = [1, 2, 7, 100, 1024]


def _rel(a, b, scale=None):
    """Max error relative to ``scale``, by default the largest entry of b."""
    scale = b.abs().max().clamp_min(1e-300) if scale is None else scale
    return float((a - b).abs().max() / scale)


@pytest.mark.parametrize("c", WIDTHS)
def test_closed_form_jacobians_equal_autograd(c):
    g = torch.Generator().manual_seed(c)
    x = torch.randn(c, generator=g, dtype=torch.float64) * 1.3
    w = 1 + 0.3 * torch.randn(c, generator=g, dtype=torch.float64)
    alpha, beta = 0.7, 2.5
    # RMSNorm's J is a difference of two terms of size |gamma| / r (at C = 1 they cancel to gamma eps / r^3),
    # so its error is measured relative to that size; the other Jacobians relative to their largest entry.
    gain = float(w.abs().max() / torch.sqrt(x.pow(2).mean()))
    cases = [
        (rms_norm_jacobian(x, w, 1e-6), lambda t: FN.rms_norm(t, w, 1e-6), gain),
        (layer_norm_jacobian(x, w, 1e-5), lambda t: FN.layer_norm(t, w, None, 1e-5), None),
        (dyt_jacobian(x, alpha, w), lambda t: FN.dyt(t, alpha, w), None),
        (scaled_dyt_jacobian(x, alpha, w), lambda t: FN.scaled_dyt(t, alpha, w), None),
        (derf_jacobian(x, alpha, 0.3, w), lambda t: FN.derf(t, alpha, 0.3, w), None),
        (dyisru_jacobian(x, beta, w), lambda t: FN.dyisru(t, beta, w), None),
    ]
    if c > 1:  # eq. (6) is for eps = 0; at C = 1 both sides are 0
        cases.append((rms_norm_jacobian_eq6(x), lambda t: FN.rms_norm(t, eps=0.0), gain))
    for closed, fn, scale in cases:
        auto = autograd_jacobian(fn, x)
        if auto.abs().max() == 0:
            assert closed.abs().max() == 0
        else:
            assert _rel(closed, auto, scale) < 1e-10


def test_autograd_jacobian_matches_finite_differences_for_registered_norms():
    x = torch.randn(9, dtype=torch.float64)
    for name in normlab.list_norms():
        m = normlab.create_norm(name, 9).double().eval()
        auto, num = autograd_jacobian(m, x), numerical_jacobian(m, x)
        if name == "rms_detached":  # its backward drops the coupling term on purpose
            terms = rms_norm_terms(x, m.weight.detach(), m.eps)
            assert _rel(auto, terms[0]) < 1e-10 and _rel(num, terms[0] + terms[1]) < 1e-6
        else:
            assert _rel(auto, num) < 1e-6, name


def test_rms_norm_split_matches_seed_003():
    x = torch.randn(64, dtype=torch.float64)
    d, k = rms_norm_terms(x)
    assert torch.linalg.matrix_rank(k) == 1
    torch.testing.assert_close(d + k, autograd_jacobian(lambda t: FN.rms_norm(t), x))


@pytest.mark.parametrize("c", [1, 10, 100])
def test_scaled_dyt_solves_theorem_2_ode(c):
    """The DyISRU paper Theorem 2, checked with a numerical derivative.

    y = sqrt(C) tanh(alpha x) solves dy/dx = alpha sqrt(C) (1 - y^2/C). The paper
    prints the coefficient as sqrt(alpha C) (eq. 10, from ||x|| -> 1/sqrt(alpha));
    with that coefficient the solution is sqrt(C) tanh(sqrt(alpha) x). Both are checked.
    """
    alpha, h = 0.3, 1e-5
    x = torch.linspace(-20, 20, 401, dtype=torch.float64)
    y = lambda t, a: FN.scaled_dyt(t.unsqueeze(-1).expand(-1, c), a)[:, 0]  # noqa: E731
    for a, coef in ((alpha, alpha * math.sqrt(c)), (math.sqrt(alpha), math.sqrt(alpha * c))):
        dydx = (y(x + h, a) - y(x - h, a)) / (2 * h)
        rhs = coef * (1 - y(x, a) ** 2 / c)
        torch.testing.assert_close(dydx, rhs, rtol=1e-7, atol=1e-8)
        assert float(y(torch.zeros(1, dtype=torch.float64), a)) == 0.0  # eq. (11)


def test_rms_norm_rearrangement_eq13():
    for c in (2, 7, 100):
        x = torch.randn(c, dtype=torch.float64)
        rest = [torch.cat([x[:i], x[i + 1 :]]).pow(2).sum() for i in range(c)]  # ||x_{\\i}||^2, eq. (14)
        y13 = torch.stack([math.sqrt(c) * x[i] / torch.sqrt(rest[i] + x[i] ** 2) for i in range(c)])
        torch.testing.assert_close(y13, FN.rms_norm(x, eps=0.0), rtol=1e-14, atol=1e-14)


# -------------------------------------------------------------------- simulation
def test_dyisru_with_reference_beta_reproduces_rms_norm_on_the_outlier():
    sim = simulate_outliers(Sample(seed=3))
    assert sim.reference_beta == pytest.approx(float(np.sum(np.delete(sim.x, sim.outlier_index) ** 2)))
    assert sim.reference_mean_abs_residual < 1e-12
    assert sim.dyisru.param.item() == pytest.approx(sim.reference_beta, rel=1e-6)  # the fit finds it


@pytest.mark.parametrize("norm", ["rms_norm", "layer_norm"])
def test_paper_numbers_over_20_seeds(norm):
    """The DyISRU paper (both versions), Sec. 4: mean |residual| ~0.33 for DyT, < 0.01 for DyISRU; alpha ~0.049,
    beta ~301 (one sample)."""
    stats = simulate_many(range(20), norm=norm)["stats"]
    assert 0.28 < stats["dyt_mean_abs_residual"]["mean"] < 0.38
    assert stats["dyisru_mean_abs_residual"]["mean"] < 0.01
    assert stats["dyisru_mean_abs_residual"]["max"] < 0.05
    assert stats["dyt_mean_abs_residual"]["min"] > 10 * stats["dyisru_mean_abs_residual"]["max"]
    assert 0.04 < stats["alpha"]["mean"] < 0.06
    assert 200 < stats["beta"]["mean"] < 500
    if norm == "rms_norm":  # Theorem 3 makes DyISRU exact on RMSNorm data
        assert stats["dyisru_mean_abs_residual"]["max"] < 1e-10


def test_user_supplied_sample_is_used_exactly(tmp_path):
    x = np.random.default_rng(7).normal(0, 2, size=100)
    np.save(tmp_path / "x.npy", x)
    np.savetxt(tmp_path / "x.txt", x)
    from normlab.theory.simulate import load_vector

    a = simulate_outliers(load_vector(tmp_path / "x.npy"))
    b = simulate_outliers(load_vector(tmp_path / "x.txt"))
    np.testing.assert_array_equal(a.x, x)
    assert a.dyt.param.item() == pytest.approx(b.dyt.param.item(), rel=1e-12)


@pytest.mark.parametrize(
    "sample,kwargs,match",
    [
        (Sample(C=1), {}, r"C \(channels\) to be an int >= 2"),
        (Sample(sigma=0.0), {}, "sigma > 0"),
        (Sample(sigma=-1.0), {}, "sigma > 0"),
        (Sample(), {"steps": 0}, "steps"),
        (np.zeros((3, 4)), {}, r"shape \(C,\), got shape \(3, 4\)"),
        (np.array([1.0, np.inf, 2.0]), {}, "non-finite"),
        (Sample(), {"norm": "dyt"}, "norm must be"),
    ],
)
def test_simulation_bad_input(sample, kwargs, match):
    with pytest.raises(ValueError, match=match):
        simulate_outliers(sample, **kwargs)


# -------------------------------------------------------------------- fitting
def test_fit_recovers_parameters_per_channel_and_group():
    rng = np.random.default_rng(0)
    x = rng.normal(0, 3, size=(500, 6))
    alphas = np.array([0.2, 0.5, 1.0, 0.3, 0.8, 0.1])
    fit = fit_elementwise(x, np.tanh(alphas * x), "dyt", scale=1.0, per="channel")
    assert fit.converged
    np.testing.assert_allclose(fit.param, alphas, rtol=1e-6)
    betas = np.array([1.0, 1.0, 1.0, 9.0, 9.0, 9.0])
    y = 2.0 * x / np.sqrt(betas + x**2)
    fit = fit_elementwise(x, y, "dyisru", scale=None, per="group", group_size=3)
    np.testing.assert_allclose(fit.param, [1.0, 9.0], rtol=1e-5)
    np.testing.assert_allclose(fit.amplitude, [2.0, 2.0], rtol=1e-6)
    assert fit.rel_error < 1e-6


def test_fit_that_cannot_converge_says_so():
    x = np.linspace(-1, 1, 50)
    fit = fit_elementwise(x, -x, "dyisru", scale=1.0)  # a decreasing map: no positive beta can fit it
    assert not fit.converged
    assert "no positive slope" in fit.message
    assert math.isnan(fit.mean_abs_residual)


# -------------------------------------------------------------------- gain and table
def test_rms_norm_gain_is_theorem_2():
    m = normlab.create_norm("rms_norm", 512).double()
    sigmas = np.array([1e-3, 1e-2, 0.1, 1.0, 10.0])
    mean, sem = gain_curve(m, sigmas, dim=512, samples=512)
    # Theorem 2 is the leading order; E[1/sqrt(chi2_d / d)] = 1 + O(1/d), so allow 4 standard errors + 1/d
    theory = rms_norm_gain(sigmas, m.eps)
    assert np.all(np.abs(mean / theory - 1) < 4 * sem / theory + 1 / 512)
    assert not np.allclose(mean, math.sqrt(512) * rms_norm_gain(sigmas, m.eps), rtol=0.5)  # no sqrt(d) factor


@pytest.mark.parametrize("name,limit", [("dyt", 1.0), ("dyt_hardtanh", 1.0), ("dyt_sigmoid", 0.5), ("tanh_fixed", 1.0)])
def test_pointwise_gain_is_bounded_theorem_1(name, limit):
    kwargs = {"alpha_init": 1.0} if name.startswith("dyt") else {}
    m = normlab.create_norm(name, 256, **kwargs).double()
    assert pointwise_gain_limit(m, 256) == pytest.approx(limit, rel=1e-12)
    mean, _ = gain_curve(m, [1e-4, 1e-2, 1.0], dim=256)
    assert mean[0] == pytest.approx(limit, rel=1e-6)
    assert np.all(mean <= limit + 1e-9)  # bounded, whatever the width


def test_seed_003_jacobian_table():
    rows = {
        (r["width"], r["norm"]): r
        for r in jacobian_table(["rms_norm", "dyt"], [1024, 2048], std=0.02, init={"alpha_init": 1.0})
    }
    for width, diag in ((1024, 1600), (2048, 2260)):
        r = rows[(width, "rms_norm")]
        assert r["diag"] == pytest.approx(diag, rel=0.03)
        assert r["coupling"] == pytest.approx(50, rel=0.03)
        assert r["total"] == pytest.approx(diag, rel=0.03)
    assert rows[(1024, "dyt")]["total"] == pytest.approx(32, rel=0.03)
    assert rows[(2048, "dyt")]["total"] == pytest.approx(45, rel=0.03)
    assert rows[(1024, "dyt")]["coupling"] == 0.0


def test_decompose_pointwise_has_no_coupling():
    x = torch.randn(33, dtype=torch.float64)
    parts = decompose(autograd_jacobian(normlab.create_norm("dyisru", 33).double(), x))
    assert parts.coupling == 0.0 and parts.diag == parts.total
