"""The fused CPU paths (normlab.kernels.cpu) against the reference: output and every gradient.

The same table of shapes, dtypes and variants as the Triton kernels, and the same tolerances
(kernel_checks.py). Runs on every machine: the CPU path is TorchInductor, which needs only a C++ compiler.
"""

from __future__ import annotations

import math
import warnings

import kernel_checks as KC
import pytest
import torch

import normlab
import normlab.functional as FN
from normlab.kernels import cpu

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _inputs(m, n, dtype, seed=0):
    return KC.inputs(m, n, dtype, "cpu", seed)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", KC.CHANNELS)
@pytest.mark.parametrize("m", KC.ROWS)
@pytest.mark.parametrize("per_channel,bias", KC.VARIANTS, ids=KC.VARIANT_IDS)
@pytest.mark.parametrize("op", ["dyt", "scaled_dyt", "dyisru", "eln"])
def test_pointwise_family(op, m, n, dtype, per_channel, bias):
    if op == "eln" and n == 1:
        pytest.skip("ELN needs C >= 2 (sqrt(C - 1) = 0 at C = 1)")
    x, dy, w, b, g = _inputs(m, n, dtype)
    k = n if per_channel else 1
    p = (0.3 + torch.rand(k, generator=g)) if op in ("dyt", "scaled_dyt") else (0.5 + 3 * torch.rand(k, generator=g))
    p = p.to(dtype)
    fast = {
        "dyt": lambda x, p, w, b=None: cpu.dyt(x, p, w, b),
        "scaled_dyt": lambda x, p, w, b=None: cpu.dyt(x, p, w, b, scale=math.sqrt(n)),
        "dyisru": lambda x, p, w, b=None: cpu.dyisru(x, p, w, b, scale=math.sqrt(n)),
        "eln": lambda x, p, w, b=None: cpu.eln(x, p, w, b, scale=math.sqrt(n - 1)),
    }[op]
    ref = {"dyt": FN.dyt, "scaled_dyt": FN.scaled_dyt, "dyisru": FN.dyisru, "eln": FN.eln}[op]
    tensors = [x, p, w, b] if bias else [x, p, w]
    # ELN's dx is a centred difference (q - mean q): at C = 2 it cancels, so measure against |dy w| beta h^3
    floor = float((dy.double() * w.double()).abs().max()) * (1 / math.sqrt(float(p.min()))) if op == "eln" else 1e-6
    KC.check(fast, ref, tensors, dy, dtype, op, grad_floor=floor)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", KC.CHANNELS)
@pytest.mark.parametrize("m", KC.ROWS)
@pytest.mark.parametrize("per_channel,bias", KC.VARIANTS, ids=KC.VARIANT_IDS)
def test_derf(m, n, dtype, per_channel, bias):
    x, dy, w, b, g = _inputs(m, n, dtype)
    k = n if per_channel else 1
    alpha = (0.3 + torch.rand(k, generator=g)).to(dtype)
    shift = (0.3 * torch.randn(k, generator=g)).to(dtype)
    tensors = [x, alpha, shift, w, b] if bias else [x, alpha, shift, w]
    KC.check(cpu.derf, FN.derf, tensors, dy, dtype, "derf")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", KC.CHANNELS)
@pytest.mark.parametrize("m", KC.ROWS)
def test_rms_norm(m, n, dtype):
    x, dy, w, _, _ = _inputs(m, n, dtype)
    eps = 1e-6
    term = float((dy.double() * w.double()).abs().max() / x.double().pow(2).mean(-1).sqrt().min())  # |dy w| / r
    KC.check(
        lambda x, w: cpu.rms_norm(x, w, eps),
        lambda x, w: FN.rms_norm(x, w, eps),
        [x, w],
        dy,
        dtype,
        "rms_norm",
        grad_floor=term,
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_with_one_weight_for_every_channel(dtype):
    """The kernel's own entry takes a (1,) weight too (the element-wise ops share its parameter reader): it is
    read for every channel, and its gradient comes back summed, with its (1,) shape."""
    x, dy, _, _, g = _inputs(64, 37, dtype)
    w = (0.5 + torch.rand(1, generator=g)).to(dtype)
    term = float((dy.double() * w.double()).abs().max() / x.double().pow(2).mean(-1).sqrt().min())
    ref = lambda x, w: FN.rms_norm(x, w.expand(x.shape[-1]), 1e-6)  # noqa: E731  (the reference takes (C,))
    KC.check(lambda x, w: cpu.rms_norm(x, w, 1e-6), ref, [x, w], dy, dtype, "rms_norm", grad_floor=term)


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
        torch.ones_like(z), z, None, torch.ones(1), torch.zeros(1), torch.ones(16), None, 1.0, 1
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
# each edge op, and DyT's and Derf's backward that reads the saved f (cpu.BACKWARD_SAVES) too
_EDGE_CASES = [(op, "x") for op in _EDGE_OPS] + [("dyt", "x_and_f"), ("scaled_dyt", "x_and_f"), ("derf", "x_and_f")]


def _saving(op: str, saves: str, monkeypatch) -> None:
    monkeypatch.setitem(cpu.BACKWARD_SAVES, "derf" if op == "derf" else "dyt", saves)


@pytest.mark.parametrize("magnitude", [1e4, 1e8, 1e18, 1e30])
@pytest.mark.parametrize("op, saves", _EDGE_CASES)
def test_every_gradient_matches_the_reference_on_huge_inputs(op, saves, magnitude, monkeypatch):
    """Issue 29, defect 1: the fused tanh stopped at 0.99999994, so every saturated element kept adding to
    alpha's gradient (9.5e23 instead of 0 at |x| = 1e30 for DyT). Rows of huge values, one sign or mixed with
    ordinary ones: the output and every gradient as the reference's (float64), saturation exactly +-1."""
    _saving(op, saves, monkeypatch)
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


@pytest.mark.parametrize("op, saves", _EDGE_CASES)
def test_non_finite_inputs_follow_one_rule_on_every_path(op, saves, monkeypatch):
    """Issue 29: the paths disagreed on NaN and inf (Derf's gradients +inf where the reference's are NaN, DyISRU
    saturating at inf where the reference gave NaN, ELN's NaN kept to one channel), so `kernel="auto"` answered
    differently for the same row by batch size. The rule (normlab.functional, "Non-finite inputs"): +-inf gives the
    function's limit with gradient 0 (tanh, erf, ISRU: +-1); NaN stays NaN at its element; a row holding inf or
    NaN is NaN where the norm centres it (ELN). Every gradient included."""
    _saving(op, saves, monkeypatch)
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
            xs, xs, None, torch.ones(1, dtype=dtype), None, torch.ones(xs.shape[1], dtype=dtype), None, 1.0, 0
        )[0]
        assert torch.equal(dx, xs)
    special = torch.tensor([[math.nan, math.inf, -math.inf, 1.0] * 4], dtype=dtype)
    y = cpu.dyt(special, torch.ones(1, dtype=dtype), torch.ones(16, dtype=dtype))
    assert torch.isnan(y[0, ::4]).all() and torch.equal(y[0, 1::4], torch.ones(4, dtype=dtype))


@pytest.mark.parametrize("name", ["dyt", "scaled_dyt", "derf", "dyisru", "eln", "rms_norm"])
def test_public_kernels_without_a_weight_match_the_reference(name):
    """Issue 29, defect 3: `normlab.kernels.dyt(x, alpha, None, kernel="cpu")` returned zeros (the library read a
    missing weight as 0), so under "auto" the answer changed at 65,536 elements. No weight means 1, on every
    path, with the gradients of x and of the other parameters unchanged."""
    import normlab.kernels as K

    x = torch.randn(4, 8)
    calls = {
        "dyt": lambda x, k: K.dyt(x, torch.tensor([0.5]), None, kernel=k),
        "scaled_dyt": lambda x, k: K.scaled_dyt(x, torch.tensor([0.5]), None, kernel=k),
        "derf": lambda x, k: K.derf(x, torch.tensor([0.5]), torch.tensor([0.1]), None, kernel=k),
        "dyisru": lambda x, k: K.dyisru(x, torch.tensor([4.0]), None, kernel=k),
        "eln": lambda x, k: K.eln(x, torch.tensor([4.0]), None, kernel=k),
        "rms_norm": lambda x, k: K.rms_norm(x, None, 1e-6, kernel=k),
    }
    out = {}
    for k in ("cpu", "reference"):
        xk = x.clone().requires_grad_(True)
        y = calls[name](xk, k)
        y.backward(torch.ones_like(y))
        out[k] = (y.detach(), xk.grad)
    assert out["cpu"][0].abs().max() > 0
    torch.testing.assert_close(out["cpu"][0], out["reference"][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out["cpu"][1], out["reference"][1], rtol=1e-4, atol=1e-5)


def test_non_contiguous_batched_and_empty_inputs():
    base = torch.randn(16, 5, 3)
    x = base.transpose(0, 2).requires_grad_(True)  # (3, 5, 16), last axis strided
    alpha, w = torch.full((1,), 0.7, requires_grad=True), torch.ones(16, requires_grad=True)
    y = cpu.dyt(x, alpha, w)
    KC.close(y, FN.dyt(x.double(), 0.7), 1e-5, "non-contiguous dyt")
    y.sum().backward()
    assert x.grad.shape == x.shape
    m = normlab.create_norm("dyt", 16)
    assert m(torch.empty(0, 16)).shape == (0, 16)


@pytest.mark.parametrize("op", ["dyt", "derf", "dyisru", "eln", "rms_norm"])
def test_gradients_are_deterministic_at_one_and_two_threads(op):
    """The same bits on every run with the same thread count (each task owns its rows; partials added in order),
    and the same values within float32 rounding across thread counts."""
    x, dy, w, b, _ = _inputs(301, 1023, torch.float32)
    call = {
        "dyt": lambda x, p, w, b: cpu.dyt(x, p, w, b),
        "derf": lambda x, p, w, b: cpu.derf(x, p, 0.1 * p, w, b),
        "dyisru": lambda x, p, w, b: cpu.dyisru(x, p, w, b),
        "eln": lambda x, p, w, b: cpu.eln(x, p, w, b),
        "rms_norm": lambda x, p, w, b: cpu.rms_norm(x, w, 1e-6) * p + b,
    }[op]
    before = torch.get_num_threads()
    by_threads = {}
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            runs = []
            for _ in range(2):
                leaves = [t.clone().requires_grad_(True) for t in (x, torch.full((1,), 0.6), w, b)]
                call(*leaves).backward(dy)
                runs.append([t.grad for t in leaves])
            for g1, g2 in zip(*runs):
                assert torch.equal(g1, g2), f"{op}: two runs at {threads} threads differ"
            by_threads[threads] = runs[0]
    finally:
        torch.set_num_threads(before)
    for g1, g2 in zip(by_threads[1], by_threads[2]):
        KC.close(g2, g1, 1e-5, f"{op}: 2 threads against 1")


@pytest.mark.parametrize("op", ["dyt", "dyisru", "rms_norm"])
def test_saves_only_its_input(op):
    """Activation memory: the backward keeps x and per-channel (or per-row) vectors, no other (N, C) tensor."""
    n, c = 64, 256
    x = torch.randn(n, c, requires_grad=True)
    w = torch.ones(c, requires_grad=True)
    p = torch.full((1,), 0.5, requires_grad=True)
    call = {
        "dyt": lambda: cpu.dyt(x, p, w, w),
        "dyisru": lambda: cpu.dyisru(x, p, w, w),
        "rms_norm": lambda: cpu.rms_norm(x, w, 1e-6),
    }[op]
    call()  # compile first: the hooks must see the compiled graph's saved tensors
    sizes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
        call()
    assert sorted(sizes)[-1] == n * c and all(s <= max(n, c) for s in sorted(sizes)[:-1]), sizes


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [7, 1023])
@pytest.mark.parametrize("op", ["dyt", "derf"])
def test_a_backward_that_reads_the_saved_f_matches_the_reference(op, n, dtype, monkeypatch):
    """BACKWARD_SAVES = "x_and_f": the forward writes f in x's dtype and the backward reads it; the same
    tolerances against the reference as the recomputing path, and in float32 the very same gradients."""
    x, dy, w, b, g = _inputs(37, n, dtype)
    alpha = (0.3 + torch.rand(n, generator=g)).to(dtype)
    shift = (0.3 * torch.randn(n, generator=g)).to(dtype)
    fast, ref = (cpu.dyt, FN.dyt) if op == "dyt" else (cpu.derf, FN.derf)
    tensors = [x, alpha, w, b] if op == "dyt" else [x, alpha, shift, w, b]
    recomputed = _grads(fast, *tensors) if dtype == torch.float32 else None
    monkeypatch.setitem(cpu.BACKWARD_SAVES, op, "x_and_f")
    KC.check(fast, ref, tensors, dy, dtype, f"{op} (saved f)")
    if recomputed is not None:
        y, dx, dps = _grads(fast, *tensors)
        for a, c in zip([recomputed[0], recomputed[1], *recomputed[2]], [y, dx, *dps], strict=True):
            assert torch.equal(a, c), f"{op}: float32 results differ between the two backward modes"
    sizes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
        fast(*[t.detach().requires_grad_() for t in tensors])
    assert sorted(sizes)[-2:] == [37 * n, 37 * n], sizes  # x and f


@pytest.mark.parametrize("name", ["layer_norm", "rms_norm", "dyt", "scaled_dyt", "derf", "dyisru", "eln"])
def test_modules_take_the_cpu_path_under_auto_and_match_the_reference(name, monkeypatch):
    calls = []
    for fn in ("dyt", "derf", "dyisru", "eln", "rms_norm"):
        real = getattr(cpu, fn)
        monkeypatch.setattr(cpu, fn, lambda *a, _real=real, **k: calls.append(1) or _real(*a, **k))
    torch.manual_seed(0)
    auto, ref = normlab.create_norm(name, 64), normlab.create_norm(name, 64, kernel="reference")
    x = torch.randn(cpu.MIN_FUSED // 64, 64, requires_grad=True)
    KC.close(auto(x), ref(x), 1e-5, f"{name} module")
    assert len(calls) == (0 if name == "layer_norm" else 1)  # LayerNorm: PyTorch's own fused op
    calls.clear()
    KC.close(auto(x[:5]), ref(x[:5]), 1e-5, f"{name} module, small input")
    # below MIN_FUSED elements the reference, cheaper there; DyISRU and ELN fuse every size (MIN_FUSED_ISRU)
    assert len(calls) == (1 if name in ("dyisru", "eln") else 0)
    calls.clear()
    with torch.no_grad():  # unrecorded (inference, a decode step): the op without the autograd function, any size
        KC.close(auto(x[:1, :64]), ref(x[:1, :64]), 1e-5, f"{name} module, one row, no grad")
    assert len(calls) == (0 if name == "layer_norm" else 1)
    calls.clear()
    auto.double()(x.double())  # float64 (the theory tools): the reference, exactly
    assert calls == []


def test_kernel_cpu_on_an_unsupported_dtype_is_a_clear_error():
    m = normlab.create_norm("dyt", 8, kernel="cpu").double()
    with pytest.raises(RuntimeError, match="kernel='cpu'.* float32, bfloat16 or float16; got torch.float64"):
        m(torch.randn(2, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="expected kernel in"):
        normlab.create_norm("layer_norm", 8, kernel="triton")


def test_a_machine_without_a_compiler_falls_back_with_one_warning(monkeypatch, tmp_path):
    """A real missing compiler (CXX names no program), an empty cache: one warning, the reference math."""
    from normlab.kernels import cpu_build

    monkeypatch.setattr(cpu_build, "_STATE", {"loaded": False, "failure": None, "thread": None})
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    monkeypatch.setenv("NORMLAB_CACHE", str(tmp_path / "cache"))
    x = torch.randn(3, 16)
    m = normlab.create_norm("dyisru", 16, kernel="cpu")
    with pytest.warns(RuntimeWarning, match="cannot be built on this machine .*no-such-c\\+\\+"):
        y = m(x)
    KC.close(y, normlab.create_norm("dyisru", 16, kernel="reference")(x), 1e-6, "fallback")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning, not one per call
        normlab.create_norm("dyt", 16)(x)
    assert not cpu.available() and not (tmp_path / "cache").exists()  # nothing written


def test_a_recorded_build_is_checked_before_it_is_loaded(tmp_path, monkeypatch):
    """Size and SHA-256 against build.json; a record of other inputs (a stale build) is not this build."""
    import json
    import shutil

    from normlab.kernels import cpu_build

    assert cpu.ready(wait=True)
    ident = cpu_build._identity(cpu_build._compiler())
    folder = tmp_path / "kernels" / f"cpu-{ident['key']}"
    shutil.copytree(cpu_build.build_dir(ident), folder)
    monkeypatch.setenv("NORMLAB_CACHE", str(tmp_path))
    assert cpu_build._intact(folder, ident) is None
    rec = json.loads((folder / "build.json").read_text())
    (folder / "build.json").write_text(json.dumps({**rec, "torch": "0.0.1"}))
    assert cpu_build._intact(folder, ident) == "built from other inputs"
    (folder / "build.json").write_text(json.dumps(rec))
    with open(folder / "normlab_cpu.so", "r+b") as f:
        f.truncate(rec["size"] // 2)
    assert "SHA-256" in cpu_build._intact(folder, ident)
    (folder / "build.json").write_text("{trunc")
    assert cpu_build._intact(folder, ident).startswith("unreadable")


@pytest.mark.slow
def test_a_fresh_process_never_waits_and_rebuilds_a_corrupt_library(tmp_path):
    """A fresh process with a corrupt cached library: kernel='auto' answers at once with the reference math while
    a background thread rebuilds (with a message); once built, the fused path serves, and nothing crashed."""
    import json
    import shutil
    import subprocess
    import sys

    from normlab.kernels import cpu_build

    assert cpu.ready(wait=True)
    ident = cpu_build._identity(cpu_build._compiler())
    folder = tmp_path / "kernels" / f"cpu-{ident['key']}"
    shutil.copytree(cpu_build.build_dir(ident), folder)
    (folder / "normlab_cpu.so").write_bytes(b"\x7fELF not a library")
    code = """
import json, torch, normlab
from normlab.kernels import cpu, cpu_build
x = torch.randn(2048, 32, requires_grad=True)  # cpu.MIN_FUSED elements: auto fuses it once built
m = normlab.create_norm("dyt", 32)
y = m(x); y.sum().backward()
first = cpu.ready()
cpu_build._STATE["thread"].join()
calls = []
real = cpu.dyt
cpu.dyt = lambda *a, **k: calls.append(1) or real(*a, **k)
y2 = m(x)
print(json.dumps({"first_ready": first, "ready": cpu.ready(), "fused_calls": len(calls),
                  "same": bool(torch.allclose(y, y2, atol=1e-6))}))
"""
    env = {**__import__("os").environ, "NORMLAB_CACHE": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"first_ready": False, "ready": True, "fused_calls": 1, "same": True}, out
    assert "corrupt or truncated" in proc.stderr and "rebuilding" in proc.stderr
    assert cpu_build._intact(folder, ident) is None
    assert json.loads((folder / "build.json").read_text())["sha256"] != "" and shutil.which("c++")


@pytest.mark.parametrize("name", ["dyt", "derf", "dyisru", "eln", "rms_norm"])
def test_torch_func_transforms_work_on_the_default_path(name):
    """vmap, grad and jacrev of a module on its default (auto) path equal the reference's (inputs large enough
    that auto would fuse them outside a transform)."""
    from torch.func import functional_call, grad, jacrev, vmap

    torch.manual_seed(0)
    auto = normlab.create_norm(name, 8)
    ref = normlab.create_norm(name, 8, kernel="reference")
    ref.load_state_dict(auto.state_dict())
    x = torch.randn(2, cpu.MIN_FUSED // 8, 8)
    KC.close(vmap(auto)(x), vmap(ref)(x), 1e-6, f"{name} vmap")
    KC.close(jacrev(auto)(x[0, 0]), jacrev(ref)(x[0, 0]), 1e-6, f"{name} jacrev")
    params = dict(auto.named_parameters())

    def loss(p, mod):
        return functional_call(mod, p, (x,)).square().sum()

    for k, g in grad(loss)(params, auto).items():
        KC.close(g, grad(loss)(params, ref)[k], 1e-5, f"{name} grad {k}")
