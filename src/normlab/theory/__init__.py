"""The papers' theory as executable tools: Jacobians, forward gain, the outlier simulation and fits."""

from normlab.theory.jacobian import (
    JacobianNorms,
    autograd_jacobian,
    decompose,
    dyisru_jacobian,
    dyt_jacobian,
    layer_norm_jacobian,
    numerical_jacobian,
    rms_norm_jacobian,
    rms_norm_jacobian_eq6,
    rms_norm_terms,
    scaled_dyt_jacobian,
)

__all__ = [
    "JacobianNorms",
    "autograd_jacobian",
    "decompose",
    "dyisru_jacobian",
    "dyt_jacobian",
    "layer_norm_jacobian",
    "numerical_jacobian",
    "rms_norm_jacobian",
    "rms_norm_jacobian_eq6",
    "rms_norm_terms",
    "scaled_dyt_jacobian",
]
