"""The Triton entry points, each behind one check of its operands: no bad launch, a clear error instead.

These always run Triton (on a CPU only under ``TRITON_INTERPRET=1``, for tests). Models and modules call the
dispatchers of `normlab.kernels`, which choose Triton, the CPU path or the reference.
"""

from __future__ import annotations

import torch

__all__ = ["check_operands", "unit_weight", "dyt", "derf", "dyisru", "rms_norm"]


def check_operands(op: str, x: torch.Tensor, **params: torch.Tensor | None) -> None:
    """Same device and dtype for input and parameters, a floating input: else a clear error, never a bad launch.

    Args:
        op: The kernel named in errors.
        x: The input.
        **params: The parameters by name (None where absent).
    """
    if not x.is_floating_point() or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"{op} (fused): expected a float16, bfloat16 or float32 input, got {x.dtype}")
    for name, p in params.items():
        if p is None:
            continue
        if p.device != x.device:
            where = f"{name} is on {p.device} but the input is on {x.device}"
            raise ValueError(f"{op} (fused): {where}; move the module and the input to one device")
        if p.dtype != x.dtype:
            raise ValueError(
                f"{op} (fused): {name} has dtype {p.dtype} but the input has {x.dtype}; cast the module "
                f"(module.to({x.dtype})) or use torch.autocast, which casts the input"
            )


def unit_weight(weight: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """``weight``, or for None (no affine weight) a constant of ones (C,) on x's device and dtype: the fused kernels
    always read a weight, and a missing one must mean 1, never 0.

    Args:
        weight: gamma, or None.
        x: The input (its width, device and dtype).
    """
    return torch.ones(x.shape[-1], dtype=x.dtype, device=x.device) if weight is None else weight


def dyt(
    x: torch.Tensor, alpha: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Fused gamma * tanh(alpha x) + beta; alpha of shape (1,) or (C,).

    Args:
        x: The input, (..., C), channels last.
        alpha: (1,) or (C,).
        weight: gamma, (C,), or None (1).
        bias: beta, (C,), or None.
    """
    weight = unit_weight(weight, x)
    check_operands("dyt", x, alpha=alpha, weight=weight, bias=bias)
    from normlab.kernels.dyt_triton import dyt as fused

    return fused(x, alpha, weight, bias)


def derf(
    x: torch.Tensor,
    alpha: torch.Tensor,
    shift: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Fused weight * erf(alpha x + shift) + bias; alpha and shift of shape (1,) or (C,).

    Args:
        x: The input, (..., C), channels last.
        alpha: (1,) or (C,).
        shift: (1,) or (C,).
        weight: gamma, (C,), or None (1).
        bias: beta, (C,), or None.
    """
    weight = unit_weight(weight, x)
    check_operands("derf", x, alpha=alpha, shift=shift, weight=weight, bias=bias)
    from normlab.kernels.derf_triton import derf as fused

    return fused(x, alpha, shift, weight, bias)


def dyisru(
    x: torch.Tensor,
    beta: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Fused weight * scale * x / sqrt(beta + x^2) + bias; beta of shape (1,) or (C,).

    Args:
        x: The input, (..., C), channels last.
        beta: (1,) or (C,), > 0.
        weight: gamma, (C,), or None (1).
        bias: beta, (C,), or None.
        scale: A multiple of the output before the bias; None: sqrt(C).
    """
    weight = unit_weight(weight, x)
    check_operands("dyisru", x, beta=beta, weight=weight, bias=bias)
    from normlab.kernels.dyisru_triton import dyisru as fused

    return fused(x, beta, weight, bias, scale)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Fused RMSNorm with a weight; saves fp32 rstd for the backward.

    Args:
        x: The input, (..., C), channels last.
        weight: gamma, (C,), or None (1).
        eps: Added to the mean square under the root.
    """
    weight = unit_weight(weight, x)
    check_operands("rms_norm", x, weight=weight)
    from normlab.kernels.rms_norm_triton import rms_norm as fused

    return fused(x, weight, eps)
