"""The ``normlab`` command line. Each subcommand lives in its own small function, filed by area: the theory
(`normlab.cli.theory`), the lab (`normlab.cli.lab`) and conversion (`normlab.cli.convert`)."""

from __future__ import annotations

import argparse
import errno
import sys
import warnings

from normlab.cli.convert import add_build_kernels, add_convert, add_study
from normlab.cli.evaluate import add_evaluate
from normlab.cli.export import add_export
from normlab.cli.lab import add_predict, add_report, add_reproduce, add_sweep, add_train
from normlab.cli.theory import add_demo, add_gain, add_jacobian, add_simulate
from normlab.errors import NormlabError

__all__ = ["main", "build_parser"]

DESCRIPTION = (
    "Normalization layers and their element-wise replacements: theory, a training lab, and conversion of real "
    "models. `normlab COMMAND --help` for each."
)

# The page of the documentation (docs/ in the repository; `make docs` builds the site) that explains each command.
DOCS = {
    None: "docs/index.md",
    "demo": "docs/norms.md",
    "jacobian": "docs/theory.md",
    "gain": "docs/theory.md",
    "simulate": "docs/theory.md",
    "train": "docs/lab.md",
    "predict": "docs/results.md",
    "sweep": "docs/lab.md",
    "report": "docs/results.md",
    "reproduce": "docs/results.md",
    "convert": "docs/conversion.md",
    "study": "docs/conversion.md",
    "evaluate": "docs/conversion.md",
    "export": "docs/export.md",
    "build-kernels": "docs/kernels.md",
}


FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}  # errors of the machine a command reports as one line, exit 2
DENIED = {errno.EROFS, errno.EACCES, errno.EPERM}


def _docs_line(command: str | None) -> str:
    return f"Documentation: {DOCS[command]} in the normlab repository."


def build_parser() -> argparse.ArgumentParser:
    from normlab.version import __version__

    p = argparse.ArgumentParser(prog="normlab", description=DESCRIPTION, epilog=_docs_line(None))
    p.add_argument("--version", action="version", version=f"normlab {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands = (
        add_demo,
        add_jacobian,
        add_gain,
        add_simulate,
        add_train,
        add_predict,
        add_sweep,
        add_report,
        add_reproduce,
        add_convert,
        add_study,
        add_evaluate,
        add_export,
        add_build_kernels,
    )
    for add in commands:  # one function per command, in the order `normlab --help` lists them
        add(sub)
    for name, command in sub.choices.items():  # every command's --help ends with its page of the docs
        command.epilog = "\n\n".join(filter(None, [command.epilog, _docs_line(name)]))
    return p


def main(argv: list[str] | None = None) -> int:
    """The ``normlab`` command: parse ``argv`` and run its subcommand; returns the exit status (2 for an error the
    user can fix, printed as one line).

    Args:
        argv: The arguments; None: ``sys.argv[1:]``.
    """

    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.argv = argv
    try:
        with warnings.catch_warnings():  # a warning is one line of the command's, not a file name and a source line
            warnings.showwarning = lambda message, *_, **__: print(
                f"normlab {args.command}: warning: {message}", file=sys.stderr
            )
            return args.func(args)
    except (ValueError, TypeError, FileNotFoundError, NormlabError) as e:  # bad input: one clear line
        print(f"normlab {args.command}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the machine's, not ours: a full disk or a folder that cannot be written
        if e.errno not in FULL | DENIED:
            raise
        fix = "free some space" if e.errno in FULL else "choose a folder you can write, or fix its permissions"
        what = e.filename or "a file"
        print(
            f"normlab {args.command}: error: writing {what} failed ({e.strerror}); {fix}, then run it again",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:  # a second Ctrl-C, or one outside a training loop
        print(f"normlab {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
