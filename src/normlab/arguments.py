"""The checks of a layer's constructor arguments, each a clear ValueError naming the layer and the argument:
shared by `normlab.modules` and `normlab.elementwise`."""

from __future__ import annotations

import math

import torch

from normlab import kernels as K

__all__ = ["check_real", "check_positive_finite", "check_finite", "check_flag", "check_dim", "kernel_choice"]

_FLOAT32_MAX = torch.finfo(torch.float32).max


def check_real(value: object, name: str, owner: str) -> float | None:
    """A finite real number a float32 parameter can hold (True is not a number here).

    Args:
        value: What the caller passed.
        name: The argument's name, as the error shows it.
        owner: The class or function named in the error.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    if abs(value) > _FLOAT32_MAX:
        raise ValueError(
            f"{owner}: expected {name} at most {_FLOAT32_MAX:.3g} in magnitude (float32's largest), got {value!r}"
        )
    return float(value)


def check_positive_finite(value: float, name: str, owner: str) -> float:
    """A finite number > 0 as a float; anything else is a ValueError naming it.

    Args:
        value: What the caller passed.
        name: The argument's name, as the error shows it.
        owner: The class or function named in the error.
    """

    v = check_real(value, name, owner)
    if v is None or v <= 0:
        raise ValueError(f"{owner}: expected {name} to be a finite number > 0, got {value!r}")
    return v


def check_finite(value: float, name: str, owner: str) -> float:
    """A finite number as a float; anything else is a ValueError naming it.

    Args:
        value: What the caller passed.
        name: The argument's name, as the error shows it.
        owner: The class or function named in the error.
    """

    v = check_real(value, name, owner)
    if v is None:
        raise ValueError(f"{owner}: expected {name} to be a finite number, got {value!r}")
    return v


def check_flag(value: object, name: str, owner: str) -> bool:
    """True or False; anything else (1, "yes") is a ValueError naming it.

    Args:
        value: What the caller passed.
        name: The argument's name, as the error shows it.
        owner: The class or function named in the error.
    """

    if not isinstance(value, bool):
        raise ValueError(f"{owner}: expected {name} to be True or False, got {value!r}")
    return value


def check_dim(dim: object, owner: str) -> int:
    """A channel count: an int >= 1; anything else is a ValueError naming it.

    Args:
        dim: What the caller passed.
        owner: The class or function named in the error.
    """

    if not isinstance(dim, int) or isinstance(dim, bool) or dim < 1:
        raise ValueError(f"{owner}: expected dim (the number of channels) to be an int >= 1, got {dim!r}")
    return dim


def kernel_choice(kernel: str, owner: str, choices: tuple[str, ...] | None = None) -> str:
    """``kernel`` if it is one of ``choices`` (default every path), else a ValueError naming them.

    Args:
        kernel: What the caller passed.
        owner: The class or function named in the error.
        choices: The paths this layer has.
    """

    choices = choices or K.KERNEL_CHOICES
    if kernel not in choices:
        raise ValueError(f"{owner}: expected kernel in {choices}, got {kernel!r}")
    return kernel
