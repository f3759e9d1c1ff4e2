"""normlab.registry: a spec in hand builds its layer as `create_norm` builds it by name, and the facts a conversion
reads (what a fit sets) come from the one table."""

from __future__ import annotations

import pytest
import torch

from normlab.registry import calibratable_norms, create_norm, init_kwargs, list_norms, norm_spec


@pytest.mark.parametrize("name", list_norms())
def test_a_spec_creates_the_layer_create_norm_creates(name):
    spec = norm_spec(name)
    assert spec.init_kwargs == tuple(init_kwargs(name))
    torch.manual_seed(0)
    a = create_norm(name, 6)
    torch.manual_seed(0)
    b = spec.create(6)
    assert type(a) is type(b) is spec.cls
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def test_a_spec_refuses_a_keyword_its_class_does_not_take_unless_told_to_drop_it():
    spec = norm_spec("rms_norm")
    with pytest.raises(TypeError, match="'rms_norm' does not take alpha_init; it takes: "):
        spec.create(8, alpha_init=0.5)
    assert isinstance(spec.create(8, strict=False, alpha_init=0.5), spec.cls)


def test_the_calibratable_norms_are_the_ones_whose_spec_names_a_fitted_parameter():
    got = calibratable_norms()
    assert got == sorted(got) and {"dyt", "dyisru", "eln", "derf", "scaled_dyt"} <= set(got)
    assert all(norm_spec(n).fits for n in got)
    assert not any(norm_spec(n).fits for n in set(list_norms()) - set(got))
