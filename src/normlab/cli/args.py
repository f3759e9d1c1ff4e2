"""Argument types and small helpers the subcommands share: counts, finite numbers, output files, KEY=VALUE."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

__all__ = ["count", "finite", "positive", "output_file", "parse_init", "write_json"]


def count(text: str) -> int:
    """argparse type: an int >= 1 (counts of seeds, jobs, tokens, points...)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {v}")
    return v


def finite(text: str) -> float:
    """argparse type: a finite float."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text}")
    return v


def positive(text: str) -> float:
    """argparse type: a finite float > 0."""
    v = finite(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text}")
    return v


def output_file(path: str | None, flag: str) -> None:
    """An output file's path, checked before any work: not a folder, and in a place that can be written."""
    if path is None:
        return
    from normlab.owner import check_writable

    if Path(path).is_dir():
        raise ValueError(f"{flag} {path} is a folder; name a file")
    check_writable(path, flag)


def parse_init(pairs: list[str]) -> dict:
    from normlab.pairs import parse_pairs

    return dict(parse_pairs(pairs, "--init", "alpha_init=1.0"))


def write_json(obj, path: str | None) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(obj, indent=2) + "\n")
        print(f"wrote {path}")
