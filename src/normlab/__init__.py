"""normlab: the reference toolkit for normalization layers and their element-wise replacements."""

from normlab import functional
from normlab.conversion.convert import ConversionRecord, convert_norms, fidelity, load_converted, save_converted
from normlab.conversion.export.fold import FoldReport, fold
from normlab.conversion.export.onnx_export import OnnxCheck, OnnxExport, export_onnx
from normlab.conversion.heal.distill import HealReport, heal
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

__all__ = [
    "functional", "create_norm", "list_norms", "norm_layer", "norm_spec", "replace_norms", "SwapRecord",
    "ConversionRecord", "convert_norms", "fidelity",
    "load_converted", "save_converted", "export_onnx", "OnnxCheck", "OnnxExport", "heal", "HealReport", "fold",
    "FoldReport", "prime_running_stats", "LayerNorm",
    "RMSNorm", "L1Norm", "LMaxNorm", "GroupRMS", "RMSDetached", "RMSEMA", "RMSPartialCoupling", *_elementwise_names,
]  # fmt: skip
