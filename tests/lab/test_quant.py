"""Outlier statistics and fake quantization (`normlab.lab.quant`), and their place in a run's metrics and summary."""

from __future__ import annotations

import json

import pytest
import torch

from normlab.lab import GPTConfig, resolve_config, train
from normlab.lab.model import GPT
from normlab.lab.quant import outlier_stats, quant_gaps
from normlab.quantize import excess_kurtosis, fake_quant_weight, max_over_median


def test_kurtosis_is_zero_for_a_gaussian_and_large_for_one_outlier_channel():
    torch.manual_seed(0)
    x = torch.randn(64, 4096)
    assert abs(excess_kurtosis(x)) < 0.05  # each row's over its 4,096 channels, averaged
    x[:, 7] = 60.0  # an outlier feature: one channel far above the rest in every token
    n, a = 4096, 60.0  # one value a among n unit ones: kurtosis n a^4 / (a^2 + n)^2 - 3, 891 here
    assert excess_kurtosis(x) == pytest.approx(n * a**4 / (a**2 + n) ** 2 - 3, rel=0.02)
    assert max_over_median(torch.tensor([1.0, -2.0, 3.0, -100.0, 2.0])) == pytest.approx(50.0)


@pytest.mark.parametrize("bits", [8, 4])
def test_weights_land_on_a_symmetric_grid_per_output_channel_within_half_a_step(bits):
    torch.manual_seed(0)
    w = torch.randn(16, 96) * torch.logspace(-2, 1, 16)[:, None]  # rows of very different scales
    q = fake_quant_weight(w, bits)
    top = 2 ** (bits - 1) - 1
    step = w.abs().amax(1, keepdim=True) / top
    levels = q / step
    assert torch.allclose(levels, levels.round(), atol=1e-3) and levels.abs().max() <= top + 1e-3
    assert ((q - w).abs() <= step / 2 + 1e-6).all()
    assert (q.abs().amax(1) == w.abs().amax(1)).all()  # the largest of each row is on the grid


def _tiny_gpt() -> tuple[GPT, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(width=64, depth=2, heads=4, context=32, norm="rms_norm")).eval()
    ids = torch.randint(0, 256, (8, 32))
    return model, ids, torch.randint(0, 256, (8, 32))


def _logit_error(model: GPT, ids: torch.Tensor):
    """A 'loss' that is 0 in float and grows with any change of the logits (a random model's cross-entropy sits at
    log 256 whatever is done to it): the mean squared change of the logits, relative to their variance."""
    with torch.no_grad():
        ref = model(ids)[0]
    return lambda: float((model(ids)[0] - ref).pow(2).mean() / ref.var())


def test_a_function_preserving_outlier_channel_leaves_float_alone_and_breaks_static_int8_activations():
    """RMSNorm's gain on one channel x1000 and the layers reading it /1000: the same model in float, but every
    reader's per-tensor int8 activation scale is now set by one channel. The W8A8 gap must grow, the outlier
    statistics must see it, and the measurement must leave the model as it was."""
    model, ids, calib = _tiny_gpt()
    plain_stats = outlier_stats(model, ids)
    plain = quant_gaps(model, _logit_error(model, ids), calib)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    with torch.no_grad():
        for block in model.blocks:
            block.norm_attn.weight[5] *= 1000
            block.attn.qkv.weight[:, 5] /= 1000
    outlier = quant_gaps(model, _logit_error(model, ids), calib)
    stats = outlier_stats(model, ids)
    assert outlier["loss_float"] == plain["loss_float"] == 0.0
    assert 0 < plain["qgap_w8a8"] < 0.01 and outlier["qgap_w8a8"] > 10 * plain["qgap_w8a8"]
    assert plain["qgap_w8"] < plain["qgap_w4"]  # 4 bits err more than 8
    assert stats["maxmed_readers"] > 20 * plain_stats["maxmed_readers"]
    assert stats["kurt_readers"] > plain_stats["kurt_readers"] + 10
    assert {f"kurt_resid/{i}" for i in range(2)} <= set(stats) and "kurt_others" in stats


def test_a_run_logs_outliers_at_each_evaluation_and_summarizes_its_quantization_gaps(corpus_file, tmp_path):
    cfg = resolve_config("tiny", ["steps=20", "eval_every=10"], data=[corpus_file], out=str(tmp_path / "run"))
    summary = train(cfg, progress=False)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "val_loss" in r]
    assert len(evals) == 2 and all("kurt_resid/0" in r and "maxmed_readers" in r for r in evals)
    assert summary["loss_float"] == pytest.approx(summary["final_val_loss"])
    for key in ("kurt_resid", "maxmed_resid", "kurt_readers", "kurt_others", "qgap_w8", "qgap_w4", "qgap_w8a8"):
        assert isinstance(summary[key], float), key


def test_a_single_scale_dyt_model_has_one_gamma_per_site_and_match_rms_sets_it():
    """The quantize study's single-scale cells: ``model.norm_kwargs = {scalar_gain = true}`` reaches every DyT site,
    and match_rms scales that one gamma so each site's output has RMS 1, as it does a per-channel gamma."""
    torch.manual_seed(0)
    cfg = GPTConfig(width=64, depth=2, heads=4, context=32, norm="dyt", norm_kwargs={"scalar_gain": True})
    model = GPT(cfg)
    ids = torch.randint(0, 256, (8, 32))
    sites = model.norm_modules()
    assert len(sites) == 5 and all(m.weight.shape == (1,) for m in sites.values())
    factors = model.match_rms_(ids)
    assert set(factors) == set(sites)
    seen = {}
    hooks = [m.register_forward_hook(lambda mod, a, y, n=n: seen.setdefault(n, y)) for n, m in sites.items()]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    assert all(float(y.pow(2).mean().sqrt()) == pytest.approx(1.0, rel=1e-4) for y in seen.values())
