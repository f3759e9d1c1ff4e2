"""Reference math: one pure-PyTorch function per normalization.

This module is normlab's single source of truth for every formula. Modules,
kernels, theory tools and experiments call these functions or are tested
against them. Each docstring gives the formula and the equation of
`the papers (docs/references.md)` it implements:

* the DyISRU paper: Stollenwerk, "On the Mathematical Relationship Between Layer
  Normalization and Dynamic Activation Functions" (RMSNorm, scaled DyT,
  DyISRU);
* the ELN paper: Stollenwerk, "Elementwise Layer Normalization" (ELN);
* the dissection: "What RMSNorm Actually Does" (the dissection variants).

Conventions
-----------
* ``x`` has shape ``(..., C)``; statistics are taken over the last axis only,
  one token at a time.
* ``weight`` (gamma) and ``bias`` (beta of DyT) are the channel affine, shape
  ``(C,)``, named as in PyTorch so that a converted LayerNorm can copy them.
* float16 and bfloat16 inputs are computed in float32 and cast back, so a
  squared activation cannot overflow (in float16, ``x**2`` overflows above 256).

Non-finite inputs
-----------------
One rule, followed by these functions and by every fused kernel (tested in
``tests/kernels/test_cpu_edges.py``), so that an answer never depends on the path or
the batch size: +-inf gives the function's limit with gradient 0 (tanh, erf
and the ISRU of DyISRU saturate at +-1); NaN stays NaN at its element. A norm
that reduces over the row takes its statistic in floating point: a row holding
NaN is NaN; a row holding inf is NaN where it is centred (LayerNorm, ELN), and
for RMSNorm NaN at the inf and 0 at the finite elements (x / inf).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "layer_norm",
    "rms_norm",
    "dyt",
    "derf",
    "dyt_hardtanh",
    "dyt_sigmoid",
    "tanh_fixed",
    "layer_scale",
    "scaled_dyt",
    "dyisru",
    "eln",
    "l1_norm",
    "lmax_norm",
    "group_rms",
    "dyt_rms_denominator",
    "sign_sqrt",
    "rms_detached",
    "rms_ema",
    "rms_partial_coupling",
    "channel_scale",
]

Scale = Literal["C", "C-1"]

#: Default eps of the RMS family: float32's machine epsilon, torch.nn.RMSNorm's default (eps=None) in float32.
#: It matters: eps breaks RMSNorm's gradient/activation orthogonality by a relative eps / r^2, which at
#: GPT-2 init (r ~ 0.02) is 2.5e-3 for eps = 1e-6 and 3e-4 for this default.
EPS = float(torch.finfo(torch.float32).eps)
_LOW_PRECISION = (torch.float16, torch.bfloat16)


# --------------------------------------------------------------------------
# boundary checks and precision handling
# --------------------------------------------------------------------------
def _check_input(x: object, fn: str) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{fn}: expected x to be a torch.Tensor of shape (..., C), got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(
            f"{fn}: expected a floating-point input (float16, bfloat16, float32 or float64), "
            f"got dtype {x.dtype}; convert it first, e.g. x.float()"
        )
    if x.dim() == 0:
        raise ValueError(f"{fn}: expected an input of shape (..., C) with at least one dimension, got a 0-d tensor")


def _check_param(p: Tensor | None, name: str, x: Tensor, fn: str, *, scalar_ok: bool = False) -> None:
    """A channel parameter must have shape (C,), or () / (1,) where ``scalar_ok``."""
    if p is None:
        return
    if not isinstance(p, Tensor):
        raise TypeError(f"{fn}: expected {name} to be a torch.Tensor, got {type(p).__name__}")
    c = x.shape[-1]
    allowed = [(c,)] + ([(), (1,)] if scalar_ok else [])
    if tuple(p.shape) not in allowed:
        wanted = " or ".join(str(s) for s in allowed)
        raise ValueError(
            f"{fn}: expected {name} of shape {wanted} for an input with C={c} channels "
            f"(input shape {tuple(x.shape)}), got {name} of shape {tuple(p.shape)}"
        )


def _check_broadcastable(p: Tensor, name: str, x: Tensor, fn: str) -> None:
    try:
        shape = torch.broadcast_shapes(p.shape, x.shape)
    except RuntimeError:
        shape = None
    if shape != x.shape:
        raise ValueError(
            f"{fn}: expected {name} to be a scalar, shape (C,)=({x.shape[-1]},), or broadcastable to the "
            f"input shape {tuple(x.shape)}; got shape {tuple(p.shape)}"
        )


def _as_tensor(v: Tensor | float, x: Tensor) -> Tensor:
    return v if isinstance(v, Tensor) else torch.tensor(float(v), dtype=x.dtype, device=x.device)


def _fp32_compute(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """Check the input, run float16/bfloat16 inputs in float32, and cast the result back."""

    @functools.wraps(fn)
    def wrapper(x: Tensor, *args, **kwargs) -> Tensor:
        _check_input(x, fn.__name__)
        if x.dtype not in _LOW_PRECISION:
            return fn(x, *args, **kwargs)
        up = lambda v: v.float() if isinstance(v, Tensor) and v.is_floating_point() else v  # noqa: E731
        out = fn(x.float(), *[up(a) for a in args], **{k: up(v) for k, v in kwargs.items()})
        return out.to(x.dtype)

    return wrapper


def _affine(y: Tensor, weight: Tensor | None, bias: Tensor | None) -> Tensor:
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y


def channel_scale(c: int, scale: Scale) -> float:
    """The scale factor of the papers' element-wise forms: sqrt(C) (the DyISRU paper) or sqrt(C-1) (its
    LayerNorm and ELN versions)."""
    if scale == "C":
        return math.sqrt(c)
    if scale == "C-1":
        return math.sqrt(c - 1)
    raise ValueError(
        f"scale must be 'C' (sqrt(C), the DyISRU paper) or 'C-1' (sqrt(C-1), its LayerNorm and ELN "
        f"versions), got {scale!r}"
    )


def _rstd(ms: Tensor, eps: float) -> Tensor:
    return torch.rsqrt(ms + eps)


# --------------------------------------------------------------------------
# normalizations with a statistic over channels
# --------------------------------------------------------------------------
@_fp32_compute
def layer_norm(x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None, eps: float = 1e-5) -> Tensor:
    r"""LayerNorm: y = (x - mu) / sqrt(sigma^2 + eps) * weight + bias.

    mu and sigma^2 are the mean and the (biased) variance over the C channels,
    the DyISRU paper eqs. (1)-(2).
    """
    _check_param(weight, "weight", x, "layer_norm")
    _check_param(bias, "bias", x, "layer_norm")
    xc = x - x.mean(-1, keepdim=True)
    y = xc * _rstd(xc.pow(2).mean(-1, keepdim=True), eps)
    return _affine(y, weight, bias)


@_fp32_compute
def rms_norm(x: Tensor, weight: Tensor | None = None, eps: float = EPS) -> Tensor:
    r"""RMSNorm: y_i = weight_i * x_i / r,  r = sqrt(mean_j x_j^2 + eps).

    The DyISRU paper eqs. (3)-(4) (there with eps = 0); the dissection "A tale of two normalizers".
    """
    _check_param(weight, "weight", x, "rms_norm")
    y = x * _rstd(x.pow(2).mean(-1, keepdim=True), eps)
    return _affine(y, weight, None)


@_fp32_compute
def l1_norm(x: Tensor, weight: Tensor | None = None, eps: float = EPS) -> Tensor:
    r"""L1Norm: y = weight * x / (mean_j |x_j| + eps).  The dissection, "Denominator dissection"."""
    _check_param(weight, "weight", x, "l1_norm")
    return _affine(x / (x.abs().mean(-1, keepdim=True) + eps), weight, None)


@_fp32_compute
def lmax_norm(x: Tensor, weight: Tensor | None = None, eps: float = EPS) -> Tensor:
    r"""LMaxNorm: y = weight * x / (max_j |x_j| + eps).  The dissection, "Denominator dissection"."""
    _check_param(weight, "weight", x, "lmax_norm")
    return _affine(x / (x.abs().amax(-1, keepdim=True) + eps), weight, None)


@_fp32_compute
def group_rms(x: Tensor, weight: Tensor | None = None, group_size: int = 8, eps: float = EPS) -> Tensor:
    r"""GroupRMS: RMSNorm applied separately to consecutive groups of ``group_size`` channels.

    y_i = weight_i * x_i / sqrt(mean_{j in g(i)} x_j^2 + eps).  The dissection ("GroupRMS (8 channels)").
    When ``group_size`` does not divide C, the last group holds the remaining
    C mod group_size channels (its mean is over those channels only).
    """
    _check_param(weight, "weight", x, "group_rms")
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_rms: expected group_size to be a positive int, got {group_size!r}")
    c = x.shape[-1]
    n_groups = -(-c // group_size)
    pad = n_groups * group_size - c
    sq = F.pad(x.pow(2), (0, pad)).unflatten(-1, (n_groups, group_size)).sum(-1)  # (..., n_groups)
    counts = torch.full((n_groups,), float(group_size), dtype=x.dtype, device=x.device)
    counts[-1] = group_size - pad
    rstd = _rstd(sq / counts, eps).repeat_interleave(group_size, dim=-1)[..., :c]  # (..., C)
    return _affine(x * rstd, weight, None)


@_fp32_compute
def rms_detached(x: Tensor, weight: Tensor | None = None, eps: float = EPS) -> Tensor:
    r"""RMSNorm whose denominator is detached: same forward, no gradient through r.

    The input gradient is the diagonal term alone, weight_i / r * dL/dy_i;
    the rank-1 coupling term of the dissection ("Result 4") is removed.
    """
    _check_param(weight, "weight", x, "rms_detached")
    y = x * _rstd(x.pow(2).mean(-1, keepdim=True), eps).detach()
    return _affine(y, weight, None)


@_fp32_compute
def rms_ema(x: Tensor, running_ms: Tensor, weight: Tensor | None = None, eps: float = EPS) -> Tensor:
    r"""RMS EMA: y = weight * x / sqrt(m + eps) with m a running mean of x^2 over steps.

    ``running_ms`` (a scalar buffer kept by `normlab.modules.RMSEMA`) replaces
    the per-token statistic: there is no per-token adaptation and no gradient
    through the denominator.  The dissection, "RMS EMA (running average)".
    """
    _check_param(weight, "weight", x, "rms_ema")
    _check_broadcastable(running_ms, "running_ms", x, "rms_ema")
    return _affine(x * _rstd(running_ms.detach(), eps), weight, None)


class _RMSPartialCoupling(torch.autograd.Function):
    """RMSNorm forward; backward with the rank-1 coupling term scaled by lam."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor | None, lam: float, eps: float) -> Tensor:
        rstd = _rstd(x.pow(2).mean(-1, keepdim=True), eps)  # (..., 1)
        ctx.save_for_backward(x, weight, rstd)
        ctx.lam = lam
        return _affine(x * rstd, weight, None)

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


@_fp32_compute
def rms_partial_coupling(x: Tensor, weight: Tensor | None = None, lam: float = 1.0, eps: float = EPS) -> Tensor:
    r"""RMSNorm with tunable backward coupling (the dissection, "Result 5").

    Forward: y_i = weight_i * x_i / r.  Input gradient:

        dL/dx_i = weight_i / r * dL/dy_i  -  lam * x_i / (C r^3) * sum_j weight_j x_j dL/dy_j

    ``lam = 1`` is RMSNorm's exact gradient, ``lam = 0`` is `rms_detached`.
    For 0 < lam < 1 the gradient is deliberately not the derivative of the forward.
    """
    _check_param(weight, "weight", x, "rms_partial_coupling")
    if not math.isfinite(float(lam)):
        raise ValueError(f"rms_partial_coupling: expected a finite coupling strength lam, got {lam!r}")
    return _RMSPartialCoupling.apply(x, weight, float(lam), float(eps))


# --------------------------------------------------------------------------
# point-wise (element-wise) functions
# --------------------------------------------------------------------------
@_fp32_compute
def dyt(x: Tensor, alpha: Tensor | float, weight: Tensor | None = None, bias: Tensor | None = None) -> Tensor:
    r"""Dynamic Tanh (Zhu et al., 2025): y = weight * tanh(alpha * x) + bias.

    ``alpha`` is a scalar, or per channel with shape (C,) (the dissection's "per-channel
    alpha" row).  The dissection, "A tale of two normalizers"; the dynamic_tanh exercise.
    """
    alpha = _as_tensor(alpha, x)
    _check_param(alpha, "alpha", x, "dyt", scalar_ok=True)
    _check_param(weight, "weight", x, "dyt")
    _check_param(bias, "bias", x, "dyt")
    return _affine(torch.tanh(alpha * x), weight, bias)


@_fp32_compute
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
    """
    alpha, shift = _as_tensor(alpha, x), _as_tensor(shift, x)
    _check_param(alpha, "alpha", x, "derf", scalar_ok=True)
    _check_param(shift, "shift", x, "derf", scalar_ok=True)
    _check_param(weight, "weight", x, "derf")
    _check_param(bias, "bias", x, "derf")
    return _affine(torch.erf(alpha * x + shift), weight, bias)


@_fp32_compute
def dyt_hardtanh(x: Tensor, alpha: Tensor | float, weight: Tensor | None = None, bias: Tensor | None = None) -> Tensor:
    r"""DyT with hardtanh: y = weight * clamp(alpha * x, -1, 1) + bias.  The dissection, "Point-wise universality"."""
    alpha = _as_tensor(alpha, x)
    _check_param(alpha, "alpha", x, "dyt_hardtanh", scalar_ok=True)
    _check_param(weight, "weight", x, "dyt_hardtanh")
    _check_param(bias, "bias", x, "dyt_hardtanh")
    return _affine(F.hardtanh(alpha * x), weight, bias)


@_fp32_compute
def dyt_sigmoid(x: Tensor, alpha: Tensor | float, weight: Tensor | None = None, bias: Tensor | None = None) -> Tensor:
    r"""DyT with a sigmoid: y = weight * (2 sigmoid(alpha * x) - 1) + bias.

    Note 2 sigmoid(z) - 1 = tanh(z / 2), so its slope at 0 is alpha / 2.
    The dissection, "Point-wise universality".
    """
    alpha = _as_tensor(alpha, x)
    _check_param(alpha, "alpha", x, "dyt_sigmoid", scalar_ok=True)
    _check_param(weight, "weight", x, "dyt_sigmoid")
    _check_param(bias, "bias", x, "dyt_sigmoid")
    return _affine(2.0 * torch.sigmoid(alpha * x) - 1.0, weight, bias)


@_fp32_compute
def tanh_fixed(x: Tensor, weight: Tensor | None = None) -> Tensor:
    r"""TanhFixed (no alpha): y = weight * tanh(x).  The dissection, "Point-wise universality"."""
    _check_param(weight, "weight", x, "tanh_fixed")
    return _affine(torch.tanh(x), weight, None)


@_fp32_compute
def layer_scale(x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None) -> Tensor:
    r"""LayerScale (linear): y = weight * x + bias.  The dissection, "Point-wise universality" (diverged there)."""
    _check_param(weight, "weight", x, "layer_scale")
    _check_param(bias, "bias", x, "layer_scale")
    return _affine(x, weight, bias)


@_fp32_compute
def sign_sqrt(x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None, eps: float = 1e-6) -> Tensor:
    r"""Signed square root: y = weight * sign(x) * sqrt(|x| + eps) + bias.

    Point-wise with f'(0+) = 1 / (2 sqrt(eps)): unbounded gain as eps -> 0,
    which escapes the dissection's Theorem 1.  The dissection, "The theoretical escape hatch".
    As written in the dissection, f jumps by 2 sqrt(eps) at x = 0 (sign(0) = 0).
    """
    _check_param(weight, "weight", x, "sign_sqrt")
    _check_param(bias, "bias", x, "sign_sqrt")
    return _affine(torch.sign(x) * torch.sqrt(x.abs() + eps), weight, bias)


@_fp32_compute
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
    """
    alpha = _as_tensor(alpha, x)
    _check_param(alpha, "alpha", x, "dyt_rms_denominator", scalar_ok=True)
    _check_param(weight, "weight", x, "dyt_rms_denominator")
    _check_param(bias, "bias", x, "dyt_rms_denominator")
    xhat = x * _rstd(x.pow(2).mean(-1, keepdim=True), eps)
    return _affine(torch.tanh(alpha * xhat), weight, bias)


@_fp32_compute
def scaled_dyt(
    x: Tensor,
    alpha: Tensor | float,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    scale: Scale = "C",
) -> Tensor:
    r"""Scaled DyT: y_i = sqrt(C) * tanh(alpha * x_i), then the affine.

    The DyISRU paper eq. (12); ``scale="C-1"`` gives sqrt(C-1) * tanh(alpha * x_i), the ELN paper eq. (11).
    """
    alpha = _as_tensor(alpha, x)
    _check_param(alpha, "alpha", x, "scaled_dyt", scalar_ok=True)
    _check_param(weight, "weight", x, "scaled_dyt")
    _check_param(bias, "bias", x, "scaled_dyt")
    return _affine(channel_scale(x.shape[-1], scale) * torch.tanh(alpha * x), weight, bias)


def _isru(z: Tensor, beta: Tensor) -> Tensor:
    # z / sqrt(beta + z^2), written with hypot so that z^2 never overflows; at z = +-inf its limit sign(z) with
    # gradient 0 (inf / inf would be NaN), the inf masked out of the other branch so its gradient stays finite.
    inf = torch.isinf(z)
    finite = torch.where(inf, 0.0, z)
    return torch.where(inf, torch.sign(z), finite / torch.hypot(finite, torch.sqrt(beta)))


@_fp32_compute
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
    """
    beta = _as_tensor(beta, x)
    _check_broadcastable(beta, "beta", x, "dyisru")
    _check_param(weight, "weight", x, "dyisru")
    _check_param(bias, "bias", x, "dyisru")
    return _affine(channel_scale(x.shape[-1], scale) * _isru(x, beta), weight, bias)


@_fp32_compute
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
    """
    beta = _as_tensor(beta, x)
    _check_broadcastable(beta, "beta", x, "eln")
    _check_param(weight, "weight", x, "eln")
    _check_param(bias, "bias", x, "eln")
    mu = x.mean(-1, keepdim=True)
    xc = x - torch.where(torch.isfinite(mu), mu, torch.full_like(mu, math.nan))  # a row with inf or NaN: NaN
    return _affine(channel_scale(x.shape[-1], scale) * _isru(xc, beta), weight, bias)
