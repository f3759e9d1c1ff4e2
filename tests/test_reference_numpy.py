"""The dynamic_tanh exercise: the NumPy dynamic_tanh and its four behaviours."""

import numpy as np
import pytest

from normlab.reference import dynamic_tanh


def test_reference_example():
    x = np.array([[[0.14115588, 0.00372817, 0.24126647, 0.22183601]]])
    out = dynamic_tanh(x, 0.5, np.ones(4), np.zeros(4))
    assert out == [[[0.0705, 0.0019, 0.1201, 0.1105]]]
    assert isinstance(out, list) and isinstance(out[0][0][0], float)


def test_identity_affine_equals_tanh():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 3, 5)) * 3
    assert dynamic_tanh(x, 0.7, np.ones(5), np.zeros(5)) == np.round(np.tanh(0.7 * x), 4).tolist()


def test_channel_affine_is_applied():
    x = np.array([[0.5, -1.0, 2.0]])
    gamma, beta = np.array([2.0, -1.0, 0.5]), np.array([0.1, 0.2, -0.3])
    expect = [[round(g * np.tanh(1.5 * v) + b, 4) for v, g, b in zip(x[0], gamma, beta)]]
    assert dynamic_tanh(x, 1.5, gamma, beta) == expect
    assert dynamic_tanh(x, 1.5, gamma, beta) != dynamic_tanh(x, 1.5, np.ones(3), np.zeros(3))


def test_alpha_zero_gives_beta():
    x = np.random.default_rng(1).normal(size=(4, 3))
    beta = np.array([0.12345, -2.0, 7.77777])
    assert dynamic_tanh(x, 0.0, np.array([3.0, 4.0, 5.0]), beta) == [np.round(beta, 4).tolist()] * 4


def test_bad_gamma_shape():
    with pytest.raises(ValueError, match=r"gamma of shape \(3,\)"):
        dynamic_tanh(np.zeros((2, 3)), 0.5, np.ones(4), np.zeros(3))


@pytest.mark.parametrize("x, alpha", [([[1.0, 2.0]], "0.5"), ([[1 + 2j, 2.0]], 0.5), ([[1.0, 2.0]], True)])
def test_reference_dynamic_tanh_refuses_a_string_alpha_and_complex_x(x, alpha):
    from normlab.reference import dynamic_tanh

    with pytest.raises(ValueError, match="dynamic_tanh: expected"):
        dynamic_tanh(x, alpha, [1.0, 1.0], [0.0, 0.0])
