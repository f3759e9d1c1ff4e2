"""timm models with normlab's norms, run in the torch 2.14.1 venv (``make titan``) by ``test_timm.py``: a ViT and a
ConvNeXt from timm swapped by `normlab.replace_norms` and trained a few steps, a ViT built with
``norm_layer=normlab.norm_layer("dyt")``, and a channels-first site checked channel by channel. Prints one JSON."""

from __future__ import annotations

import json

import torch
from torch import nn

import normlab
import timm


def train(model: nn.Module, img: torch.Tensor, label: torch.Tensor, steps: int = 8) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        loss = nn.functional.cross_entropy(model(img), label)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(round(loss.item(), 5))
    return losses


def channels_first_site(model: nn.Module) -> float:
    """The largest difference, relative to the largest output, between a swapped LayerNorm2d site and
    gamma[c] * tanh(alpha x[:, c]) + beta[c] by hand, on a map whose last axis has as many entries as the channels
    (where a channels-last layer would also run)."""
    name = next(n for n, m in model.named_modules() if isinstance(m, normlab.DyT) and m.channel_dim == 1)
    m = model.get_submodule(name)
    c = m.weight.numel()
    with torch.no_grad():
        m.weight.copy_(torch.arange(1.0, c + 1))
        m.bias.copy_(torch.linspace(-1, 1, c))
        x = torch.randn(2, c, 3, c)
        want = m.weight.view(1, c, 1, 1) * torch.tanh(m.alpha * x) + m.bias.view(1, c, 1, 1)
        return float((m(x) - want).abs().max() / want.abs().max())  # relative: gamma runs up to c


def main() -> None:
    torch.manual_seed(0)
    img = torch.randn(16, 3, 32, 32)
    label = (img[:, 0].mean((1, 2)) > img[:, 2].mean((1, 2))).long()  # red brighter than blue?
    out = {"timm": timm.__version__, "torch": torch.__version__}
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, num_classes=2,
                            depth=2)  # fmt: skip
    record = normlab.replace_norms(vit, "dyt", init="dyt_paper")
    out["vit"] = {"sites": [s.source for s in record.sites], "losses": train(vit, img, label),
                  "left": sorted({type(m).__name__ for m in vit.modules() if "Norm" in type(m).__name__})}  # fmt: skip
    convnext = timm.create_model("convnext_atto", pretrained=False, num_classes=2)
    record = normlab.replace_norms(convnext, "dyt", init="default")
    firsts = [s.name for s in record.sites if s.kwargs.get("channel_dim") == 1]
    out["convnext"] = {"sites": sorted({s.source for s in record.sites}), "channels_first": len(firsts),
                       "n": len(record), "losses": train(convnext, img, label),
                       "site_error": channels_first_site(convnext)}  # fmt: skip
    built = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, num_classes=2,
                              depth=2, norm_layer=normlab.norm_layer("dyt", alpha_init=1.0))  # fmt: skip
    norms = [m for m in built.modules() if isinstance(m, normlab.DyT)]
    out["norm_layer"] = {"dyt": len(norms), "alpha": sorted({m.alpha.item() for m in norms}),
                         "losses": train(built, img, label)}  # fmt: skip
    print(json.dumps(out))


if __name__ == "__main__":
    main()
