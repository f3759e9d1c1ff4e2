"""Calibration: each replacement fitted to the original model's outputs, site by site in the order the model runs
them (``sites``), by a two-parameter fit (``fit``), with massive tokens given their own copy (``massive``), on
activations a block-by-block replay caches (``stream``)."""

from normlab.conversion.calibrate.fit import FitOutcome, fit_replacement
from normlab.conversion.calibrate.massive import MassiveTokens
from normlab.conversion.calibrate.sites import calibrate_sites, per_channel_kwargs
from normlab.conversion.calibrate.stream import BlockStream

__all__ = ["BlockStream", "FitOutcome", "MassiveTokens", "calibrate_sites", "fit_replacement", "per_channel_kwargs"]
