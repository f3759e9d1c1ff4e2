"""Sequential calibration (normlab.conversion.calibrate.sites): the massive tokens' own replacement, the fits, and
their bad input. The mechanics run on tiny random Hugging Face models; tests/conversion/test_real_model.py checks the
same code on a real pretrained model."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import normlab
from conftest import id_batches, sink_batches, tiny_lm, with_sinks
from normlab.conversion.calibrate.fit import fit_replacement
from normlab.conversion.calibrate.massive import MassiveTokens

transformers = pytest.importorskip("transformers")


def test_the_massive_token_module_routes_by_the_channels_not_the_position():
    main, heavy = normlab.create_norm("dyisru", 8, beta_init=1.0), normlab.create_norm("dyisru", 8, beta_init=100.0)
    m = MassiveTokens(main, heavy, channels=[2, 5], threshold=10.0)
    x = torch.randn(2, 5, 8)
    x[0, 3, 5], x[1, 0, 2], x[1, 4, 2] = 50.0, -40.0, float("nan")  # two massive tokens; a NaN is not one
    y = m(x)
    routed = torch.zeros(2, 5, dtype=torch.bool)
    routed[0, 3] = routed[1, 0] = True
    torch.testing.assert_close(y[routed], heavy(x)[routed])
    torch.testing.assert_close(y[~routed], main(x)[~routed], equal_nan=True)
    torch.testing.assert_close(m(x[:, 3:4]), torch.where(routed[:, 3:4, None], heavy(x[:, 3:4]), main(x[:, 3:4])))


def test_sequential_calibration_gives_massive_tokens_their_own_norm_and_round_trips(tmp_path):
    model = with_sinks(tiny_lm())
    calib = sink_batches(2)
    rec = normlab.convert_norms(model, "dyisru", calibrate=calib)
    assert any("massive tokens routed to their own copy" in n for n in rec.notes)
    assert all(s.massive and s.massive["channels"] == [0, 1, 2, 3] for s in rec.sites)  # the sinks' channels
    assert isinstance(model.model.norm, MassiveTokens)
    assert model.model.norm.massive.log_beta.shape == (32,)  # the massive copy's fit is per channel
    normlab.save_converted(model, rec, tmp_path / "m")
    loaded, rec2 = normlab.load_converted(tmp_path / "m")
    with torch.no_grad():
        torch.testing.assert_close(loaded(calib[0]).logits, model(calib[0]).logits)
    assert rec2.to_dict() == rec.to_dict()


def test_theorem3_start_is_exact_for_a_fixed_norm_outside_each_channel():
    """Tokens whose ||x without channel i|| is the same (the sink token's shape): DyISRU fits RMSNorm exactly."""
    g = torch.Generator().manual_seed(0)
    bulk = torch.randn(64, 15, generator=g)
    x = torch.cat([torch.linspace(-50, 50, 64)[:, None], 3 * bulk / bulk.norm(dim=1, keepdim=True)], 1)
    w = torch.rand(16, generator=g) + 0.5
    y = torch.nn.functional.rms_norm(x, (16,), w, eps=0.0)
    new = normlab.create_norm("dyisru", 16, per_channel_beta=True)
    with torch.no_grad():
        new.weight.copy_(w)
    out = fit_replacement(new, x, y, per_channel=True)
    with torch.no_grad():
        err0 = float((new(x)[:, 0] - y[:, 0]).norm() / y[:, 0].norm())
    assert err0 < 1e-6 and out.ok
    assert math.isclose(float(new.beta[0].detach()), 9.0, rel_tol=1e-5)  # ||x without channel 0||^2 = 3^2


def test_a_fit_on_nan_activations_is_flagged_never_ok():
    x = torch.full((32, 8), math.nan)
    new = normlab.create_norm("dyisru", 8)
    out = fit_replacement(new, x, x.clone())
    assert not out.ok and any("NaN" in n for n in out.notes)
    model = tiny_lm()
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.fill_(math.nan)  # NaN from block 1 on
    rec = normlab.convert_norms(model, "dyt", calibrate=id_batches(1))
    flagged = [s for s in rec.sites if not s.fit["converged"]]
    assert flagged and "ok" not in rec.table().split(flagged[0].name)[1].splitlines()[0].split()[-1:]
    assert all("FLAGGED" in line for line in rec.table().splitlines() if any(s.name + " " in line for s in flagged))


@pytest.mark.parametrize("bad,match", [(0, "max_tokens"), (-1, "max_tokens"), (1, "max_tokens"), (True, "max_tokens")])
def test_max_tokens_is_checked_at_the_boundary(bad, match):
    with pytest.raises(ValueError, match=match):
        normlab.convert_norms(tiny_lm(), "dyisru", calibrate=id_batches(1), max_tokens=bad)


def test_a_site_init_pattern_that_matches_nothing_is_an_error():
    with pytest.raises(ValueError, match="pattern '\\*attn_norm' matches no norm of the model"):
        normlab.convert_norms(tiny_lm(), "dyt", site_init={"*attn_norm": {"alpha_init": 0.8}})


def test_a_site_init_pattern_for_sites_another_call_converts_is_not_an_error():
    """A budget walk converts one site per call (its refits): a pattern that names a norm of the model, excluded from
    this call or converted before it, is not a typo. It was refused as one, so a recipe with site_init failed at its
    second site."""
    model = tiny_lm()
    table = {"*input_layernorm": {"alpha_init": 0.8}, "*post_attention_layernorm": {"alpha_init": 0.2}}

    def inputs(n, m):
        return n.endswith("input_layernorm")

    normlab.convert_norms(model, "dyt", include=inputs, site_init=table)  # "*post_..." names only excluded sites
    normlab.convert_norms(model, "dyt", site_init=table)  # "*input_..." names only sites converted before
    for layer in model.model.layers:
        assert float(layer.input_layernorm.alpha) == pytest.approx(0.8)
        assert float(layer.post_attention_layernorm.alpha) == pytest.approx(0.2)


def test_a_failed_calibration_puts_every_norm_back():
    model = tiny_lm()
    before = copy.deepcopy(model.state_dict())
    calls = {"n": 0}

    def fault(module, args):  # block 1 fails on its 4th call: after the original pass and some fitted sites
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("injected fault")

    handle = model.model.layers[1].register_forward_pre_hook(fault)
    with pytest.raises(ValueError, match="calibration batch 0 could not be run.*injected fault"):
        normlab.convert_norms(model, "dyisru", calibrate=id_batches(1))
    handle.remove()
    assert not any(type(m).__module__.startswith("normlab") for m in model.modules())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_massive_routing_agrees_with_and_without_a_kv_cache():
    """Greedy decoding of a converted model with massive-token copies: the cached path (one token per call) and the
    uncached path (the whole sequence every call) give the same tokens and logits."""
    model = with_sinks(tiny_lm())
    calib = sink_batches(2)
    normlab.convert_norms(model, "dyisru", calibrate=calib)
    prompt = calib[0][:1, :7]  # the sinks at positions 0 and 5
    kw = {"max_new_tokens": 6, "do_sample": False, "output_scores": True, "return_dict_in_generate": True,
          "pad_token_id": 0}  # fmt: skip
    with torch.no_grad():
        cached = model.generate(prompt, use_cache=True, **kw)
        uncached = model.generate(prompt, use_cache=False, **kw)
    assert torch.equal(cached.sequences, uncached.sequences)
    for a, b in zip(cached.scores, uncached.scores):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
