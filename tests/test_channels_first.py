"""Channels-first norms (issue 23): every norm takes ``channel_dim``, on every path, and conversion handles the
vision models where DyT was first shown (ConvNeXt's channels-first and channels-last LayerNorms, ViT's)."""

from __future__ import annotations

import copy

import pytest
import torch

import normlab

# (norm, the kernels it has): each path computes on channels-last data after the axis moves
PATHS = {
    "dyt": ("reference", "cpu", "triton"),
    "derf": ("reference", "cpu", "triton"),
    "scaled_dyt": ("reference", "cpu", "triton"),
    "dyisru": ("reference", "cpu", "triton"),
    "rms_norm": ("reference", "cpu", "triton"),
    "eln": ("reference", "cpu"),
    "layer_norm": ("reference", "auto"),
}
SHAPES = [(2, 1, 3, 5), (3, 7, 2, 2), (1, 128, 3, 1)]  # (N, C, H, W): one channel, an odd count, a wide one


def _pair(name: str, c: int, kernel: str):
    kw = {"beta_init": 9.0} if name in ("dyisru", "eln") else {}
    if name == "eln" and c < 2:
        pytest.skip("ELN needs C >= 2")
    torch.manual_seed(c)
    first = normlab.create_norm(name, c, channel_dim=1, kernel=kernel, **kw)
    last = normlab.create_norm(name, c, kernel=kernel, **kw)
    with torch.no_grad():  # parameters away from their init, so that every gradient is exercised
        for p in first.parameters():
            p.add_(0.1 * torch.randn_like(p))
    last.load_state_dict(first.state_dict())
    return first, last


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name, kernel", [(n, k) for n, ks in PATHS.items() for k in ks])
def test_channels_first_matches_channels_last_on_the_permuted_input(name, kernel, shape):
    first, last = _pair(name, shape[1], kernel)
    x = torch.randn(shape, requires_grad=True)
    xl = x.detach().permute(0, 2, 3, 1).contiguous().requires_grad_(True)
    y_first, y_last = first(x), last(xl)
    torch.testing.assert_close(y_first, y_last.permute(0, 3, 1, 2), rtol=1e-6, atol=1e-6)
    g = torch.randn_like(y_first)
    y_first.backward(g)
    y_last.backward(g.permute(0, 2, 3, 1))
    torch.testing.assert_close(x.grad, xl.grad.permute(0, 3, 1, 2), rtol=1e-5, atol=1e-5)
    for (n, p1), p2 in zip(first.named_parameters(), last.parameters()):
        torch.testing.assert_close(p1.grad, p2.grad, rtol=1e-5, atol=1e-5, msg=f"{name} {kernel}: grad of {n}")


def test_every_registered_norm_takes_channel_dim_and_refuses_a_bad_one():
    for name in normlab.list_norms():
        assert "channel_dim" in normlab.registry.init_kwargs(name), name
    with pytest.raises(ValueError, match="expected channel_dim to be an int"):
        normlab.create_norm("dyt", 8, channel_dim="1")
    with pytest.raises(ValueError, match=r"channel_dim=3\): the input \(2, 8\) has no axis 3"):
        normlab.create_norm("dyt", 8, channel_dim=3)(torch.randn(2, 8))


def test_convnext_converts_every_norm_and_computes_what_it_should():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.ConvNextConfig(num_channels=3, hidden_sizes=[8, 16], depths=[1, 1], num_stages=2)
    torch.manual_seed(0)
    model = transformers.ConvNextModel(cfg).eval()
    formats = {n: m.data_format for n, m in model.named_modules() if type(m).__name__ == "ConvNextLayerNorm"}
    assert set(formats.values()) == {"channels_first", "channels_last"}
    x = torch.randn(2, 3, 32, 32)
    # LayerNorm for LayerNorm: the converted model computes exactly what the original does
    same = copy.deepcopy(model)
    rec = normlab.convert_norms(same, "layer_norm")
    assert not rec.skipped and len(rec.sites) == len(formats) + 1  # + the pooled output's nn.LayerNorm
    assert {s.name for s in rec.sites if s.kwargs.get("channel_dim") == 1} == {
        n for n, f in formats.items() if f == "channels_first"
    }
    with torch.no_grad():
        torch.testing.assert_close(same(x).last_hidden_state, model(x).last_hidden_state, rtol=1e-5, atol=1e-5)
    # DyT, calibrated on image batches: every site fitted, the structure rebuilt from the record
    conv = copy.deepcopy(model)
    rec = normlab.convert_norms(conv, "dyt", calibrate=[torch.randn(4, 3, 32, 32) for _ in range(2)])
    assert not rec.skipped and all(s.fit is not None for s in rec.sites)
    assert "no sequence axis" in rec.notes[0]
    fresh = normlab.conversion.export.saving.apply_record(transformers.ConvNextModel(cfg), rec)
    fresh.load_state_dict(conv.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(fresh.eval()(x).last_hidden_state, conv(x).last_hidden_state)


def test_vit_layer_norms_convert_and_calibrate():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.ViTConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=16, patch_size=4
    )
    torch.manual_seed(0)
    model = transformers.ViTModel(cfg, add_pooling_layer=False).eval()
    rec = normlab.convert_norms(model, "dyisru", calibrate=[torch.randn(4, 3, 16, 16)])
    assert len(rec.sites) == 2 * 2 + 1 and not rec.skipped  # two per layer and the final one
    with torch.no_grad():
        assert torch.isfinite(model(torch.randn(2, 3, 16, 16)).last_hidden_state).all()
