"""The theory commands' arguments and outputs: checked before any work."""

from __future__ import annotations

import pytest

from normlab.cli import main


@pytest.mark.parametrize("argv,message", [
    (["gain", "--sigma-min", "0"], "expected a number > 0"),
    (["gain", "--sigma-min", "5", "--sigma-max", "1"], "must be below --sigma-max"),
    (["gain", "--norm", "rms_norm", "--init", "foo=1"], "--init foo: none of rms_norm takes it"),
    (["simulate", "--mu", "inf"], "expected a finite number"),
    (["demo", "--std", "nan"], "expected a finite number"),
    (["gain", "--sigma-max", "1e200"], "overflows float64 (every G would read 0 or NaN); keep it below"),
    (["simulate", "--sigma", "1e160"], "the sample is too large for float64"),
    (["simulate", "--step", "1e300"], "sum of squares of C = 100 such entries overflows"),
])  # fmt: skip
def test_theory_arguments_are_checked(argv, message, capsys):
    try:
        rc = main(argv)
    except SystemExit as e:  # the parser's own refusal
        rc = e.code
    assert rc == 2 and message in capsys.readouterr().err


def test_theory_outputs_that_cannot_be_written(tmp_path, capsys):
    assert main(["gain", "--out", str(tmp_path), "--points", "3", "--samples", "2"]) == 2
    assert "is a folder; name a file" in capsys.readouterr().err
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    assert main(["simulate", "--out", str(blocker)]) == 2
    assert "is a file; simulate writes a folder" in capsys.readouterr().err
    assert main(["jacobian", "--json", str(blocker / "rows.json")]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err


def test_jacobian_default_init_applies_only_to_norms_that_take_it(capsys):
    from normlab.cli import main

    assert main(["jacobian", "--norm", "rms_norm", "--width", "8"]) == 0
    assert "gain+rank-1" in capsys.readouterr().out
    assert main(["jacobian", "--norm", "rms_norm", "--width", "8", "--init", "alpha_init=2"]) == 2  # a user's: strict
    assert main(["jacobian", "--norm", "rms_norm", "--width", "100000"]) == 2
    assert "GiB" in capsys.readouterr().err


@pytest.mark.parametrize("suffix, content", [(".json", '{"a": 1}'), (".txt", b"\x00\xff\xfe binary"),
                                             (".npy", b"not numpy")])  # fmt: skip
def test_simulate_on_a_file_that_is_not_numbers_is_a_clear_error(tmp_path, capsys, suffix, content):
    from normlab.cli import main

    p = tmp_path / f"x{suffix}"
    p.write_bytes(content if isinstance(content, bytes) else content.encode())
    assert main(["simulate", "--x", str(p), "--out", str(tmp_path / "o")]) == 2
    assert "is not a list of numbers" in capsys.readouterr().err
