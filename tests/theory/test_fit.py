"""Fitting a norm to data (normlab.theory.fit): the functional form and a fit that overflows."""

from __future__ import annotations

import pytest
import torch


# 4: the fits evaluate the functional forms
def test_fit_model_is_the_functional_form():
    import normlab.functional as FN
    from normlab.theory.fit import fit_elementwise

    x = torch.linspace(-3, 3, 101, dtype=torch.float64)
    y = 2.0 * FN.dyt(x, torch.tensor(0.7, dtype=torch.float64))
    res = fit_elementwise(x.numpy(), y.numpy(), "dyt", scale=2.0)
    assert float(res.param) == pytest.approx(0.7, rel=1e-8)


def test_a_fit_that_overflows_says_so():
    import numpy as np

    from normlab.theory.fit import fit_elementwise

    x = np.array([1e200, -1e200, 3e199, 1.0])
    res = fit_elementwise(x, np.tanh(x), "dyisru")
    assert not res.converged
    assert "overflow" in res.message and "no positive slope" not in res.message
