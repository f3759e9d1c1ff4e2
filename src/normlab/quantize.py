"""Round-to-nearest fake quantization and outlier statistics of activations, for any model's linear layers: the
arithmetic the lab's quantization study (`normlab.lab.quant`) and the real-model measurement share.

* `excess_kurtosis`: E[(x - mean)^4] / var^2 - 3 of each token's vector over its channels, averaged over tokens (0
  for a Gaussian; outlier features, a few channels far larger than the rest, make it large), as Bondarenko et al.
  and OSP measure it; `max_over_median`: max |x| / median |x| over a tensor, how much of a per-tensor int8 range one
  outlier takes.
* `quantized`: linear layers with their weights rounded to a symmetric grid, one scale per output channel, and,
  given activation bits, their inputs rounded with one static per-tensor scale (max |x| over a calibration pass,
  `input_ranges`: no clipping search, no smoothing); the float weights come back on exit. The arithmetic stays
  float32; the values are the quantized grid's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

__all__ = ["excess_kurtosis", "max_over_median", "fake_quant_weight", "fake_quant_act", "input_ranges", "quantized"]


def excess_kurtosis(x: torch.Tensor) -> float:
    """E[(x - mean)^4] / var^2 - 3 of each row of ``x`` (..., C) over its C channels, averaged over rows.

    Args:
        x: Activations, channels last.
    """
    x = x.detach().double().flatten(0, -2)
    d = x - x.mean(-1, keepdim=True)
    var = d.pow(2).mean(-1)
    return float((d.pow(4).mean(-1) / var.clamp_min(1e-300).pow(2) - 3).mean())


def max_over_median(x: torch.Tensor) -> float:
    """max |x| / median |x| over the whole tensor (inf when the median is 0).

    Args:
        x: Activations.
    """
    a = x.detach().float().abs().flatten()
    med = float(a.median())
    return float(a.max()) / med if med > 0 else float("inf")


def fake_quant_weight(w: torch.Tensor, bits: int) -> torch.Tensor:
    """``w`` (out, in) rounded to a symmetric grid of ``bits`` with one scale per output channel (max |w| of the row
    at the grid's top), in float.

    Args:
        w: A weight matrix.
        bits: The grid's bits (8: -127..127, 4: -7..7).
    """
    top = 2 ** (bits - 1) - 1
    scale = (w.abs().amax(dim=1, keepdim=True) / top).clamp_min(torch.finfo(w.dtype).tiny)
    return (w / scale).round().clamp(-top, top) * scale


def fake_quant_act(x: torch.Tensor, amax: float, bits: int) -> torch.Tensor:
    """``x`` rounded to a symmetric grid of ``bits`` whose top is ``amax`` (one static scale for the tensor).

    Args:
        x: Activations.
        amax: The calibrated max |x|: the grid's top.
        bits: The grid's bits.
    """
    top = 2 ** (bits - 1) - 1
    scale = max(amax, 1e-30) / top
    return (x / scale).round().clamp(-top, top) * scale


@torch.no_grad()
def input_ranges(layers: dict[str, nn.Module], run: Callable[[], object]) -> dict[str, float]:
    """max |input| of each of ``layers`` over what ``run`` feeds the model (a calibration pass).

    Args:
        layers: Linear layers by name.
        run: Runs the model on the calibration data.
    """
    amax: dict[str, float] = {}

    def seen(name: str):
        return lambda m, args: amax.__setitem__(name, max(amax.get(name, 0.0), float(args[0].abs().max())))

    hooks = [m.register_forward_pre_hook(seen(n)) for n, m in layers.items()]
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    return amax


@contextlib.contextmanager
def quantized(
    layers: dict[str, nn.Linear], w_bits: int, a_bits: int | None = None, amax: dict[str, float] | None = None
) -> Iterator[None]:
    """Within the block, ``layers`` compute with weights rounded to ``w_bits`` per output channel and, with
    ``a_bits``, inputs rounded to ``a_bits`` with the static per-tensor tops ``amax`` (`input_ranges`); their float
    weights come back on exit, whatever happens inside.

    Args:
        layers: Linear layers by name.
        w_bits: The weights' bits.
        a_bits: The inputs' bits; None keeps them float (weight-only).
        amax: Each layer's calibrated input top, needed with ``a_bits``.
    """
    if a_bits is not None and (amax is None or set(layers) - set(amax)):
        raise ValueError("quantized: activation bits need every layer's calibrated input range (input_ranges)")
    saved = {n: m.weight.detach().clone() for n, m in layers.items()}
    hooks = []
    try:
        with torch.no_grad():
            for n, m in layers.items():
                m.weight.copy_(fake_quant_weight(saved[n].float(), w_bits).to(m.weight.dtype))
                if a_bits is not None:
                    top = amax[n]
                    hooks.append(
                        m.register_forward_pre_hook(
                            lambda m, args, top=top: (fake_quant_act(args[0], top, a_bits), *args[1:])
                        )
                    )
        yield
    finally:
        for h in hooks:
            h.remove()
        with torch.no_grad():
            for n, m in layers.items():
                m.weight.copy_(saved[n])
