"""Conversion of a user's model: replace its norms (``convert``), fit each replacement to the original's
outputs site by site (``calibrate``), heal it toward the original (``heal``), and real models from Hugging Face
folders and GGUF files (``hf``). Conversion depends on the norms and on ``normlab.corpus``, never on the lab."""

from normlab.conversion.convert import (
    ConversionRecord,
    convert_norms,
    fidelity,
    load_converted,
    save_converted,
)
from normlab.conversion.export.fold import FoldReport, fold
from normlab.conversion.heal.distill import HealReport, heal

__all__ = [
    "ConversionRecord",
    "convert_norms",
    "fidelity",
    "load_converted",
    "save_converted",
    "HealReport",
    "heal",
    "FoldReport",
    "fold",
]
