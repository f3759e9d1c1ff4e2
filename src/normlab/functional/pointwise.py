"""The element-wise functions: DyT and its shapes, Derf, scaled DyT, DyISRU and ELN."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from normlab.functional.common import (
    Scale,
    affine,
    as_tensor,
    channel_scale,
    check_broadcastable,
    check_param,
    fp32_compute,
)


# --------------------------------------------------------------------------
# point-wise (element-wise) functions
# --------------------------------------------------------------------------
@fp32_compute
def dyt(x: Tensor, alpha: Tensor | float, weight: Tensor | None = None, bias: Tensor | None = None) -> Tensor:
    r"""Dynamic Tanh (Zhu et al., 2025): y = weight * tanh(alpha * x) + bias.

    ``alpha`` is a scalar, or per channel with shape (C,) (the dissection's "per-channel
    alpha" row).  The dissection, "A tale of two normalizers"; the dynamic_tanh exercise.

    Args:
        x: The input, (..., C); float16 and bfloat16 are computed in float32 and returned in their dtype.
        alpha: The input's scale: a number, or a tensor of shape () or (C,) (one per channel).
        weight: gamma, the channel gain, (C,); None for none.
        bias: beta, the channel shift, (C,); None for none.
    """
    alpha = as_tensor(alpha, x)
    check_param(alpha, "alpha", x, "dyt", scalar_ok=True)
    check_param(weight, "weight", x, "dyt")
    check_param(bias, "bias", x, "dyt")
    return affine(torch.tanh(alpha * x), weight, bias)


@fp32_compute
def derf(
    x: Tensor,
    alpha: Tensor | float,
    shift: Tensor | float = 0.0,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
) -> Tensor:
    r"""Dynamic erf, Derf (Chen, Lu, Zhu, Sun, Liu, arXiv 2512.10938): y = weight * erf(alpha * x + shift) + bias.

    ``alpha`` and ``shift`` are scalars or per channel (C,); published defaults alpha0 = 0.5, shift0 = 0.
    Point-wise; its slope at 0 is 2 alpha / sqrt(pi) exp(-shift^2).

    Args:
        x: The input, (..., C); float16 and bfloat16 are computed in float32 and returned in their dtype.
        alpha: The input's scale: a number, or a tensor of shape () or (C,) (one per channel).
        shift: Added inside erf: a number, or a tensor of shape () or (C,).
        weight: gamma, the channel gain, (C,); None for none.
        bias: beta, the channel shift, (C,); None for none.
    """
    alpha, shift = as_tensor(alpha, x), as_tensor(shift, x)
    check_param(alpha, "alpha", x, "derf", scalar_ok=True)
    check_param(shift, "shift", x, "derf", scalar_ok=True)
    check_param(weight, "weight", x, "derf")
    check_param(bias, "bias", x, "derf")
    return affine(torch.erf(alpha * x + shift), weight, bias)


@fp32_compute
def dyt_hardtanh(x: Tensor, alpha: Tensor | float, weight: Tensor | None = None, bias: Tensor | None = None) -> Tensor:
    r"""DyT with hardtanh: y = weight * clamp(alpha * x, -1, 1) + bias.  The dissection, "Point-wise universality".

    Args:
        x: The input, (..., C); float16 and bfloat16 are computed in float32 and returned in their dtype.
        alpha: The input's scale: a number, or a tensor of shape () or (C,) (one per channel).
        weight: gamma, the channel gain, (C,); None for none.
        bias: beta, the channel shift, (C,); None for none.
    """
    alpha = as_tensor(alpha, x)
    check_param(alpha, "alpha", x, "dyt_hardtanh", scalar_ok=True)
    check_param(weight, "weight", x, "dyt_hardtanh")
    check_param(bias, "bias", x, "dyt_hardtanh")
    return affine((alpha * x).clamp(-1.0, 1.0), weight, bias)  # hardtanh, whose backward DTensor lacks


@fp32_compute
def dyt_sigmoid(x: Tensor, alpha: Tensor | float, weight: Tensor | None = None, bias: Tensor | None = None) -> Tensor:
    r"""DyT with a sigmoid: y = weight * (2 sigmoid(alpha * x) - 1) + bias.

    Note 2 sigmoid(z) - 1 = tanh(z / 2), so its slope at 0 is alpha / 2.
    The dissection, "Point-wise universality".

    Args:
        x: The input, (..., C); float16 and bfloat16 are computed in float32 and returned in their dtype.
        alpha: The input's scale: a number, or a tensor of shape () or (C,) (one per channel).
        weight: gamma, the channel gain, (C,); None for none.
        bias: beta, the channel shift, (C,); None for none.
    """
    alpha = as_tensor(alpha, x)
    check_param(alpha, "alpha", x, "dyt_sigmoid", scalar_ok=True)
    check_param(weight, "weight", x, "dyt_sigmoid")
    check_param(bias, "bias", x, "dyt_sigmoid")
    return affine(2.0 * torch.sigmoid(alpha * x) - 1.0, weight, bias)


@fp32_compute
def tanh_fixed(x: Tensor, weight: Tensor | None = None) -> Tensor:
    r"""TanhFixed (no alpha): y = weight * tanh(x).  The dissection, "Point-wise universality".

    Args:
        x: The input, (..., C); float16 and bfloat16 are computed in float32 and returned in their dtype.
        weight: gamma, the channel gain, (C,); None for none.
    """
    check_param(weight, "weight", x, "tanh_fixed")
    return affine(torch.tanh(x), weight, None)


@fp32_compute
def fixed_scale(x: Tensor, alpha: Tensor | float, weight: Tensor | None = None, bias: Tensor | None = None) -> Tensor:
    r"""A fixed scale, the linear target: y = weight * (alpha * x) + bias, alpha fixed once calibrated (a site's
    1 / RMS, as the LayerNorm-free models of interpretability work divide by a fixed scalar). Linear in x, so a
    model's logits are a sum of each path's direct contribution (direct logit attribution is exact).

    Args:
        x: The input, (..., C).
        alpha: The input's scale: a number, or a tensor of shape () or (C,) (one per channel).
        weight: gamma, the channel gain, (C,); None for none.
        bias: beta, the channel shift, (C,); None for none.
    """
    alpha = as_tensor(alpha, x)
    check_param(alpha, "alpha", x, "fixed_scale", scalar_ok=True)
    check_param(weight, "weight", x, "fixed_scale")
    check_param(bias, "bias", x, "fixed_scale")
    return affine(alpha * x, weight, bias)


@fp32_compute
def layer_scale(x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None) -> Tensor:
    r"""LayerScale (linear): y = weight * x + bias.  The dissection, "Point-wise universality" (diverged there).

    Args:
        x: The input, (..., C); float16 and bfloat16 are computed in float32 and returned in their dtype.
        weight: gamma, the channel gain, (C,); None for none.
        bias: beta, the channel shift, (C,); None for none.
    """
    check_param(weight, "weight", x, "layer_scale")
    check_param(bias, "bias", x, "layer_scale")
    return affine(x, weight, bias)


@fp32_compute
def sign_sqrt(x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None, eps: float = 1e-6) -> Tensor:
    r"""Signed square root: y = weight * sign(x) * sqrt(|x| + eps) + bias.

    Point-wise with f'(0+) = 1 / (2 sqrt(eps)): unbounded gain as eps -> 0,
    which escapes the dissection's Theorem 1.  The dissection, "The theoretical escape hatch".
    As written in the dissection, f jumps by 2 sqrt(eps) at x = 0 (sign(0) = 0).

    Args:
        x: The input, (..., C); float16 and bfloat16 are computed in float32 and returned in their dtype.
        weight: gamma, the channel gain, (C,); None for none.
        bias: beta, the channel shift, (C,); None for none.
        eps: Added to |x| under the root; the slope at 0 is 1 / (2 sqrt(eps)).
    """
    check_param(weight, "weight", x, "sign_sqrt")
    check_param(bias, "bias", x, "sign_sqrt")
    return affine(torch.sign(x) * torch.sqrt(x.abs() + eps), weight, bias)


@fp32_compute
def scaled_dyt(
    x: Tensor,
    alpha: Tensor | float,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    scale: Scale = "C",
) -> Tensor:
    r"""Scaled DyT: y_i = sqrt(C) * tanh(alpha * x_i), then the affine.

    The DyISRU paper eq. (12); ``scale="C-1"`` gives sqrt(C-1) * tanh(alpha * x_i), the ELN paper eq. (11).

    Args:
        x: The input, (..., C); float16 and bfloat16 are computed in float32 and returned in their dtype.
        alpha: The input's scale: a number, or a tensor of shape () or (C,) (one per channel).
        weight: gamma, the channel gain, (C,); None for none.
        bias: beta, the channel shift, (C,); None for none.
        scale: "C" for sqrt(C) (the DyISRU paper), "C-1" for sqrt(C-1) (the ELN paper).
    """
    alpha = as_tensor(alpha, x)
    check_param(alpha, "alpha", x, "scaled_dyt", scalar_ok=True)
    check_param(weight, "weight", x, "scaled_dyt")
    check_param(bias, "bias", x, "scaled_dyt")
    return affine(channel_scale(x.shape[-1], scale) * torch.tanh(alpha * x), weight, bias)


def _isru(z: Tensor, beta: Tensor) -> Tensor:
    # z / sqrt(beta + z^2), written with hypot so that z^2 never overflows; at z = +-inf its limit sign(z) with
    # gradient 0 (inf / inf would be NaN), the inf masked out of the other branch so its gradient stays finite.
    inf = torch.isinf(z)
    finite = torch.where(inf, 0.0, z)
    return torch.where(inf, torch.sign(z), finite / torch.hypot(finite, torch.sqrt(beta)))


@fp32_compute
def dyisru(
    x: Tensor,
    beta: Tensor | float,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    scale: Scale = "C",
) -> Tensor:
    r"""DyISRU: y_i = sqrt(C) * x_i / sqrt(beta + x_i^2), then the affine.

    The DyISRU paper eq. (16), the exact element-wise counterpart of RMSNorm: with the
    per-token, per-channel beta_i = ||x_{\i}||^2 (eq. 14) it equals RMSNorm
    (eq. 13, Theorem 3).  ``beta`` is a positive scalar, per channel (C,), or any
    shape broadcastable to x.  Its slope at 0 is sqrt(C / beta); it matches scaled
    DyT's sqrt(C) * alpha when beta = 1 / alpha^2 (the DyISRU paper, Fig. 2 caption).
    ``scale="C-1"`` gives the ELN paper's eq. (15).

    Args:
        x: The input, (..., C); float16 and bfloat16 are computed in float32 and returned in their dtype.
        beta: The denominator's offset, > 0: a number, (C,), or any shape broadcastable to x (a per-token beta_i
            gives RMSNorm exactly).
        weight: gamma, the channel gain, (C,); None for none.
        bias: beta, the channel shift, (C,); None for none.
        scale: "C" for sqrt(C) (the DyISRU paper), "C-1" for sqrt(C-1) (the ELN paper).
    """
    beta = as_tensor(beta, x)
    check_broadcastable(beta, "beta", x, "dyisru")
    check_param(weight, "weight", x, "dyisru")
    check_param(bias, "bias", x, "dyisru")
    return affine(channel_scale(x.shape[-1], scale) * _isru(x, beta), weight, bias)


@fp32_compute
def eln(
    x: Tensor,
    beta: Tensor | float,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    scale: Scale = "C-1",
) -> Tensor:
    r"""Elementwise LayerNorm, centered form: y_i = sqrt(C-1) * (x_i - mu) / sqrt(beta + (x_i - mu)^2).

    The ELN paper eq. (13); mu is the per-token channel mean.  With beta_i =
    (C-1) sigma_{!=i}^2 - sigma^2 it equals LayerNorm (the ELN paper, Theorem 4).

    Args:
        x: The input, (..., C); centred by its per-token channel mean.
        beta: The denominator's offset, > 0: a number, (C,), or any shape broadcastable to x.
        weight: gamma, the channel gain, (C,); None for none.
        bias: beta, the channel shift, (C,); None for none.
        scale: "C-1" for sqrt(C-1) (the ELN paper), "C" for sqrt(C).
    """
    beta = as_tensor(beta, x)
    check_broadcastable(beta, "beta", x, "eln")
    check_param(weight, "weight", x, "eln")
    check_param(bias, "bias", x, "eln")
    mu = x.mean(-1, keepdim=True)
    xc = x - torch.where(torch.isfinite(mu), mu, torch.full_like(mu, math.nan))  # a row with inf or NaN: NaN
    return affine(channel_scale(x.shape[-1], scale) * _isru(xc, beta), weight, bias)
