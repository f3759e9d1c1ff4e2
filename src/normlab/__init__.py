"""normlab: the reference toolkit for normalization layers and their element-wise replacements."""

from normlab import functional
from normlab.conversion.convert import ConversionRecord, convert_norms, fidelity, load_converted, save_converted
from normlab.conversion.heal import HealReport, heal
from normlab.modules import *  # noqa: F401,F403  (registers the layers)
from normlab.modules import __all__ as _module_names
from normlab.registry import create_norm, list_norms, norm_spec

__version__ = "0.1.0"
__all__ = [
    "functional", "create_norm", "list_norms", "norm_spec", "ConversionRecord", "convert_norms", "fidelity",
    "load_converted", "save_converted", "heal", "HealReport", *_module_names,
]  # fmt: skip
