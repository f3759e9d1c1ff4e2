"""What every formula of `normlab.functional` shares: the input checks, float32 compute for float16 and bfloat16, the
affine, the channel scale and the constants."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

Scale = Literal["C", "C-1"]

#: Default eps of the RMS family: float32's machine epsilon, torch.nn.RMSNorm's default (eps=None) in float32.
#: It matters: eps breaks RMSNorm's gradient/activation orthogonality by a relative eps / r^2, which at
#: GPT-2 init (r ~ 0.02) is 2.5e-3 for eps = 1e-6 and 3e-4 for this default.
EPS = float(torch.finfo(torch.float32).eps)
_LOW_PRECISION = (torch.float16, torch.bfloat16)

__all__ = ["Scale", "EPS", "check_input", "check_param", "check_broadcastable", "as_tensor", "fp32_compute", "affine",
           "channel_scale", "inv_rms"]  # fmt: skip


# --------------------------------------------------------------------------
# boundary checks and precision handling
# --------------------------------------------------------------------------
def check_input(x: object, fn: str) -> None:
    """Refuse an input that is not a floating-point tensor of shape (..., C), naming the function ``fn``."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{fn}: expected x to be a torch.Tensor of shape (..., C), got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(
            f"{fn}: expected a floating-point input (float16, bfloat16, float32 or float64), "
            f"got dtype {x.dtype}; convert it first, e.g. x.float()"
        )
    if x.dim() == 0:
        raise ValueError(f"{fn}: expected an input of shape (..., C) with at least one dimension, got a 0-d tensor")


def check_param(p: Tensor | None, name: str, x: Tensor, fn: str, *, scalar_ok: bool = False) -> None:
    """Refuse a channel parameter ``name`` whose shape is not (C,) (or () / (1,) where ``scalar_ok``); None passes."""
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


def check_broadcastable(p: Tensor, name: str, x: Tensor, fn: str) -> None:
    """Refuse a parameter ``name`` that does not broadcast to the input's shape (a per-token beta may)."""
    try:
        shape = torch.broadcast_shapes(p.shape, x.shape)
    except RuntimeError:
        shape = None
    if shape != x.shape:
        raise ValueError(
            f"{fn}: expected {name} to be a scalar, shape (C,)=({x.shape[-1]},), or broadcastable to the "
            f"input shape {tuple(x.shape)}; got shape {tuple(p.shape)}"
        )


def as_tensor(v: Tensor | float, x: Tensor) -> Tensor:
    """A Python number as a 0-d tensor of the input's dtype and device; a tensor as it is."""
    return v if isinstance(v, Tensor) else torch.tensor(float(v), dtype=x.dtype, device=x.device)


def fp32_compute(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """Check the input, run float16/bfloat16 inputs in float32, and cast the result back."""

    @functools.wraps(fn)
    def wrapper(x: Tensor, *args, **kwargs) -> Tensor:
        check_input(x, fn.__name__)
        if x.dtype not in _LOW_PRECISION:
            return fn(x, *args, **kwargs)
        up = lambda v: v.float() if isinstance(v, Tensor) and v.is_floating_point() else v  # noqa: E731
        out = fn(x.float(), *[up(a) for a in args], **{k: up(v) for k, v in kwargs.items()})
        return out.to(x.dtype)

    return wrapper


def affine(y: Tensor, weight: Tensor | None, bias: Tensor | None) -> Tensor:
    """The channel affine: y * weight + bias, either of them skipped where None."""
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y


def channel_scale(c: int, scale: Scale) -> float:
    """The scale factor of the papers' element-wise forms: sqrt(C) (the DyISRU paper) or sqrt(C-1) (its
    LayerNorm and ELN versions).

    Args:
        c: The number of channels C.
        scale: "C" or "C-1".
    """
    if scale == "C":
        return math.sqrt(c)
    if scale == "C-1":
        return math.sqrt(c - 1)
    raise ValueError(
        f"scale must be 'C' (sqrt(C), the DyISRU paper) or 'C-1' (sqrt(C-1), its LayerNorm and ELN "
        f"versions), got {scale!r}"
    )


def inv_rms(ms: Tensor, eps: float) -> Tensor:
    """1 / sqrt(ms + eps): the reciprocal root of a mean square."""
    return torch.rsqrt(ms + eps)
