"""Outlier features and low-bit error, measured on a lab model: does an element-wise norm make it easier to quantize?

Outlier statistics (`outlier_stats`), on one held-out batch, of the residual stream after each block and of the input
of every linear layer of the blocks, split into the layers that read a norm's output (``READERS``: attention's q, k,
v and the MLP's up / gate) and those that do not (``OTHERS``: attention's output projection, the MLP's down): excess
kurtosis and max / median (`normlab.quantize`).

Quantization error (`quant_gaps`): the held-out loss under round-to-nearest fake quantization (`normlab.quantize.
quantized`) minus the float loss, for each scheme of ``SCHEMES`` on every linear layer of the blocks (the embedding
and the head stay in float, as in the usual weight-only and W8A8 recipes): ``w8`` / ``w4``, weights int8 / int4,
symmetric, one scale per output channel (weight-only); ``w8a8``, weights as ``w8`` and each layer's input int8 with
one static per-tensor scale, max |x| over a calibration batch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from normlab.quantize import excess_kurtosis, input_ranges, max_over_median, quantized

__all__ = ["READERS", "OTHERS", "SCHEMES", "outlier_stats", "quant_gaps", "linears"]

READERS = ("attn.qkv", "mlp.fc", "mlp.gate", "mlp.up")  # a block's linear layers whose input is a norm's output
OTHERS = ("attn.proj", "mlp.proj")  # and those whose input is not (attention's output, the MLP's hidden)
SCHEMES = {"w8": (8, None), "w4": (4, None), "w8a8": (8, 8)}  # name -> (weight bits, activation bits or None)


def linears(model: nn.Module) -> dict[str, tuple[nn.Linear, str]]:
    """Every linear layer of a lab model's blocks by name, with its group ("readers" or "others").

    Args:
        model: A lab GPT (its ``blocks``).
    """
    out = {}
    for name, m in model.blocks.named_modules():
        if isinstance(m, nn.Linear):
            group = "readers" if name.split(".", 1)[-1] in READERS else "others"
            out[f"blocks.{name}"] = (m, group)
    return out


def _eval_pass(model: nn.Module, run: Callable[[], object]) -> None:
    was = model.training
    model.eval()
    try:
        run()
    finally:
        model.train(was)


@torch.no_grad()
def outlier_stats(model: nn.Module, idx: torch.Tensor) -> dict[str, float]:
    """Kurtosis and max / median of the residual stream after each block (``kurt_resid/i``, ``maxmed_resid/i``) and
    their means over blocks (``kurt_resid``, ``maxmed_resid``), and the means over the linear inputs of each group
    (``kurt_readers``, ``maxmed_readers``, ``kurt_others``, ``maxmed_others``), on one forward pass of ``idx``.

    Args:
        model: A lab GPT (its ``blocks``).
        idx: Token ids, (B, T).
    """
    seen: dict[str, torch.Tensor] = {}
    hooks = [
        b.register_forward_hook(lambda m, a, y, i=i: seen.__setitem__(f"resid/{i}", y))
        for i, b in enumerate(model.blocks)
    ]
    for name, (m, group) in linears(model).items():
        hooks.append(m.register_forward_pre_hook(lambda m, a, key=f"{group}:{name}": seen.__setitem__(key, a[0])))
    try:
        _eval_pass(model, lambda: model(idx))
    finally:
        for h in hooks:
            h.remove()
    out: dict[str, float] = {}
    groups: dict[str, list[tuple[float, float]]] = {"resid": [], "readers": [], "others": []}
    for key, x in seen.items():
        stats = (excess_kurtosis(x), max_over_median(x))
        if key.startswith("resid/"):
            out[f"kurt_{key}"], out[f"maxmed_{key}"] = stats
        groups[key.split("/")[0] if key.startswith("resid/") else key.split(":")[0]].append(stats)
    for group, values in groups.items():
        if values:
            out[f"kurt_{group}"] = sum(k for k, _ in values) / len(values)
            out[f"maxmed_{group}"] = sum(r for _, r in values) / len(values)
    return out


@torch.no_grad()
def quant_gaps(model: nn.Module, loss: Callable[[], float], calib: torch.Tensor) -> dict[str, float]:
    """``qgap_<scheme>``: the held-out loss with the blocks' linear layers fake-quantized by each scheme of `SCHEMES`,
    minus the float loss (``loss_float``, also returned); the model is left as it was.

    Args:
        model: A lab GPT.
        loss: The held-out loss of ``model`` as it stands (the run's evaluation).
        calib: Token ids (B, T) whose forward pass sets the activations' static scales (``w8a8``).
    """
    layers = {n: m for n, (m, _) in linears(model).items()}
    base = loss()
    out = {"loss_float": base}
    amax: dict[str, float] = {}
    _eval_pass(model, lambda: amax.update(input_ranges(layers, lambda: model(calib))))
    for scheme, (w_bits, a_bits) in SCHEMES.items():
        with quantized(layers, w_bits, a_bits, amax):
            out[f"qgap_{scheme}"] = loss() - base
    return out
