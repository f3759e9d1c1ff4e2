"""``normlab evaluate``: a converted folder judged as it will be used (`normlab.conversion.evaluate`)."""

from __future__ import annotations

import argparse

__all__ = ["add_evaluate"]


def _cmd_evaluate(args: argparse.Namespace) -> int:
    from normlab.conversion.evaluate import evaluate_folder, evaluate_folders
    from normlab.conversion.measure.usage import UsageConfig

    cfg = UsageConfig(prompts=args.prompts, long_tokens=args.long_tokens)
    common = {"original": args.original, "markdown": args.markdown, "cfg": cfg, "text": args.text}
    if len(args.folder) == 1 and not args.names:
        evaluate_folder(args.folder[0], report=args.report, **common)
        return 0
    if args.report:
        raise ValueError("--report names one report; with several folders, each report goes in its folder")
    evaluate_folders(args.folder, args.names, shown=args.side_by_side, **common)
    return 0


def _count(lo: int, hi: int):
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"expected {lo} to {hi}, got {v}")
        return v

    return parse


def add_evaluate(sub) -> None:
    from normlab.conversion.measure.usage import PROMPTS, UsageConfig

    e = sub.add_parser(
        "evaluate",
        help="judge a converted folder against its original as a user would: KL tails, same top-1, worst sequence, "
        "long inputs, stress inputs, greedy answers",
        description="Runs the converted model and the original it was made from on the held-out split, the second "
        "text and a chat set (prompts through the chat template, the original's answers as the reference), on long "
        "sequences and on stress inputs; prints per-token KL divergence (mean, median, p99, max), same top-1, the "
        "per-sequence gap (median, worst, count over +2 nats), the gap by position, blow-ups, and greedy answers "
        "side by side. Writes DIR/evaluation.json (or --report).",
    )
    e.add_argument(
        "folder",
        nargs="+",
        help="a converted model's folder (the --out of normlab convert); several "
        "conversions of one original are each judged, then compared: answers side by side, chat scores "
        "prompt by prompt against the first",
    )
    e.add_argument("--names", nargs="+", help="a name per folder in the comparison (default: the folders' names)")
    e.add_argument(
        "--side-by-side",
        type=_count(0, len(PROMPTS)),
        default=3,
        metavar="N",
        help="with several folders, the prompts whose answers are shown side by side (default 3)",
    )
    e.add_argument("--original", help="the original model (default: the one the folder records it was made from)")
    e.add_argument(
        "--prompts",
        type=_count(1, len(PROMPTS)),
        default=UsageConfig.prompts,
        help=f"chat prompts answered by both models (default {UsageConfig.prompts})",
    )
    e.add_argument(
        "--long-tokens",
        type=_count(2, 1 << 20),
        default=UsageConfig.long_tokens,
        help=f"tokens per long sequence (default {UsageConfig.long_tokens})",
    )
    e.add_argument("--text", help="judge on this text file instead of the conversion's held-out split (named as given)")
    e.add_argument("--report", help="write the report here (default: DIR/evaluation.json)")
    e.add_argument("--markdown", action="store_true", help="print the tables as Markdown")
    e.set_defaults(func=_cmd_evaluate)
