"""Fused kernels against the reference functions: output and every gradient, over shapes and dtypes.

Without a GPU the kernels run under TRITON_INTERPRET=1 (set in conftest.py) on CPU tensors; on a
GPU the same tests run natively. The comparison and its tolerance table are in kernel_checks.py.
"""

from __future__ import annotations

import kernel_checks as KC
import pytest
import torch

import normlab
import normlab.functional as FN
from normlab.kernels import triton_status

ok, why = triton_status()
pytestmark = pytest.mark.skipif(not ok, reason=why or "triton unavailable")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROWS, CHANNELS, VARIANTS, VARIANT_IDS = KC.ROWS, KC.CHANNELS, KC.VARIANTS, KC.VARIANT_IDS
TOL, _close, _check = KC.TOL, KC.close, KC.check


def _inputs(m, n, dtype, seed=0):
    return KC.inputs(m, n, dtype, DEVICE, seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("n", CHANNELS)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("per_channel,bias", VARIANTS, ids=VARIANT_IDS)
def test_dyt(m, n, dtype, per_channel, bias):
    from normlab.kernels.fused import dyt

    x, dy, w, b, g = _inputs(m, n, dtype)
    alpha = (0.3 + torch.rand(n if per_channel else 1, generator=g)).to(DEVICE, dtype)
    tensors = [x, alpha, w, b] if bias else [x, alpha, w]
    _check(dyt, FN.dyt, tensors, dy, dtype, "dyt")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("n", CHANNELS)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("per_channel,bias", VARIANTS, ids=VARIANT_IDS)
def test_dyisru(m, n, dtype, per_channel, bias):
    from normlab.kernels.fused import dyisru

    x, dy, w, b, g = _inputs(m, n, dtype)
    beta = (0.5 + 3 * torch.rand(n if per_channel else 1, generator=g)).to(DEVICE, dtype)
    tensors = [x, beta, w, b] if bias else [x, beta, w]
    _check(dyisru, FN.dyisru, tensors, dy, dtype, "dyisru")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("n", CHANNELS)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("per_channel,bias", VARIANTS, ids=VARIANT_IDS)
def test_derf(m, n, dtype, per_channel, bias):
    from normlab.kernels.fused import derf

    x, dy, w, b, g = _inputs(m, n, dtype)
    k = n if per_channel else 1
    alpha = (0.3 + torch.rand(k, generator=g)).to(DEVICE, dtype)
    shift = (0.3 * torch.randn(k, generator=g)).to(DEVICE, dtype)
    tensors = [x, alpha, shift, w, b] if bias else [x, alpha, shift, w]
    _check(derf, FN.derf, tensors, dy, dtype, "derf")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("n", CHANNELS)
@pytest.mark.parametrize("m", ROWS)
def test_rms_norm(m, n, dtype):
    from normlab.kernels.fused import rms_norm

    x, dy, w, _, _ = _inputs(m, n, dtype)
    eps = 1e-6
    term = float((dy.double() * w.double()).abs().max() / x.double().pow(2).mean(-1).sqrt().min())  # |dy w| / r
    _check(
        lambda x, w: rms_norm(x, w, eps),
        lambda x, w: FN.rms_norm(x, w, eps),
        [x, w],
        dy,
        dtype,
        "rms_norm",
        grad_floor=term,
    )


def test_rms_norm_long_rows_stream_in_chunks():
    """Rows longer than one block (8192) take the chunked two-pass path."""
    from normlab.kernels.fused import rms_norm

    x, dy, w, _, _ = _inputs(2, 8193, torch.float32)
    _check(lambda x, w: rms_norm(x, w, 1e-6), lambda x, w: FN.rms_norm(x, w, 1e-6), [x, w], dy, torch.float32, "rms")


def test_large_fp16_inputs_do_not_overflow_dyisru():
    from normlab.kernels.fused import dyisru

    x = torch.linspace(-6e4, 6e4, 64).to(DEVICE, torch.float16)[None]
    one = torch.ones(1, device=DEVICE, dtype=torch.float16)
    y = dyisru(x, one * 4, torch.ones(64, device=DEVICE, dtype=torch.float16))
    assert torch.isfinite(y).all()
    _close(y, FN.dyisru(x.double(), 4.0), 2e-3, "dyisru at |x| = 6e4")


def test_non_contiguous_input_and_batch_shapes():
    from normlab.kernels.fused import dyt

    base = torch.randn(16, 5, 3, device=DEVICE)
    x = base.transpose(0, 2)  # (3, 5, 16), last axis strided
    alpha, w = torch.full((1,), 0.7, device=DEVICE), torch.ones(16, device=DEVICE)
    _close(dyt(x, alpha, w), FN.dyt(x.double(), 0.7), 1e-5, "non-contiguous dyt")
    empty = dyt(torch.empty(0, 16, device=DEVICE), alpha, w)
    assert empty.shape == (0, 16)


def test_parameter_gradients_are_deterministic():
    from normlab.kernels.fused import dyt

    x, dy, w, b, _ = _inputs(37, 1023, torch.float32)
    grads = []
    for _ in range(2):
        a = torch.full((1,), 0.6, device=DEVICE, requires_grad=True)
        w1, b1 = w.clone().requires_grad_(True), b.clone().requires_grad_(True)
        dyt(x, a, w1, b1).backward(dy)
        grads.append((a.grad, w1.grad, b1.grad))
    for g1, g2 in zip(*grads):
        assert torch.equal(g1, g2)


def test_mismatched_dtype_or_device_is_a_clear_error():
    from normlab.kernels.fused import dyisru, dyt, rms_norm

    x = torch.randn(4, 8, device=DEVICE, dtype=torch.bfloat16)
    w = torch.ones(8, device=DEVICE)  # float32
    with pytest.raises(ValueError, match=r"weight has dtype torch.float32 but the input has torch.bfloat16"):
        rms_norm(x, w, 1e-6)
    with pytest.raises(ValueError, match=r"alpha is on meta but the input is on"):
        dyt(x, torch.ones(1, device="meta", dtype=torch.bfloat16), w.bfloat16())
    with pytest.raises(TypeError, match="expected a float16, bfloat16 or float32 input"):
        dyisru(torch.ones(4, 8, dtype=torch.float64, device=DEVICE), w.double(), w.double())


def test_modules_dispatch(monkeypatch):
    import normlab.kernels.fused as F

    calls = []
    real = F.dyt
    monkeypatch.setattr(F, "dyt", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(3, 16, device=DEVICE)
    ref = normlab.create_norm("dyt", 16, kernel="reference").to(DEVICE)
    fused = normlab.create_norm("dyt", 16, kernel="triton").to(DEVICE)
    _close(fused(x), ref(x), 1e-5, "module, fused vs reference")
    assert calls == [1]
    auto = normlab.create_norm("dyt", 16).to(DEVICE)  # auto: fused on CUDA only
    auto(x)
    assert len(calls) == (2 if DEVICE == "cuda" else 1)
    for name in ("rms_norm", "dyisru", "derf"):
        a = normlab.create_norm(name, 16, kernel="triton").to(DEVICE)
        b = normlab.create_norm(name, 16, kernel="reference").to(DEVICE)
        _close(a(x), b(x), 1e-5, f"{name} module")
    with pytest.raises(ValueError, match="expected kernel in"):
        normlab.create_norm("dyt", 16, kernel="cuda")
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(RuntimeError, match="needs a CUDA tensor, or TRITON_INTERPRET=1"):
            fused(x)


def test_fused_dyt_saves_only_its_input():
    """Activation memory: the fused DyT keeps x (and its parameters) for the backward, nothing else."""
    from normlab.kernels.fused import dyt

    x = torch.randn(64, 256, device=DEVICE, requires_grad=True)
    alpha = torch.full((1,), 0.5, device=DEVICE, requires_grad=True)
    w = torch.ones(256, device=DEVICE, requires_grad=True)
    b = torch.zeros(256, device=DEVICE, requires_grad=True)

    def saved_bytes(fn):
        sizes = []

        def pack(t):
            sizes.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()
        return sum(sizes)

    fused = saved_bytes(lambda: dyt(x, alpha, w, b))
    eager = saved_bytes(lambda: FN.dyt(x, alpha, w, b))
    x_bytes = x.numel() * x.element_size()
    assert fused <= x_bytes + (256 + 1) * 4  # x, alpha, weight
    assert eager >= 2 * x_bytes  # eager keeps alpha*x or tanh(alpha*x) besides
