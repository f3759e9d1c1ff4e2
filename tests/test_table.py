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


def test_append_csv_waits_for_another_process_appending(tmp_path):
    """A second writer of the same table waits for the first (a real process holding the table's lock) and then
    appends after its rows, instead of writing over them."""
    import subprocess
    import sys
    import time

    path = tmp_path / "bench.csv"
    ready = tmp_path / "ready"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time, pathlib\n"
            "from normlab.owner import hold\n"
            "from normlab.table import _append\n"
            "p = pathlib.Path(sys.argv[1])\n"
            "with hold(p, 'benchmark table'):\n"
            "    pathlib.Path(sys.argv[2]).touch()\n"
            "    time.sleep(1.5)\n"
            "    _append(p, [{'a': 1, 'b': 2}])\n",
            str(path),
            str(ready),
        ]
    )
    try:
        while not ready.exists():
            assert holder.poll() is None, "the process holding the lock died"
            time.sleep(0.02)
        start = time.monotonic()
        append_csv(path, [{"a": 3, "b": 4, "c": 5}])
        waited = time.monotonic() - start
    finally:
        holder.wait(timeout=30)
    assert waited > 0.5, f"append_csv did not wait for the holder ({waited:.2f} s)"
    rows = list(csv.reader(path.open()))
    assert rows == [["a", "b", "c"], ["1", "2", ""], ["3", "4", "5"]]


def test_every_shipped_bench_table_says_how_it_was_measured(tmp_path):
    """issue 67: every bench CSV has a command, commit, machine and date column; a stamp fills them in new rows
    without overriding a row's own."""
    from pathlib import Path

    for path in sorted((Path(__file__).parents[1] / "bench").glob("*.csv")):
        header = next(csv.reader(path.open()))
        assert {"command", "commit", "machine", "date"} <= set(header), (path.name, header)
    path = tmp_path / "bench.csv"
    append_csv(path, [{"a": 1}, {"a": 2, "commit": "mine"}], stamp={"command": "python x.py", "commit": "abc"})
    rows = list(csv.DictReader(path.open()))
    assert rows[0] == {"command": "python x.py", "commit": "abc", "a": "1"}
    assert rows[1] == {"command": "python x.py", "commit": "mine", "a": "2"}
