"""Typed config fields, read from the dataclass that declares them.

A config section is a dataclass whose fields carry their type, their default and a docstring under the field::

    @dataclass
    class CalibrateConfig:
        massive_tokens: Literal["auto", "shared"] = "auto"
        \"\"\"Give massive tokens their own replacement: "auto" (where they separate) or "shared".\"\"\"

Everything else reads them from there: `check_types` (the one check of a section's values, a choice included),
`choices` (what a ``Literal`` field allows: argparse's ``choices=``), `field_docs` (``--help`` and the API
reference show the same words). Nothing restates a default, a choice or a field's meaning.
"""

from __future__ import annotations

import ast
import inspect
import os
import textwrap
import types
import typing
from collections.abc import Callable
from dataclasses import fields, is_dataclass
from functools import cache

__all__ = ["check_types", "check_table", "choices", "field_docs", "describe", "hints", "set_name"]

_KINDS = {bool: (bool,), int: (int,), float: (int, float), str: (str, os.PathLike), list: (list,), dict: (dict,)}
_WORDS = {bool: "true or false", int: "an int (not 2.0, not true)", float: "a number", str: "a string",
          list: "a list", dict: "a table"}  # fmt: skip


@cache
def hints(cls: type) -> dict:
    """The resolved type of each field of ``cls`` (its annotations, evaluated once)."""
    return typing.get_type_hints(cls)


def _parts(tp) -> tuple:
    """``X | None`` -> (X, NoneType); anything else -> (tp,)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return typing.get_args(tp)
    return (tp,)


def choices(cls: type, name: str) -> tuple:
    """The values a ``Literal`` field of ``cls`` allows, in the order declared (``None`` not included).

    Args:
        cls: A config dataclass.
        name: One of its ``Literal`` fields.
    """
    for part in _parts(hints(cls)[name]):
        if typing.get_origin(part) is typing.Literal:
            return typing.get_args(part)
    raise TypeError(f"{cls.__name__}.{name} is not a Literal field")


def _accepts(tp, value) -> bool | None:
    """Whether ``value`` fits ``tp``; None when ``tp`` is not a type this check knows (a section, Any)."""
    if tp is type(None):
        return value is None
    if typing.get_origin(tp) is typing.Literal:
        return any(value == a and type(value) is type(a) for a in typing.get_args(tp))
    base = typing.get_origin(tp) or tp
    if base not in _KINDS:
        return None
    if base is list and typing.get_args(tp) and isinstance(value, list):  # list[str]: each element too
        return all(_accepts(typing.get_args(tp)[0], v) for v in value)
    return isinstance(value, _KINDS[base]) and not (isinstance(value, bool) and base is not bool)


def describe(tp: object) -> str:
    """What a field of type ``tp`` takes, in words: ``'auto', 'own' or 'shared'``, ``a number or null``.

    Args:
        tp: A field's annotation.
    """
    words = []
    for part in _parts(tp):
        if part is type(None):
            continue
        if typing.get_origin(part) is typing.Literal:
            args = [repr(a) for a in typing.get_args(part)]
            words.append(", ".join(args[:-1]) + f" or {args[-1]}" if len(args) > 1 else args[0])
        elif typing.get_origin(part) is list and typing.get_args(part):
            words.append(f"a list ({describe(typing.get_args(part)[0])} each)")
        else:
            words.append(_WORDS.get(typing.get_origin(part) or part, getattr(part, "__name__", str(part))))
    return " or ".join(words) + (" or null" if type(None) in _parts(tp) else "")


def set_name(key: str) -> str:
    """How a field is named in a type error by default: as ``--set`` takes it.

    Args:
        key: A dotted field name.
    """
    return f"--set {key}"


def check_types(section: object, prefix: str = "", name: Callable[[str], str] = set_name) -> None:
    """Every field of ``section`` (a config dataclass) against its declared type, before any other check.

    A bool field takes true or false only (the word "no" is a string, and a non-empty string is true:
    ``--set overwrite=no`` once replaced an output); an int field refuses a float (32.0) and a bool; a float field
    takes an int or a float; a str field a string or a path; a ``Literal`` field one of its values; ``X | None``
    also takes null. A nested section is checked by its own call. The error names the field as ``name(prefix +
    field)`` says the user typed it (``--set calibrate.solver``, or a keyword of the Python API).

    Args:
        section: A config dataclass instance.
        prefix: Its fields' dotted prefix in errors (``heal.``).
        name: How an error names a field (default: as ``--set`` takes it).
    """
    types_ = hints(type(section))
    for f in fields(section):
        value, tp = getattr(section, f.name), types_[f.name]
        if is_dataclass(tp) or any(is_dataclass(p) for p in _parts(tp)):
            continue
        verdicts = [_accepts(p, value) for p in _parts(tp)]
        if any(verdicts) or None in verdicts:
            continue
        raise ValueError(f"{name(prefix + f.name)} must be {describe(tp)}, got {value!r}")


@cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of the dataclass ``cls`` (what ``--help`` and the API reference
    show), by field name; a field without one is absent, and so is every field when the source is not installed
    (a build without .py files: --help then shows no docstrings rather than failing)."""
    try:
        body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    except (OSError, TypeError):
        return {}
    docs = {}
    for node, after in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def check_table(table: dict, schema: type, where: str) -> None:
    """The keys of a TOML table (an experiment's, a study's, one of their runs or cells) against ``schema``, a class
    whose annotations give each key's type as a config field's: a key the schema lacks is refused, naming the keys
    it has, and a value of another kind is refused as `check_types` refuses it; both errors begin with ``where``.

    Args:
        table: The parsed table.
        schema: A class with annotations (``name: str``, ``seeds: list[int]``, ``base: dict``).
        where: What the errors begin with (the file, and the run or the cell).
    """
    kinds = hints(schema)
    unknown = sorted(set(table) - set(kinds))
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r}; it takes {', '.join(kinds)}")
    for key, value in table.items():
        verdicts = [_accepts(p, value) for p in _parts(kinds[key])]
        if not (any(verdicts) or None in verdicts):
            raise ValueError(f"{where}: {key} must be {describe(kinds[key])}, got {value!r}")
