"""Tables and CSV files (normlab.table), and the shipped bench CSVs."""

from __future__ import annotations

import csv

from normlab.table import append_csv


# 3: a CSV whose columns change gets a new header
def test_append_csv_with_new_columns_rewrites_the_header(tmp_path):
    path = tmp_path / "bench.csv"
    append_csv(path, [{"a": 1, "b": 2}])
    append_csv(path, [{"a": 3, "b": 4, "c": 5}])
    append_csv(path, [{"a": 6, "b": 7, "c": 8}])
    rows = list(csv.reader(path.open()))
    assert rows[0] == ["a", "b", "c"] and all(len(r) == 3 for r in rows)
    assert rows[1] == ["1", "2", ""] and rows[3] == ["6", "7", "8"]


def test_the_shipped_lab_csv_has_one_width():
    from pathlib import Path

    rows = list(csv.reader((Path(__file__).parents[1] / "bench" / "lab.csv").open()))
    assert len({len(r) for r in rows}) == 1
