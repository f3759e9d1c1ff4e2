"""The norms with a statistic over the channels: LayerNorm, RMSNorm and the dissection's variants of its
denominator and its coupling."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from normlab.functional.common import EPS, affine, as_tensor, check_broadcastable, check_param, fp32_compute, inv_rms


# --------------------------------------------------------------------------
# normalizations with a statistic over channels
# --------------------------------------------------------------------------
@fp32_compute
def layer_norm(x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None, eps: float = 1e-5) -> Tensor:
    r"""LayerNorm: y = (x - mu) / sqrt(sigma^2 + eps) * weight + bias.

    mu and sigma^2 are the mean and the (biased) variance over the C channels,
    the DyISRU paper eqs. (1)-(2).

    Args:
        x: The input, (..., C); the statistic is over the last axis, one token at a time.
        weight: gamma, the channel gain, (C,); None for none.
        bias: beta, the channel shift, (C,); None for none.
        eps: Added to the variance under the root (torch.nn.LayerNorm's default).
    """
    check_param(weight, "weight", x, "layer_norm")
    check_param(bias, "bias", x, "layer_norm")
    xc = x - x.mean(-1, keepdim=True)
    y = xc * inv_rms(xc.pow(2).mean(-1, keepdim=True), eps)
    return affine(y, weight, bias)


@fp32_compute
def rms_norm(x: Tensor, weight: Tensor | None = None, eps: float = EPS) -> Tensor:
    r"""RMSNorm: y_i = weight_i * x_i / r,  r = sqrt(mean_j x_j^2 + eps).

    The DyISRU paper eqs. (3)-(4) (there with eps = 0); the dissection "A tale of two normalizers".

    Args:
        x: The input, (..., C); the statistic is over the last axis, one token at a time.
        weight: gamma, the channel gain, (C,); None for none.
        eps: Added to the mean square under the root.
    """
    check_param(weight, "weight", x, "rms_norm")
    y = x * inv_rms(x.pow(2).mean(-1, keepdim=True), eps)
    return affine(y, weight, None)


@fp32_compute
def l1_norm(x: Tensor, weight: Tensor | None = None, eps: float = EPS) -> Tensor:
    r"""L1Norm: y = weight * x / (mean_j |x_j| + eps).  The dissection, "Denominator dissection".

    Args:
        x: The input, (..., C); the statistic is over the last axis, one token at a time.
        weight: gamma, the channel gain, (C,); None for none.
        eps: Added to the mean absolute value.
    """
    check_param(weight, "weight", x, "l1_norm")
    return affine(x / (x.abs().mean(-1, keepdim=True) + eps), weight, None)


@fp32_compute
def lmax_norm(x: Tensor, weight: Tensor | None = None, eps: float = EPS) -> Tensor:
    r"""LMaxNorm: y = weight * x / (max_j |x_j| + eps).  The dissection, "Denominator dissection".

    Args:
        x: The input, (..., C); the statistic is over the last axis, one token at a time.
        weight: gamma, the channel gain, (C,); None for none.
        eps: Added to the largest absolute value.
    """
    check_param(weight, "weight", x, "lmax_norm")
    return affine(x / (x.abs().amax(-1, keepdim=True) + eps), weight, None)


@fp32_compute
def group_rms(x: Tensor, weight: Tensor | None = None, group_size: int = 8, eps: float = EPS) -> Tensor:
    r"""GroupRMS: RMSNorm applied separately to consecutive groups of ``group_size`` channels.

    y_i = weight_i * x_i / sqrt(mean_{j in g(i)} x_j^2 + eps).  The dissection ("GroupRMS (8 channels)").
    When ``group_size`` does not divide C, the last group holds the remaining
    C mod group_size channels (its mean is over those channels only).

    Args:
        x: The input, (..., C); each statistic is over one group of channels, one token at a time.
        weight: gamma, the channel gain, (C,); None for none.
        group_size: Channels per group, a positive int.
        eps: Added to the mean square under the root.
    """
    check_param(weight, "weight", x, "group_rms")
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_rms: expected group_size to be a positive int, got {group_size!r}")
    c = x.shape[-1]
    n_groups = -(-c // group_size)
    pad = n_groups * group_size - c
    sq = F.pad(x.pow(2), (0, pad)).unflatten(-1, (n_groups, group_size)).sum(-1)  # (..., n_groups)
    ms = sq / group_size
    if pad:  # the last group's mean is over its own channels; no new tensor, so a DTensor input stays one
        ms = torch.cat([ms[..., :-1], sq[..., -1:] / (group_size - pad)], dim=-1)
    rstd = inv_rms(ms, eps).repeat_interleave(group_size, dim=-1)[..., :c]  # (..., C)
    return affine(x * rstd, weight, None)


@fp32_compute
def rms_detached(x: Tensor, weight: Tensor | None = None, eps: float = EPS) -> Tensor:
    r"""RMSNorm whose denominator is detached: same forward, no gradient through r.

    The input gradient is the diagonal term alone, weight_i / r * dL/dy_i;
    the rank-1 coupling term of the dissection ("Result 4") is removed.

    Args:
        x: The input, (..., C); the statistic is over the last axis, one token at a time.
        weight: gamma, the channel gain, (C,); None for none.
        eps: Added to the mean square under the root.
    """
    check_param(weight, "weight", x, "rms_detached")
    y = x * inv_rms(x.pow(2).mean(-1, keepdim=True), eps).detach()
    return affine(y, weight, None)


@fp32_compute
def rms_ema(x: Tensor, running_ms: Tensor, weight: Tensor | None = None, eps: float = EPS) -> Tensor:
    r"""RMS EMA: y = weight * x / sqrt(m + eps) with m a running mean of x^2 over steps.

    ``running_ms`` (a scalar buffer kept by `normlab.modules.RMSEMA`) replaces
    the per-token statistic: there is no per-token adaptation and no gradient
    through the denominator.  The dissection, "RMS EMA (running average)".

    Args:
        x: The input, (..., C).
        running_ms: The running mean of x^2, any shape broadcastable to x (a scalar in `normlab.modules.RMSEMA`); no
            gradient flows into it.
        weight: gamma, the channel gain, (C,); None for none.
        eps: Added to the mean square under the root.
    """
    check_param(weight, "weight", x, "rms_ema")
    check_broadcastable(running_ms, "running_ms", x, "rms_ema")
    return affine(x * inv_rms(running_ms.detach(), eps), weight, None)


class _RMSPartialCoupling(torch.autograd.Function):
    """RMSNorm forward; backward with the rank-1 coupling term scaled by lam."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor | None, lam: float, eps: float) -> Tensor:
        rstd = inv_rms(x.pow(2).mean(-1, keepdim=True), eps)  # (..., 1)
        ctx.save_for_backward(x, weight, rstd)
        ctx.lam = lam
        return affine(x * rstd, weight, None)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight, rstd = ctx.saved_tensors
        c = x.shape[-1]
        gw = grad if weight is None else grad * weight  # gamma_j dL/dy_j
        dot = (gw * x).sum(-1, keepdim=True)  # sum_j gamma_j x_j dL/dy_j
        dx = gw * rstd - ctx.lam * x * rstd.pow(3) * dot / c
        dweight = None
        if weight is not None and ctx.needs_input_grad[1]:
            dweight = (grad * x * rstd).reshape(-1, c).sum(0)
        return dx, dweight, None, None


@fp32_compute
def rms_partial_coupling(x: Tensor, weight: Tensor | None = None, lam: float = 1.0, eps: float = EPS) -> Tensor:
    r"""RMSNorm with tunable backward coupling (the dissection, "Result 5").

    Forward: y_i = weight_i * x_i / r.  Input gradient:

        dL/dx_i = weight_i / r * dL/dy_i  -  lam * x_i / (C r^3) * sum_j weight_j x_j dL/dy_j

    ``lam = 1`` is RMSNorm's exact gradient, ``lam = 0`` is `rms_detached`.
    For 0 < lam < 1 the gradient is deliberately not the derivative of the forward.

    Args:
        x: The input, (..., C); the statistic is over the last axis, one token at a time.
        weight: gamma, the channel gain, (C,); None for none.
        lam: The coupling term's share of the backward, a finite number (1: RMSNorm's gradient, 0:
            `rms_detached`'s).
        eps: Added to the mean square under the root.
    """
    check_param(weight, "weight", x, "rms_partial_coupling")
    if not math.isfinite(float(lam)):
        raise ValueError(f"rms_partial_coupling: expected a finite coupling strength lam, got {lam!r}")
    return _RMSPartialCoupling.apply(x, weight, float(lam), float(eps))


@fp32_compute
def dyt_rms_denominator(
    x: Tensor,
    alpha: Tensor | float,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = EPS,
) -> Tensor:
    r"""DyT given back the coupling: y = weight * tanh(alpha * x / r) + bias, r = sqrt(mean x^2 + eps).

    The dissection ("DyT+RMS denom") names this row without spelling out its formula;
    normlab's choice is to feed tanh the RMS-normalized input, so the layer has
    RMSNorm's per-token gain and rank-1 coupling and DyT's squashing.

    Args:
        x: The input, (..., C); the statistic is over the last axis, one token at a time.
        alpha: The input's scale: a number, or a tensor of shape () or (C,) (one per channel).
        weight: gamma, the channel gain, (C,); None for none.
        bias: beta, the channel shift, (C,); None for none.
        eps: Added to the mean square under the root.
    """
    alpha = as_tensor(alpha, x)
    check_param(alpha, "alpha", x, "dyt_rms_denominator", scalar_ok=True)
    check_param(weight, "weight", x, "dyt_rms_denominator")
    check_param(bias, "bias", x, "dyt_rms_denominator")
    xhat = x * inv_rms(x.pow(2).mean(-1, keepdim=True), eps)
    return affine(torch.tanh(alpha * xhat), weight, bias)
