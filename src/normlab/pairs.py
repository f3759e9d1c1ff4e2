"""The one KEY=VALUE parser: ``--set`` of the lab, ``--init`` of conversion and the theory commands."""

from __future__ import annotations

import json

__all__ = ["parse_value", "parse_pairs"]


def parse_value(text: str):
    """A command-line value: JSON (numbers, true/false, null, lists), else a float ('.5', 'inf'), else the word."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    try:
        return float(text)
    except ValueError:
        return {"true": True, "false": False}.get(text.lower(), text)  # "none" stays a word (amp=none)


def parse_pairs(items: list[str], flag: str, example: str) -> list[tuple[str, object]]:
    """KEY=VALUE strings as (key, parsed value) pairs; the one parser of --set, --init and their kin."""
    pairs = []
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"{flag} expects KEY=VALUE (e.g. {example}), got {item!r}")
        pairs.append((key, parse_value(value)))
    return pairs
