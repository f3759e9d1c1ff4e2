"""How a user names a conversion field, the number checks every config section shares, and how two identities
differ.

A field with a flag of its own is named by it (``--heal-minutes``); every other field by ``--set heal.KEY``, so an
error names the field as the user typed it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

__all__ = ["SHORTHANDS", "RECOMMENDED", "RECIPE_FLAGS", "flag", "flag_fields", "finite", "int_at_least",
           "identity_difference"]  # fmt: skip

# The command line's flags that stand for a field (``normlab convert --heal-minutes 5`` is
# ``--set heal.minutes=5``). Every other field is reached with --set.
SHORTHANDS: dict[str, str] = {
    "--model": "model", "--to": "to", "--calibrate": "data.text", "--per": "per", "--exclude": "exclude",
    "--extra-class": "extra_classes",
    "--init": "init", "--seq-len": "seq_len", "--sequences": "sequences", "--budget-nats": "budget.nats",
    "--out": "out", "--overwrite": "overwrite", "--no-calibrate": "calibrate.enabled",
    "--massive-tokens": "calibrate.massive_tokens", "--heal-minutes": "heal.minutes", "--heal-tokens": "heal.tokens",
    "--heal-train": "heal.train", "--checkpoint": "heal.checkpoint",
    "--resume": "heal.resume", "--heal-text": "data.heal", "--eval-text": "data.judge",
    "--calibrate-on": "data.calibrate", "--device": "device",
}  # fmt: skip
_FLAG_OF = {v: k for k, v in SHORTHANDS.items()}

# The recommended recipe, after ``--model M --to dyisru``: the budget walk by KL on the original's own samples at
# 0.02 nats, no training (9 of SmolLM2's 61 norms, 93% same top-1; docs/conversion.md). Every page that shows a
# conversion leads with it (tests/test_docs.py), and the `usable` study's "recommended" cell runs it.
RECOMMENDED = ("--per", "channel", "--budget-nats", "0.02", "--set", "budget.metric=kl", "data.walk=self")
#: The recipes a study cell names by ``recipe = NAME`` (the command line's flags, as the docs print them).
RECIPE_FLAGS = {"recommended": RECOMMENDED}
# flags without a value: the field each sets, and to what
_SWITCHES = {"--overwrite": ("overwrite", True), "--resume": ("heal.resume", True),
             "--no-calibrate": ("calibrate.enabled", False)}  # fmt: skip
_LISTS = ("--init", "--exclude", "--extra-class")  # flags whose value is a list: a study gives them in its cell's set


def flag_fields(flags: Iterable[str]) -> dict[str, object]:
    """The fields ``normlab convert``'s flags set, by dotted key (``["--per", "channel", "--set", "heal.lr=3e-3"]``
    -> ``{"per": "channel", "heal.lr": 0.003}``), each value parsed as ``--set`` parses one: what a study cell's
    ``flags`` stand for, so a recipe the docs print as flags is run as printed.

    Args:
        flags: The flags after ``normlab convert``, as the command line splits them.
    """
    from normlab.pairs import parse_pairs, parse_value

    flags, out, i = list(flags), {}, 0
    if not all(isinstance(f, str) for f in flags):
        raise ValueError(f"flags: each flag and value is a string, as the command line takes it; got {flags!r}")
    while i < len(flags):
        f = flags[i]
        if f == "--set":
            j = i + 1
            while j < len(flags) and not flags[j].startswith("--"):
                j += 1
            out.update(parse_pairs(flags[i + 1 : j], "--set", "heal.lr=3e-3"))
            i = j
        elif f in _SWITCHES:
            out[_SWITCHES[f][0]] = _SWITCHES[f][1]
            i += 1
        elif f in SHORTHANDS and f not in _LISTS and i + 1 < len(flags) and not flags[i + 1].startswith("--"):
            out[SHORTHANDS[f]] = parse_value(flags[i + 1])
            i += 2
        else:
            known = ", ".join([*(k for k in SHORTHANDS if k not in (*_LISTS, *_SWITCHES)), *_SWITCHES, "--set"])
            why = "takes a list: give its field in set" if f in _LISTS else f"is not one of {known}, with its value"
            raise ValueError(f"flags: {f!r} {why}")
    return out


def flag(key: str) -> str:
    """How a user names a field: its flag where it has one (``--heal-minutes``), else ``--set key``.

    Args:
        key: A dotted field name, e.g. ``heal.minutes``.
    """
    return _FLAG_OF.get(key, f"--set {key}")


def finite(v: object) -> bool:
    """Whether ``v`` is a finite int or float, not a bool.

    Args:
        v: The value a user gave.
    """
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)


def int_at_least(key: str, v: object, least: int, meaning: str = "") -> None:
    """Refuse ``v`` unless it is an int (not a bool) >= ``least``, naming the field as the user names it.

    Args:
        key: The dotted field name.
        v: The value a user gave.
        least: The smallest value allowed.
        meaning: Words after the bound, e.g. " (tokens)".
    """
    if isinstance(v, bool) or not isinstance(v, int) or v < least:
        raise ValueError(f"{flag(key)} must be an int >= {least}{meaning}, got {v!r}")


def identity_difference(saved: dict | None, now: dict, keys: Iterable[str] | None = None) -> str | None:
    """What differs between a checkpoint's identity and this run's (over ``keys``, default all), each field named;
    None when they match.

    Args:
        saved: The identity a checkpoint or cache recorded, or None (nothing recorded).
        now: This run's identity.
        keys: The fields compared; None compares every one.
    """
    if saved is None:
        return "it records no identity (written by an older normlab)"
    keys = sorted(set(saved) | set(now)) if keys is None else sorted(keys)
    diffs = [f"{k}: checkpoint {saved.get(k)!r} vs now {now.get(k)!r}" for k in keys if saved.get(k) != now.get(k)]
    return "; ".join(diffs) or None
