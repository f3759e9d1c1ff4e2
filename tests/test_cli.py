"""The command line: each subcommand runs, writes what it says, and bad input is one clear line."""

import json

import numpy as np
import pytest

import normlab
from normlab.cli import main


def test_demo_prints_every_norm(capsys):

    assert main(["demo", "--dim", "32"]) == 0
    out = capsys.readouterr().out
    for name in normlab.list_norms():
        assert f"\n{name} " in out


def test_jacobian_command(capsys, tmp_path):
    assert main(["jacobian", "--norm", "rms_norm", "dyt", "--width", "256", "--json", str(tmp_path / "j.json")]) == 0
    rows = json.loads((tmp_path / "j.json").read_text())
    assert {r["norm"] for r in rows} == {"rms_norm", "dyt"}
    assert "gain+rank-1" in capsys.readouterr().out


def test_simulate_writes_figures_and_json_and_reruns_on_its_sample(tmp_path, capsys):
    out = tmp_path / "sim"
    assert main(["simulate", "--out", str(out), "--seeds", "3"]) == 0
    for f in ("outlier_steps.png", "outlier_fit.png", "simulate.json", "sample.npy"):
        assert (out / f).stat().st_size > 0
    first = json.loads((out / "simulate.json").read_text())
    assert len(first["over_seeds"]["per_seed"]["alpha"]) == 3
    # rerun the fit on exactly the saved sample: the same numbers
    assert main(["simulate", "--x", str(out / "sample.npy"), "--out", str(tmp_path / "again")]) == 0
    again = json.loads((tmp_path / "again" / "simulate.json").read_text())
    assert again["dyt"]["alpha"] == first["dyt"]["alpha"]
    assert again["dyisru"]["beta"] == first["dyisru"]["beta"]


def test_gain_command_writes_plot(tmp_path):
    png = tmp_path / "gain.png"
    assert main(["gain", "--norm", "rms_norm", "dyt", "--width", "64", "--points", "4", "--out", str(png)]) == 0
    assert png.stat().st_size > 0


def test_bad_input_is_one_clear_line(tmp_path, capsys):
    np.save(tmp_path / "bad.npy", np.zeros((2, 3)))
    assert main(["simulate", "--x", str(tmp_path / "bad.npy"), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "normlab simulate: error: expected the sample x to be a vector of shape (C,)" in err
    with pytest.raises(SystemExit, match="2"):  # now refused by the parser, before any work
        main(["simulate", "--sigma", "0", "--out", str(tmp_path)])
    assert "--sigma: expected a number > 0, got 0" in capsys.readouterr().err
    assert main(["jacobian", "--norm", "rmsnorm"]) == 2
    assert "unknown norm 'rmsnorm'. Did you mean 'rms_norm'?" in capsys.readouterr().err
    assert main(["simulate", "--x", str(tmp_path / "missing.txt"), "--out", str(tmp_path)]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_train_names_its_folder_after_the_norm_it_trains(tmp_path, capsys, monkeypatch):
    """`--set model.norm=dyt` trains DyT, so the default folder says dyt (issue 13's folder-name bug)."""
    text = tmp_path / "t.txt"
    text.write_text("To be, or not to be, that is the question.\n" * 200)
    monkeypatch.chdir(tmp_path)
    assert (
        main(["train", "--preset", "tiny", "--set", "model.norm=dyt", "steps=2", "--data", str(text), "--no-progress"])
        == 0
    )
    assert (tmp_path / "runs" / "tiny-dyt" / "summary.json").exists()
    assert not (tmp_path / "runs" / "tiny-rms_norm").exists()


# 7: only normlab's own errors are the user's fault
def test_an_internal_runtime_error_keeps_its_traceback(monkeypatch, capsys):
    from normlab import cli
    from normlab.cli import theory
    from normlab.errors import NormlabError

    def boom(args):
        raise RuntimeError("CUDA out of memory (a fault, not bad input)")

    monkeypatch.setattr(theory, "_cmd_demo", boom)
    with pytest.raises(RuntimeError, match="out of memory"):
        cli.main(["demo"])

    def ours(args):
        raise NormlabError("the folder is locked by pid 1")

    monkeypatch.setattr(theory, "_cmd_demo", ours)
    assert cli.main(["demo"]) == 2
    assert "the folder is locked by pid 1" in capsys.readouterr().err


TEXT = "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n" * 300


def test_repeated_set_flags_all_apply(corpus, tmp_path):
    """Found on the way: `--set a=1 --set b=2` kept only the last group (argparse's default action)."""
    from normlab.cli import build_parser

    args = build_parser().parse_args(["train", "--set", "steps=7", "--set", "lr=0.01", "eval_every=3"])
    assert args.set == ["steps=7", "lr=0.01", "eval_every=3"]
    args = build_parser().parse_args(["convert", "--model", "m", "--exclude", "a", "--exclude", "b"])
    assert args.exclude == ["a", "b"]


@pytest.mark.parametrize("argv, match", [
    (["simulate", "--seeds", "0"], "--seeds: expected an int >= 1, got 0"),
    (["sweep", "--jobs", "0"], "--jobs: expected an int >= 1, got 0"),
    (["gain", "--points", "0"], "--points: expected an int >= 1"),
])  # fmt: skip
def test_counts_below_one_are_refused_by_the_parser(argv, match, capsys):
    from normlab.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and match in capsys.readouterr().err


def test_version_is_the_packages(capsys):
    """`normlab --version` prints the version pyproject.toml and ``normlab.__version__`` read (issue 67)."""
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.strip() == f"normlab {normlab.__version__}"
