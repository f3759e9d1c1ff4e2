"""Reference math: one pure-PyTorch function per normalization.

This package is normlab's single source of truth for every formula: the norms with a statistic over
the channels in `normlab.functional.statistic`, the element-wise ones in `normlab.functional.pointwise`. Modules,
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

from normlab.functional.common import EPS as EPS  # the RMS family's default eps
from normlab.functional.common import Scale as Scale
from normlab.functional.common import channel_scale
from normlab.functional.pointwise import (
    derf,
    dyisru,
    dyt,
    dyt_hardtanh,
    dyt_sigmoid,
    eln,
    fixed_scale,
    layer_scale,
    scaled_dyt,
    sign_sqrt,
    tanh_fixed,
)
from normlab.functional.statistic import (
    dyt_rms_denominator,
    group_rms,
    l1_norm,
    layer_norm,
    lmax_norm,
    rms_detached,
    rms_ema,
    rms_norm,
    rms_partial_coupling,
)

__all__ = [
    "layer_norm",
    "rms_norm",
    "dyt",
    "derf",
    "dyt_hardtanh",
    "dyt_sigmoid",
    "tanh_fixed",
    "fixed_scale",
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
