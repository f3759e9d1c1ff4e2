"""What leaves normlab: a converted folder (``saving``) that loads without normlab too (``portable``), the norms'
gamma folded into the layers that read them (``fold``; the function is ``normlab.fold``), and an ONNX decoder checked
in ONNX Runtime (``onnx_export``)."""

from normlab.conversion.export.fold import FoldReport
from normlab.conversion.export.onnx_export import export_onnx
from normlab.conversion.export.portable import MODELING_FILE, PortableError
from normlab.conversion.export.saving import RECORD_FILE, apply_record, load_converted, save_converted

__all__ = ["FoldReport", "MODELING_FILE", "PortableError", "RECORD_FILE", "apply_record", "export_onnx",
           "load_converted", "save_converted"]  # fmt: skip
