"""normlab: the reference toolkit for normalization layers and their element-wise replacements.

The norms, the registry and `replace_norms` load with the package; the conversion of a pretrained model
(`convert_norms`, `heal`, `fold`, `export_onnx`, ...) loads on first use, so that a training script that swaps its
norms never imports the conversion wing.
"""

import importlib

from normlab import functional
from normlab.elementwise import *  # noqa: F401,F403
from normlab.elementwise import __all__ as _elementwise_names
from normlab.modules import (  # noqa: F401
    RMSEMA,
    GroupRMS,
    L1Norm,
    LayerNorm,
    LMaxNorm,
    RMSDetached,
    RMSNorm,
    RMSPartialCoupling,
    prime_running_stats,
)
from normlab.registry import create_norm, list_norms, norm_layer, norm_spec
from normlab.swap import SwapRecord, replace_norms
from normlab.version import __version__  # noqa: F401  (written once, in normlab.version)

#: The conversion wing's public names, by the module that defines each: imported on first use (PEP 562).
_LAZY = {
    "ConversionRecord": "normlab.record",
    "convert_norms": "normlab.conversion.convert",
    "fidelity": "normlab.conversion.measure.fidelity",
    "load_converted": "normlab.conversion.export.saving",
    "save_converted": "normlab.conversion.export.saving",
    "fold": "normlab.conversion.export.fold",
    "FoldReport": "normlab.conversion.export.fold",
    "export_onnx": "normlab.conversion.export.onnx_export",
    "OnnxCheck": "normlab.conversion.export.onnx_export",
    "OnnxExport": "normlab.conversion.export.onnx_export",
    "heal": "normlab.conversion.heal.distill",
    "HealReport": "normlab.conversion.heal.loop",
}


__all__ = [
    "functional", "create_norm", "list_norms", "norm_layer", "norm_spec", "replace_norms", "SwapRecord", *_LAZY,
    "prime_running_stats", "LayerNorm", "RMSNorm", "L1Norm", "LMaxNorm", "GroupRMS", "RMSDetached", "RMSEMA",
    "RMSPartialCoupling", *_elementwise_names,
]  # fmt: skip


def __getattr__(name: str) -> object:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # once: later look-ups find it as a plain attribute
        return value
    raise AttributeError(f"module 'normlab' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
