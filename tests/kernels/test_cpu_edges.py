"""The CPU kernels' arithmetic (csrc/cpu_norms.cpp) at its edges: each approximation's stated bound over its whole
range, huge, tiny, denormal, NaN and inf inputs and parameters, reduced-precision stores, and the backward that reads
a saved f. tests/kernels/test_cpu_build.py also runs this file against another instruction set's build.
"""

from __future__ import annotations

import math

import kernel_checks as KC
import pytest
import torch

import normlab
import normlab.functional as FN
from normlab.kernels import cpu

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _inputs(m, n, dtype, seed=0):
    return KC.inputs(m, n, dtype, "cpu", seed)


def test_tanh_is_accurate_over_the_whole_range():
    """The kernel's tanh (DyT with alpha = w = 1), against float64, from denormals to saturation."""
    z = torch.cat(
        [
            torch.logspace(-40, 2, 20000),
            -torch.logspace(-40, 2, 20000),
            torch.randn(100000) * 3,
            torch.tensor([0.0, -0.0, math.inf, -math.inf]),
        ]
    )
    got = cpu.dyt(z.reshape(-1, 12), torch.ones(1), torch.ones(12)).reshape(-1)  # a full vector and a tail
    want = torch.tanh(z.double())
    ulp = torch.finfo(torch.float32).eps * want.abs().clamp_min(torch.finfo(torch.float32).tiny)
    assert float(((got.double() - want).abs() / ulp).max()) <= 4  # within 4 ulp everywhere
    nonzero = want != 0  # y = w tanh(z) + b: the bias turns -0 into +0
    assert torch.equal(torch.signbit(got)[nonzero], torch.signbit(want.float())[nonzero])


def test_derf_derivative_is_float32_exp_over_the_whole_range():
    """Derf's backward computes exp(-z^2) with its own exp (vscalefps and a degree-5 polynomial on AVX-512): within
    4 eps of float32 exp(-(z*z)) wherever the result is a normal float, within a few denormal steps below, 0 at
    +-inf and NaN at NaN. With alpha = g = w = 1 and shift 0, dx = 2/sqrt(pi) exp(-x^2)."""
    assert cpu.ready(wait=True)
    z = torch.cat([torch.linspace(-11, 11, 400000), torch.randn(40000) * 2])
    z = torch.cat([z, torch.tensor([math.inf, -math.inf, math.nan, 0.0, -0.0, 1e30, -1e20, 10.3])])
    z = z[: z.numel() // 16 * 16].reshape(-1, 16).contiguous()
    dx = torch.ops.normlab_cpu.pointwise_bwd(
        torch.ones_like(z), z, torch.ones(1), torch.zeros(1), torch.ones(16), None, 1.0, 1
    )[0]
    want = 2 / math.sqrt(math.pi) * torch.exp(-(z * z))  # float32, from the same rounded z^2
    normal = want.abs() >= torch.finfo(torch.float32).tiny
    rel = ((dx.double() - want.double()).abs() / want.double())[normal]
    assert float(rel.max()) <= 4 * torch.finfo(torch.float32).eps, float(rel.max()) / torch.finfo(torch.float32).eps
    below = torch.isfinite(z) & ~normal
    assert float((dx.double() - want.double())[below].abs().max()) <= 8 * 2.0**-149
    assert torch.isnan(dx[torch.isnan(z)]).all() and (dx[torch.isinf(z)] == 0).all()


@pytest.mark.parametrize("fn, name", [(0, "tanh"), (1, "erf")])
@pytest.mark.parametrize("half", [False, True], ids=["float32", "bf16_fp16"])
def test_each_dtype_form_of_tanh_and_erf_holds_its_stated_bound(fn, name, half):
    """The kernels' tanh and erf before any rounding to the output dtype (``normlab_cpu::approx``), against float64
    from denormals to infinity: within 4 eps for float32 inputs and within 2^-12 for bfloat16 / float16 ones (the
    bounds stated in cpu_norms.cpp); |f| never above 1, exactly sign(z) in saturation, NaN in gives NaN out."""
    assert cpu.ready(wait=True)
    z = torch.cat([torch.logspace(-40, 2, 40000), torch.rand(100000) * 10, torch.tensor([0.0, 3e38, math.inf])])
    z = torch.cat([z, -z, torch.tensor([math.nan])]).float()
    got = torch.ops.normlab_cpu.approx(z, fn, half).double()
    want = (torch.tanh if fn == 0 else torch.special.erf)(z.double())
    assert torch.isnan(got[-1])
    got, want, zz = got[:-1], want[:-1], z[:-1].double()
    relative = (got - want).abs() / want.abs().clamp_min(torch.finfo(torch.float32).tiny)
    bound = 2.0**-12 if half else 4 * torch.finfo(torch.float32).eps
    assert float(relative.max()) <= bound, f"{name}: {float(relative.max()):.3g} > {bound:.3g}"
    assert float(got.abs().max()) <= 1.0
    big = zz.abs() >= 10
    assert torch.equal(got[big], torch.sign(zz[big]))  # saturated: 1 - f^2 is exactly 0 there


def test_huge_inputs_saturate_dyisru_and_eln():
    """|x| beyond float32's square root of its largest value: sign(x), never NaN (the reference uses hypot)."""
    one, w = torch.ones(1) * 4, torch.ones(8)
    x = torch.tensor([[-1e30, -3e19, 0.0, 3e19, 1e30, 1.0, -1.0, 2.0]])
    KC.close(cpu.dyisru(x, one, w, None, scale=1.0), FN.dyisru(x.double(), 4.0) / math.sqrt(8), 1e-5, "dyisru")
    x = torch.tensor([[1e30, 0.0, 1.0, -1.0, 2.0, 0.5, -2.0, 3.0]])  # one huge channel: u is huge everywhere
    KC.close(cpu.eln(x, one, w, None, scale=1.0), FN.eln(x.double(), 4.0) / math.sqrt(7), 1e-5, "eln")


# ------------------------------------------------------------------ edges: huge inputs, denormal parameters, no weight
def _grads(fn, x, *params):
    x = x.clone().requires_grad_(True)
    ps = [p.clone().requires_grad_(True) for p in params]
    y = fn(x, *ps)
    y.backward(torch.ones_like(y))
    return y.detach(), x.grad, [p.grad for p in ps]


_EDGE_OPS = {  # name: (fused, reference, parameters), the parameters as the modules hold them
    "dyt": (lambda x, a, w, b: cpu.dyt(x, a, w, b), FN.dyt, lambda: [torch.tensor([0.5]), torch.rand(8) + 0.5,
                                                                     torch.randn(8)]),
    "scaled_dyt": (lambda x, a, w, b: cpu.dyt(x, a, w, b, scale=math.sqrt(8)), FN.scaled_dyt,
                   lambda: [torch.tensor([0.5]), torch.rand(8) + 0.5, torch.randn(8)]),
    "derf": (lambda x, a, s, w, b: cpu.derf(x, a, s, w, b), FN.derf,
             lambda: [torch.tensor([0.5]), torch.tensor([0.1]), torch.rand(8) + 0.5, torch.randn(8)]),
    "dyisru": (lambda x, be, w, b: cpu.dyisru(x, be, w, b, scale=math.sqrt(8)), FN.dyisru,
               lambda: [torch.tensor([4.0]), torch.rand(8) + 0.5, torch.randn(8)]),
    "eln": (lambda x, be, w, b: cpu.eln(x, be, w, b, scale=math.sqrt(7)), FN.eln,
            lambda: [torch.tensor([4.0]), torch.rand(8) + 0.5, torch.randn(8)]),
}  # fmt: skip


@pytest.mark.parametrize("magnitude", [1e4, 1e8, 1e18, 1e30])
@pytest.mark.parametrize("op", list(_EDGE_OPS))
def test_every_gradient_matches_the_reference_on_huge_inputs(op, magnitude):
    """Issue 29, defect 1: the fused tanh stopped at 0.99999994, so every saturated element kept adding to
    alpha's gradient (9.5e23 instead of 0 at |x| = 1e30 for DyT). Rows of huge values, one sign or mixed with
    ordinary ones: the output and every gradient as the reference's (float64), saturation exactly +-1."""
    fast, ref, params = _EDGE_OPS[op]
    torch.manual_seed(0)
    x = torch.randn(6, 8)
    x[0] = magnitude
    x[1] = -magnitude
    x[2, ::2] = magnitude
    ps = params()
    y, dx, dps = _grads(fast, x, *ps)
    y_ref, dx_ref, dps_ref = _grads(ref, x.double(), *[p.double() for p in ps])
    KC.close(y, y_ref, 1e-5, f"{op} y")
    KC.close(dx, dx_ref, 1e-5, f"{op} dx")
    for i, (g, g_ref) in enumerate(zip(dps, dps_ref)):
        scale = max(1.0, float(g_ref.abs().max()))
        err = float((g.double() - g_ref).abs().max()) / scale
        assert err <= 1e-4, f"{op} parameter {i}: relative error {err:.3g} at |x| = {magnitude:g}"
    if op in ("dyt", "scaled_dyt"):
        m = normlab.create_norm("dyt", 8, kernel="cpu")
        xs = torch.full((1, 8), magnitude, requires_grad=True)
        m(xs).sum().backward()
        assert float(m.alpha.grad) == 0.0  # every element saturated: tanh' = 0 exactly, as the reference


def _same(a, b, what):
    assert torch.allclose(a.double(), b.double(), rtol=1e-4, atol=1e-5, equal_nan=True), f"{what}: {a} vs {b}"


@pytest.mark.parametrize("op", list(_EDGE_OPS))
def test_non_finite_inputs_follow_one_rule_on_every_path(op):
    """Issue 29: the paths disagreed on NaN and inf (Derf's gradients +inf where the reference's are NaN, DyISRU
    saturating at inf where the reference gave NaN, ELN's NaN kept to one channel), so `kernel="auto"` answered
    differently for the same row by batch size. The rule (normlab.functional, "Non-finite inputs"): +-inf gives the
    function's limit with gradient 0 (tanh, erf, ISRU: +-1); NaN stays NaN at its element; a row holding inf or
    NaN is NaN where the norm centres it (ELN). Every gradient included."""
    fast, ref, params = _EDGE_OPS[op]
    x = torch.tensor(
        [
            [1.0, -2.0, math.inf, 0.5, 0.1, -0.3, 2.0, 1.0],
            [math.nan, 1.0, 2.0, -1.0, 0.2, 0.4, -0.5, 0.0],
            [-math.inf, 0.3, 0.1, 0.2, -0.7, 0.9, 1.1, -1.2],
            [0.5, -0.5, 1.5, -1.5, 0.25, 0.0, 3.0, -3.0],
        ]
    )
    ps = params()
    got, want = _grads(fast, x, *ps), _grads(ref, x, *ps)
    _same(got[0], want[0], f"{op} y")
    _same(got[1], want[1], f"{op} dx")
    for i, (a, b) in enumerate(zip(got[2], want[2])):
        _same(a, b, f"{op} parameter {i}")
    if op in ("dyt", "scaled_dyt", "derf", "dyisru"):  # element-wise: a non-finite element touches nothing else
        assert torch.isfinite(got[0][3]).all() and torch.isfinite(got[0][0, [0, 1, 3]]).all()
        assert torch.isfinite(got[0][0, 2]) and torch.isfinite(got[0][2, 0])  # +-inf: the limit
    else:
        assert torch.isnan(got[0][:3]).all() and torch.isfinite(got[0][3]).all()


def test_auto_gives_one_answer_for_a_row_whatever_the_batch_size():
    row = torch.tensor([math.inf, -1.0, math.nan, 2.0] * 16)
    for name in ("dyt", "derf", "dyisru", "eln", "rms_norm"):
        m = normlab.create_norm(name, 64)  # auto: the reference below 65,536 elements, fused above
        small = m(row[None])[0]
        big = m(row.expand(2048, 64).contiguous())[0]
        torch.testing.assert_close(big, small, equal_nan=True, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["dyisru", "eln"])
def test_a_denormal_beta_gives_the_reference_answer(name):
    """Issue 29, defect 2: a denormal beta (init accepts it) made the hardware rsqrt read 0, and the fused
    DyISRU returned +-inf with the sign flipped: [-inf, inf, -inf, 2] for [1e-25, -1e-25, 1e-30, 3]."""
    x = torch.tensor([[1e-25, -1e-25, 1e-30, 3.0], [1e-20, 2e-22, -5e-21, 0.0]])
    fused = normlab.create_norm(name, 4, kernel="cpu", beta_init=1e-40)
    ref = normlab.create_norm(name, 4, kernel="reference", beta_init=1e-40)
    y, y_ref = fused(x), ref(x)
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=0)
    if name == "dyisru":
        assert torch.equal(torch.sign(y[0]), torch.sign(x[0]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reduced_precision_outputs_keep_denormals_nan_and_inf(dtype):
    """A bfloat16 result is stored with vcvtneps2bf16 where the CPU has it, which flushes denormals to zero and
    quiets NaN: a vector holding a denormal takes ATen's conversion. DyT with alpha = w = 1 and b = 0 returns x's
    own value for these x (tanh(x) rounds to x in float32 below 2^-12), so the output must equal x bit for bit,
    in full vectors and in tails, and the backward's dx too (g = x, alpha = 1: dx = g (1 - tanh^2) = g)."""
    tiny = torch.finfo(dtype).smallest_normal
    values = [tiny / 2, -tiny / 4, tiny / 64, tiny, 3 * tiny, 1e-6, -2e-5, 0.0, -0.0]
    row = torch.tensor(values * 4, dtype=dtype)[:32]  # two full vectors of 16
    x = torch.stack([row, row.flip(0)]).contiguous()
    for xs in (x, x[:, :13].contiguous()):  # and a tail
        y = cpu.dyt(xs, torch.ones(1, dtype=dtype), torch.ones(xs.shape[1], dtype=dtype))
        assert (y[xs != 0] != 0).all(), "a denormal result was flushed to zero"
        assert torch.equal(y, xs)  # values: the absent bias turns -0 into +0, which equals -0
        dx = torch.ops.normlab_cpu.pointwise_bwd(
            xs, xs, torch.ones(1, dtype=dtype), None, torch.ones(xs.shape[1], dtype=dtype), None, 1.0, 0
        )[0]
        assert torch.equal(dx, xs)
    special = torch.tensor([[math.nan, math.inf, -math.inf, 1.0] * 4], dtype=dtype)
    y = cpu.dyt(special, torch.ones(1, dtype=dtype), torch.ones(16, dtype=dtype))
    assert torch.isnan(y[0, ::4]).all() and torch.equal(y[0, 1::4], torch.ones(4, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_a_saturated_input_adds_nothing_to_beta_s_gradient(dtype):
    """Issue 96, KN1: the fused DyISRU backward summed u * h^3 for beta's gradient, and at u = +-inf (or a float16
    activation above 65,504, which is inf) that is inf * 0 = NaN, where the reference's is finite. +-inf beside
    ordinary values: every gradient as the reference's (float16: to its rounding), beta's finite."""
    torch.manual_seed(0)
    x = torch.randn(6, 64, dtype=dtype)
    x[0, 0], x[1, 3] = math.inf, -math.inf
    if dtype == torch.float16:
        x[2, 5] = torch.tensor(70000.0).to(dtype)  # float16's overflow: inf
    grads = {}
    for kernel in ("cpu", "reference"):
        m = normlab.create_norm("dyisru", 64, kernel=kernel, dtype=dtype)
        xi = x.clone().requires_grad_()
        m(xi).float().square().sum().backward()
        grads[kernel] = [xi.grad] + [p.grad for p in m.parameters()]
    assert torch.isfinite(grads["cpu"][1]).all(), f"{dtype}: beta's gradient {grads['cpu'][1]}"
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    for got, want in zip(grads["cpu"], grads["reference"]):
        torch.testing.assert_close(got.double(), want.double(), rtol=tol, atol=tol, equal_nan=True)
