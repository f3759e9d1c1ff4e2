"""The one KEY=VALUE parser (``--set`` of the lab and of conversion, ``--init``), and dotted overrides of a config."""

from __future__ import annotations

import copy
import json

__all__ = ["parse_value", "parse_pairs", "apply_overrides"]


def parse_value(text: str):
    """A command-line value: JSON (numbers, true/false, null, lists), else a float ('.5', 'inf'), else the word.

    Args:
        text: The value as typed.
    """
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    try:
        return float(text)
    except ValueError:
        return {"true": True, "false": False}.get(text.lower(), text)  # "none" stays a word (amp=none)


def parse_pairs(items: list[str], flag: str, example: str) -> list[tuple[str, object]]:
    """KEY=VALUE strings as (key, parsed value) pairs; the one parser of --set, --init and their kin.

    Args:
        items: ``KEY=VALUE`` strings.
        flag: The flag named in errors (``--set``).
        example: An example shown in errors.
    """
    pairs = []
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"{flag} expects KEY=VALUE (e.g. {example}), got {item!r}")
        pairs.append((key, parse_value(value)))
    return pairs


def apply_overrides(d: dict, overrides: dict | list[str], free: tuple[str, ...] = ()) -> dict:
    """Set dotted keys (``model.width``, ``model.norm_kwargs.alpha_init``) in a config dict (a copy).

    An unknown field raises an error that names it and lists the valid ones. Inside a table whose name ends in
    ``kwargs``, or is one of ``free``, any key is allowed (those keys are the user's).

    Args:
        d: The config dict (not changed).
        overrides: Dotted key -> value, or ``KEY=VALUE`` strings.
        free: Table names whose keys are the user's (no check).
    """
    d = copy.deepcopy(d)
    items = overrides.items() if isinstance(overrides, dict) else []
    if isinstance(overrides, list):
        items = parse_pairs(overrides, "--set", "lr=3e-4 or model.width=256")
    for key, value in items:
        parts = key.split(".")
        node, path = d, []
        for i, part in enumerate(parts):
            path.append(part)
            is_last = i == len(parts) - 1
            free_dict = path[-2:-1] and (
                path[-2].endswith("kwargs") or path[-2] in free
            )  # inside a kwargs dict any key is allowed
            if part not in node and not free_dict:
                where = ".".join(path[:-1]) or "the config"
                raise ValueError(f"unknown config field {key!r}: {where} has no {part!r}; valid: {', '.join(node)}")
            if is_last:
                node[part] = value
            else:
                if not isinstance(node.get(part), dict):
                    raise ValueError(f"config field {'.'.join(path)} is not a section; cannot set {key!r}")
                node = node[part]
    return d
