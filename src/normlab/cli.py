"""The ``normlab`` command line. Each subcommand lives in its own small function."""

from __future__ import annotations

import argparse
import sys
import time

from normlab._table import format_table


def _cmd_demo(args: argparse.Namespace) -> int:
    from normlab.demo import HEADERS, norm_table

    t0 = time.perf_counter()
    print(f"normlab demo: every registered norm at default init on one token x ~ N(0, {args.std}^2 I_{args.dim})\n")
    print(format_table(HEADERS, norm_table(args.dim, args.std, args.seed), markdown=args.markdown))
    print(
        "\ngain = ||N(x)|| / ||x||; |J|_F and |K|_F are the Frobenius norms of the Jacobian and of its off-diagonal"
        "\n(coupling) part; the last column checks the autograd Jacobian against finite differences."
        f"\n[{time.perf_counter() - t0:.1f} s]"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="normlab", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    d = sub.add_parser("demo", help="print the table of every registered norm on one input")
    d.add_argument("--dim", type=int, default=256, help="channels C of the token (default 256)")
    d.add_argument("--std", type=float, default=0.02, help="input std; 0.02 is GPT-2 init's residual stream")
    d.add_argument("--seed", type=int, default=0, help="random seed of the input")
    d.add_argument("--markdown", action="store_true", help="print a Markdown table")
    d.set_defaults(func=_cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError, FileNotFoundError) as e:  # bad input: one clear line, no traceback
        print(f"normlab {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
