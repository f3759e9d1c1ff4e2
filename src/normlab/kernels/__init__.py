"""Fused kernels (DyT, Derf, DyISRU, RMSNorm in Triton; more on the CPU), each checked against
:mod:`normlab.functional`: Triton on GPUs, TorchInductor on CPUs.

Modules choose their path with ``kernel=``:
    "auto"       CUDA tensors: the Triton kernel when Triton is installed. CPU tensors (float32, bfloat16,
                 float16): the fused CPU path of :mod:`normlab.kernels.cpu` (PyTorch's own fused op for
                 LayerNorm). Otherwise, and inside torch.compile (which fuses the reference itself),
                 the reference;
    "triton"     always the Triton kernel (on CPU only under TRITON_INTERPRET=1, for testing);
    "cpu"        always the fused CPU path (a CPU tensor of a supported dtype, else a clear error);
    "reference"  always :mod:`normlab.functional`.

The functions here take tensors of any shape (..., C); non-contiguous inputs are copied
to a contiguous layout with unit column stride first.
"""

from __future__ import annotations

import functools
import os

import torch

__all__ = ["triton_status", "select", "check_operands", "dyt", "derf", "dyisru", "rms_norm", "KERNEL_CHOICES"]

KERNEL_CHOICES = ("auto", "triton", "cpu", "reference")


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


def select(choice: str, x: torch.Tensor, owner: str, *params: torch.Tensor | None) -> str:
    """The path ``owner`` takes on ``x`` for the module setting ``choice``: 'triton', 'cpu' or 'reference'."""
    from normlab.kernels import cpu

    if choice == "reference":
        return "reference"
    if choice == "cpu":
        if x.device.type != "cpu" or x.dtype not in cpu.FAST_DTYPES:
            raise RuntimeError(f"{owner}(kernel='cpu'): the fused CPU path takes a CPU tensor of float32, bfloat16 "
                               f"or float16; got {x.dtype} on {x.device}. Use kernel='auto'")  # fmt: skip
        return "cpu" if cpu.usable(x, *params) else "reference"
    ok, why = triton_status()
    if choice == "auto":
        if x.is_cuda:
            return "triton" if ok else "reference"
        return "cpu" if cpu.usable(x, *params) else "reference"
    if not ok:
        raise RuntimeError(f"{owner}(kernel='triton'): {why}")
    if not x.is_cuda and not interpreting():
        raise RuntimeError(f"{owner}(kernel='triton'): the input is on {x.device}; the fused kernel needs a CUDA "
                           "tensor, or TRITON_INTERPRET=1 to run it on the CPU for testing")  # fmt: skip
    return "triton"


def check_operands(op: str, x: torch.Tensor, **params: torch.Tensor | None) -> None:
    """Same device and dtype for input and parameters, a floating input: else a clear error, never a bad launch."""
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


def dyt(x, alpha, weight, bias=None):
    """Fused gamma * tanh(alpha x) + beta; alpha of shape (1,) or (C,)."""
    check_operands("dyt", x, alpha=alpha, weight=weight, bias=bias)
    from normlab.kernels.dyt_triton import dyt as fused

    return fused(x, alpha, weight, bias)


def derf(x, alpha, shift, weight, bias=None):
    """Fused weight * erf(alpha x + shift) + bias; alpha and shift of shape (1,) or (C,)."""
    check_operands("derf", x, alpha=alpha, shift=shift, weight=weight, bias=bias)
    from normlab.kernels.derf_triton import derf as fused

    return fused(x, alpha, shift, weight, bias)


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
