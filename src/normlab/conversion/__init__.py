"""Conversion of a user's model, by stage: replace its norms (``convert``), fit each replacement to the original's
outputs site by site (``calibrate``), heal it toward the original (``heal``), measure it (``measure``), and write
what leaves normlab (``export``); real models from Hugging Face folders and GGUF files (``hf``). Conversion depends
on the norms and on ``normlab.corpus``, never on the lab.

A subpackage's face never re-exports a name that one of its modules bears (``heal``, ``fold``, ``fidelity``):
``normlab.conversion.heal`` is the subpackage, so ``normlab.conversion.data.samples`` resolves as a dotted path;
the functions are ``normlab.heal``, ``normlab.fold`` and ``normlab.fidelity``.
"""

from normlab.conversion.convert import ConversionRecord, convert_norms, load_converted, save_converted
from normlab.conversion.export.fold import FoldReport
from normlab.conversion.heal.loop import HealReport

__all__ = ["ConversionRecord", "convert_norms", "load_converted", "save_converted", "HealReport", "FoldReport"]
