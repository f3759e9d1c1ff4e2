"""The papers' theory as executable tools: Jacobians, forward gain, the outlier simulation and fits."""

from normlab.theory.fit import FitResult, fit_elementwise
from normlab.theory.gain import gain_curve, pointwise_gain_limit, rms_norm_gain
from normlab.theory.jacobian import (
    JacobianNorms,
    autograd_jacobian,
    decompose,
    derf_jacobian,
    dyisru_jacobian,
    dyt_jacobian,
    jacobian_table,
    layer_norm_jacobian,
    numerical_jacobian,
    rms_norm_jacobian,
    rms_norm_jacobian_eq6,
    rms_norm_terms,
    scaled_dyt_jacobian,
)
from normlab.theory.simulate import OutlierSimulation, Sample, simulate_many, simulate_outliers

__all__ = [
    "FitResult",
    "fit_elementwise",
    "gain_curve",
    "pointwise_gain_limit",
    "rms_norm_gain",
    "OutlierSimulation",
    "Sample",
    "simulate_many",
    "simulate_outliers",
    "JacobianNorms",
    "autograd_jacobian",
    "decompose",
    "dyisru_jacobian",
    "derf_jacobian",
    "dyt_jacobian",
    "jacobian_table",
    "layer_norm_jacobian",
    "numerical_jacobian",
    "rms_norm_jacobian",
    "rms_norm_jacobian_eq6",
    "rms_norm_terms",
    "scaled_dyt_jacobian",
]
