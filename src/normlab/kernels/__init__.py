"""Fused Triton kernels for DyT, DyISRU and RMSNorm, each checked against :mod:`normlab.functional`.

Modules choose their path with ``kernel=``:
    "auto"       the fused kernel for CUDA tensors when Triton is installed, the reference otherwise;
    "triton"     always the fused kernel (on CPU only under TRITON_INTERPRET=1, for testing);
    "reference"  always :mod:`normlab.functional`.

The functions here take tensors of any shape (..., C); non-contiguous inputs are copied
to a contiguous layout with unit column stride first.
"""

from __future__ import annotations

import functools
import os

import torch

from normlab.kernels._common import check_operands

__all__ = ["triton_status", "use_kernel", "dyt", "dyisru", "rms_norm", "KERNEL_CHOICES"]

KERNEL_CHOICES = ("auto", "triton", "reference")


@functools.lru_cache(maxsize=1)
def triton_status() -> tuple[bool, str]:
    """(available, reason): whether ``import triton`` works, and why not."""
    try:
        import triton  # noqa: F401
    except Exception as e:  # noqa: BLE001  (ImportError, or a broken install)
        return False, f"Triton cannot be imported ({type(e).__name__}: {e}); pip install triton"
    return True, ""


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_kernel(choice: str, x: torch.Tensor, owner: str) -> bool:
    """Whether ``owner`` should run its fused kernel on ``x`` for the module setting ``choice``."""
    if choice == "reference":
        return False
    ok, why = triton_status()
    if choice == "auto":
        return ok and x.is_cuda
    if not ok:
        raise RuntimeError(f"{owner}(kernel='triton'): {why}")
    if not x.is_cuda and not interpreting():
        raise RuntimeError(f"{owner}(kernel='triton'): the input is on {x.device}; the fused kernel needs a CUDA "
                           "tensor, or TRITON_INTERPRET=1 to run it on the CPU for testing")  # fmt: skip
    return True


def dyt(x, alpha, weight, bias=None):
    """Fused gamma * tanh(alpha x) + beta; alpha of shape (1,) or (C,)."""
    check_operands("dyt", x, alpha=alpha, weight=weight, bias=bias)
    from normlab.kernels.dyt_triton import dyt as fused

    return fused(x, alpha, weight, bias)


def dyisru(x, beta, weight, bias=None, scale: float | None = None):
    """Fused weight * scale * x / sqrt(beta + x^2) + bias; beta of shape (1,) or (C,)."""
    check_operands("dyisru", x, beta=beta, weight=weight, bias=bias)
    from normlab.kernels.dyisru_triton import dyisru as fused

    return fused(x, beta, weight, bias, scale)


def rms_norm(x, weight, eps: float):
    """Fused RMSNorm with a weight; saves fp32 rstd for the backward."""
    check_operands("rms_norm", x, weight=weight)
    from normlab.kernels.rms_norm_triton import rms_norm as fused

    return fused(x, weight, eps)
