"""Typed config fields (normlab.typed): one check of a section's values, a Literal's choices, the field docstrings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import pytest

from normlab.typed import check_types, choices, describe, field_docs, hints


@dataclass
class Section:
    mode: Literal["a", "b"] = "a"
    """Which mode."""
    rate: float | None = None
    """A rate, or None."""
    count: int = 1
    flag: bool = False
    names: list[str] = field(default_factory=list)


def test_every_kind_is_checked_and_named_as_the_user_typed_it():
    check_types(Section())
    for bad, says in (
        ({"mode": "c"}, "--set s.mode must be 'a' or 'b', got 'c'"),
        ({"rate": "fast"}, "--set s.rate must be a number or null, got 'fast'"),
        ({"count": 2.0}, r"--set s.count must be an int \(not 2.0, not true\), got 2.0"),
        ({"count": True}, "s.count must be an int"),
        ({"flag": "no"}, "--set s.flag must be true or false, got 'no'"),
        ({"names": "x"}, r"--set s.names must be a list \(a string each\), got 'x'"),
        ({"names": ["a", 1]}, r"--set s.names must be a list \(a string each\), got \['a', 1\]"),
    ):
        with pytest.raises(ValueError, match=says):
            check_types(Section(**bad), "s.")
    with pytest.raises(ValueError, match="^mode must be"):
        check_types(Section(mode="c"), "s.", lambda key: key.split(".")[-1])  # the Python API's naming
    check_types(Section(rate=3, count=0, flag=True))  # an int is a number


def test_choices_describe_and_docstrings_come_from_the_declaration():
    assert choices(Section, "mode") == ("a", "b")
    with pytest.raises(TypeError, match="not a Literal"):
        choices(Section, "rate")
    assert describe(hints(Section)["mode"]) == "'a' or 'b'"
    assert field_docs(Section) == {"mode": "Which mode.", "rate": "A rate, or None."}  # count has none


def test_a_toml_table_is_checked_by_the_same_types():
    """issue 67: an experiment's and a study's TOML are checked by one function, from annotations."""
    from normlab.typed import check_table

    class Table:
        name: str
        seeds: list[int]
        base: dict

    check_table({"name": "x", "seeds": [0, 1]}, Table, "f.toml")
    with pytest.raises(ValueError, match=r"^f.toml: unknown key 'sede'; it takes name, seeds, base$"):
        check_table({"sede": [0]}, Table, "f.toml")
    with pytest.raises(ValueError, match=r"f.toml: seeds must be a list \(an int \(not 2.0, not true\) each\)"):
        check_table({"seeds": [0, True]}, Table, "f.toml")
