"""Every registered norm: output against an independent formula, gradcheck, shapes and dtypes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import normlab
from conftest import make_norm, numpy_reference

# The x-gradient of rms_detached is, by design, not the derivative of its forward;
# test_identities.py checks it against its own formula instead.
SURROGATE_X_GRAD = {"rms_detached"}


def test_registry_covers_every_paper_name():
    expected = {
        "layer_norm",
        "rms_norm",
        "dyt",
        "dyt_hardtanh",
        "dyt_sigmoid",
        "tanh_fixed",
        "layer_scale",
        "scaled_dyt",
        "dyisru",
        "eln",
        "l1_norm",
        "lmax_norm",
        "group_rms",
        "dyt_rms_denominator",
        "sign_sqrt",
        "rms_detached",
        "rms_ema",
        "rms_partial_coupling",
    }
    assert expected <= set(normlab.list_norms())


def test_output_matches_independent_formula(norm_name):
    m = make_norm(norm_name, 37)
    x = torch.randn(4, 5, 37, dtype=torch.float64) * 1.7
    expect = numpy_reference(norm_name, m, x.numpy())
    np.testing.assert_allclose(m(x).detach().numpy(), expect, rtol=1e-12, atol=1e-12)


def test_gradcheck_float64(norm_name):
    m = make_norm(norm_name, 7)
    x = torch.randn(3, 7, dtype=torch.float64, requires_grad=norm_name not in SURROGATE_X_GRAD)
    params = [p for p in m.parameters()]
    for p in params:
        p.requires_grad_(True)

    names = [n for n, _ in m.named_parameters()]

    def f(x, *ps):
        return torch.func.functional_call(m, dict(zip(names, ps)), (x,))

    assert torch.autograd.gradcheck(f, (x, *params), eps=1e-6, atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize(
    "shape",
    [(64,), (2, 5, 64), (3, 1), (2, 1023)],
    ids=["C", "BTC", "C=1", "C=1023"],
)
def test_shapes(norm_name, shape):
    m = make_norm(norm_name, shape[-1])
    x = torch.randn(*shape, dtype=torch.float64)
    y = m(x)
    assert y.shape == x.shape
    np.testing.assert_allclose(y.detach().numpy(), numpy_reference(norm_name, m, x.numpy()), rtol=1e-10, atol=1e-10)


def test_non_contiguous_input(norm_name):
    m = make_norm(norm_name, 16)
    base = torch.randn(16, 6, 3, dtype=torch.float64)
    x = base.transpose(0, 2)  # (3, 6, 16), last axis has stride 18
    assert not x.is_contiguous()
    y = m(x)
    np.testing.assert_allclose(y.detach().numpy(), numpy_reference(norm_name, m, x.numpy()), rtol=1e-12, atol=1e-12)
    y.sum().backward()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_large_inputs_stay_finite(norm_name, dtype):
    """|x| up to 6e4 (near float16's max 65504); DyISRU's x^2 would overflow float16 above 256."""
    m = make_norm(norm_name, 64, dtype=dtype, randomize=False)
    x = torch.linspace(-6e4, 6e4, 64).repeat(3, 1).to(dtype)
    x[1] *= 1e-3
    x.requires_grad_(True)
    y = m(x)
    assert y.dtype == dtype
    assert torch.isfinite(y).all(), f"{norm_name} in {dtype}: non-finite output"
    y.float().pow(2).mean().backward()
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
def test_low_precision_matches_float64(norm_name, dtype, tol):
    m64 = make_norm(norm_name, 48)
    m = make_norm(norm_name, 48).to(dtype)
    x = torch.randn(4, 48, dtype=torch.float64)
    ref = m64(x)
    got = m(x.to(dtype)).double()
    # parameters were rounded to `dtype` too, so compare against the float64 math on the rounded values
    ref_rounded = torch.as_tensor(numpy_reference(norm_name, m, x.to(dtype).double().numpy()))
    torch.testing.assert_close(got, ref_rounded, rtol=tol, atol=tol * max(1.0, float(ref.detach().abs().max())))


@pytest.mark.parametrize("kernel", ["reference", "cpu"])
def test_dyt_with_a_scalar_gain_is_dyt_with_that_gain_on_every_channel(kernel):
    """scalar_gain (OSP's single-scale norm): one learnable gamma, (1,); the output and every gradient are those of a
    per-channel DyT whose gamma holds that value on every channel, its gradient summed over the channels."""
    torch.manual_seed(0)
    single = normlab.create_norm("dyt", 16, scalar_gain=True, kernel=kernel)
    assert single.weight.shape == (1,) and "scalar_gain=True" in repr(single)
    with torch.no_grad():
        single.weight.fill_(1.7)
        single.bias.normal_()
    wide = normlab.create_norm("dyt", 16, kernel=kernel)
    wide.load_state_dict({**single.state_dict(), "weight": single.weight.detach().expand(16).clone()})
    x = torch.randn(3, 5, 16, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    y, y2 = single(x), wide(x2)
    torch.testing.assert_close(y, y2)
    y.square().sum().backward()
    y2.square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(single.weight.grad, wide.weight.grad.sum().reshape(1))
    torch.testing.assert_close(single.alpha.grad, wide.alpha.grad)
    with torch.no_grad():  # the inference path (kernels.direct on the CPU)
        torch.testing.assert_close(single(x), y)
    assert normlab.create_norm("dyt", 16, scalar_gain=True, device="meta").weight.shape == (1,)


def test_a_conversion_refuses_a_scalar_gain_that_cannot_hold_the_model_s_gamma():
    from normlab.conversion.convert import convert_norms

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    with pytest.raises(ValueError, match=r"cannot hold the model's \(8,\) gamma.*leave scalar_gain out"):
        convert_norms(model, "dyt", init={"scalar_gain": True})
