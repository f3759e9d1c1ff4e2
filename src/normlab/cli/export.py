"""``normlab export``: a converted folder as an ONNX file that ONNX Runtime runs
(`normlab.conversion.export.onnx_export`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["add_export"]


def _cmd_export(args: argparse.Namespace) -> int:
    from normlab.conversion.export.onnx_export import (
        MIN_OPSET,
        OnnxCheck,
        check_target,
        export_onnx,
        onnx_missing,
        output_files,
        partial_folder,
    )
    from normlab.conversion.export.saving import RECORD_FILE, load_converted
    from normlab.corpus import sha256_file

    missing = onnx_missing()
    if missing:
        print(f"normlab export: error: {missing}", file=sys.stderr)
        return 2
    folder, out = Path(args.folder), Path(args.onnx)
    if not (folder / RECORD_FILE).is_file():
        raise FileNotFoundError(
            f"{folder} is not a converted model's folder (no {RECORD_FILE}): give normlab export the --out "
            "folder of `normlab convert`, or a folder normlab.save_converted wrote"
        )
    opset = MIN_OPSET if args.opset is None else args.opset
    check_target(out, opset)  # a bad name or opset is refused before the model loads
    taken = [str(f) for f in output_files(out) if f.exists()]
    if taken and not args.overwrite:
        raise ValueError(f"{taken[0]} exists; pass --overwrite to replace it, or choose another --onnx path")
    if partial_folder(out).exists():
        print(
            f"normlab export: {partial_folder(out)} is what an interrupted export left; it is replaced", file=sys.stderr
        )
    model, _ = load_converted(folder)
    made_from = {"folder": str(folder.resolve()), "record_sha256": sha256_file(folder / RECORD_FILE)}
    check = None if args.no_check else OnnxCheck()
    report = export_onnx(model, out, opset=opset, fold=not args.no_fold, check=check, made_from=made_from)
    print(report.summary())
    return 0


def add_export(sub) -> None:
    e = sub.add_parser(
        "export",
        help="write a converted folder as an ONNX file with its KV cache, checked in ONNX Runtime",
        description="Folds each norm's gamma into the linear layers that read it, exports one decoding step "
        "(input_ids and the cache in, logits and the new cache out) with torch.onnx, and checks it in ONNX Runtime: "
        "logits against PyTorch's on random sequences, and 32 greedy tokens against generate. "
        "Writes OUT.onnx, OUT.onnx.data (the weights) and OUT.onnx.json (what it is and the check).",
    )
    e.add_argument("folder", help="a converted model's folder (the --out of normlab convert)")
    e.add_argument("--onnx", required=True, metavar="OUT.onnx", help="the ONNX file to write")
    e.add_argument("--opset", type=int, help="ONNX opset, 18 or newer (default 18)")
    e.add_argument("--no-fold", action="store_true", help="keep gamma and beta in the norms")
    e.add_argument("--no-check", action="store_true", help="skip the check in ONNX Runtime")
    e.add_argument("--overwrite", action="store_true", help="replace an existing OUT.onnx")
    e.set_defaults(func=_cmd_export)
