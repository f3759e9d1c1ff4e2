"""Conversion studies as data (normlab.study): a TOML grid of convert settings run into locked, resumable cells, with
checks; bad studies refused before any work; a killed study continues where it stopped."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import CALIB, tiny_hf, tiny_tokenizer
from normlab.cli import main
from normlab.study import METRICS, builtin_studies, load_study, run_study

pytest.importorskip("transformers")


def _study(tmp_path: Path, body: str, name: str = "tiny") -> Path:
    model, text = tiny_hf(tmp_path / "m"), tmp_path / "calib.txt"
    text.write_text(CALIB)
    path = tmp_path / f"{name}.toml"
    path.write_text(
        f'title = "a tiny study"\n[base]\nmodel = "{model}"\n"data.text" = "{text}"\nseq_len = 16\n'
        f'sequences = 4\n"data.judge" = "none"\n{body}'
    )
    return path


TWO_CELLS = """
[[cells]]
name = "global"

[[cells]]
name = "channel"
set = { per = "channel" }

[[checks]]
cell = "channel"
metric = "sites"
at_least = 5

[[checks]]
cell = "global"
metric = "ce_rise"
at_most = -100.0
why = "cannot hold: the check says so"
"""


def test_a_study_runs_its_cells_checks_them_and_skips_what_is_done(tmp_path, capsys):
    path = _study(tmp_path, TWO_CELLS)
    root = tmp_path / "runs"
    results = run_study(path, root, progress=False, bench=tmp_path / "bench")
    assert [r["status"] for r in results.values()] == ["done", "done"]
    assert results["channel"]["metrics"]["sites"] == 5  # a tiny Llama: 2 blocks x 2 norms + the final norm
    assert {"git_commit", "normlab", "torch", "machine"} <= set(results["channel"])  # what measured it
    config = json.loads((root / "tiny" / "channel" / "config.json").read_text())
    assert config["per"] == "channel" and config["model"].endswith("m")
    rows = list(csv.DictReader((root / "tiny" / "results.csv").open()))
    assert [r["cell"] for r in rows] == ["global", "channel"] and set(METRICS) <= set(rows[0])
    assert (tmp_path / "bench" / "study_tiny.csv").read_text() == (root / "tiny" / "results.csv").read_text()
    verdicts = json.loads((root / "tiny" / "checks.json").read_text())
    assert [v["passed"] for v in verdicts] == [True, False]  # a check can fail, and says so
    out = capsys.readouterr().out
    assert "PASS  channel: sites >= 5 (got 5)" in out and "FAIL  global: ce_rise <= -100.0" in out
    stamp = (root / "tiny" / "global" / "result.json").stat().st_mtime_ns
    again = run_study(path, root, progress=False)
    assert (root / "tiny" / "global" / "result.json").stat().st_mtime_ns == stamp  # not run again
    assert again["global"]["metrics"] == results["global"]["metrics"]
    assert "tiny/global: done before, skipped" in capsys.readouterr().out
    other = tmp_path / "other"
    other.mkdir()
    (other / "study_tiny.csv").write_text("target,sites,stage\ndyisru,all,calibrated\n")  # a table of another kind
    with pytest.raises(ValueError, match="holds another table"):
        run_study(path, root, progress=False, bench=other)
    assert (other / "study_tiny.csv").read_text() == "target,sites,stage\ndyisru,all,calibrated\n"
    assert len(list(csv.DictReader((root / "tiny" / "results.csv").open()))) == 2  # no second row for a skip


def test_a_changed_cell_runs_again_and_a_failed_cell_does_not_stop_the_study(tmp_path, capsys):
    path = _study(tmp_path, TWO_CELLS)
    root = tmp_path / "runs"
    run_study(path, root, only=["global"], progress=False)
    path.write_text(path.read_text().replace('name = "global"', 'name = "global"\nset = { sequences = 3 }'))
    assert run_study(path, root, only=["global"], progress=False)["global"]["status"] == "done"
    assert "done before" not in capsys.readouterr().out  # its config changed: run again
    (tmp_path / "empty").mkdir()  # a folder, so it passes the check before the cells; no model in it
    body = f'[[cells]]\nname = "gone"\nset = {{ model = "{tmp_path / "empty"}" }}\n[[cells]]\nname = "ok"\n'
    results = run_study(_study(tmp_path, body, name="half"), root, progress=False)
    assert results["gone"]["status"] == "failed"
    assert results["ok"]["status"] == "done" and (root / "half" / "gone" / "failed.txt").exists()


@pytest.mark.parametrize(("body", "says"), [
    ('[[cells]]\nname = "a"\nset = { "heal.rate" = 1 }\n', r"cells\[0\] \(a\): unknown config field 'heal.rate'"),
    ('[[cells]]\nname = "a"\nset = { per = "token" }\n', r"cells\[0\] \(a\): --set per must be 'global' or 'channel'"),
    ('[[cells]]\nname = "a"\n[[cells]]\nname = "a"\n', "a second cell named 'a'"),
    ('"heal.text" = "self"\n[[cells]]\nname = "a"\n', r"tiny.toml: \[base\]: heal.text is now data.heal"),
    ('[[cells]]\nname = "a"\nset = { "heal.text" = "self" }\n', r"cells\[0\] \(a\): set.heal.text is now data.heal"),
    ('[[cells]]\nname = "../up"\n', "name must be one path segment"),
    ('[[cells]]\nname = "a"\nset = { out = "x" }\n', "out and heal.checkpoint are the cell's folder's"),
    ('[[cells]]\nname = "a"\n[[checks]]\ncell = "a"\nmetric = "speed"\nat_most = 1\n', r"checks\[0\] needs"),
    ('[[cells]]\nname = "a"\n[[checks]]\ncell = "b"\nmetric = "sites"\nat_most = 1\n', r"checks\[0\] needs"),
    ('[[cells]]\nname = "a"\n[[checks]]\ncell = "a"\nmetric = "sites"\nat_least = "51"\n', "at_least must be a number"),
    ('cells = []\n', "no cells"),
    ('[[cells]]\nname = "a"\n[extra]\nx = 1\n', "unknown key 'extra'"),
    ('[[cells]\n', "not valid TOML"),
    ('[[cells]]\nname = "a"\nset = { model = "/nowhere/model" }\n', r"\(a\): --model /nowhere/model: no such"),
    ('[[cells]]\nname = "a"\nset = { "data.text" = "/nowhere.txt" }\n', r"\(a\): --calibrate /nowhere.txt does not"),
])  # fmt: skip
def test_a_bad_study_is_refused_naming_the_file_and_the_cell_before_any_work(tmp_path, body, says):
    path = _study(tmp_path, body)
    with pytest.raises(ValueError, match=says) as e:
        run_study(path, tmp_path / "runs", progress=False)
    assert str(path) in str(e.value)
    assert not (tmp_path / "runs").exists()  # nothing written


def test_only_names_a_cell_of_the_study_and_builtin_studies_load(tmp_path):
    path = _study(tmp_path, TWO_CELLS)
    with pytest.raises(ValueError, match="--only 'chanel'.*global, channel"):
        run_study(path, tmp_path / "runs", only=["chanel"])
    assert {"budget_walk", "real_model", "heal_recipe"} <= set(builtin_studies())
    for name in builtin_studies():
        study = load_study(name)  # every cell of every built-in study resolves and validates
        assert study.cells and all(c["cell"] in study.cells for c in study.checks)
    walk = load_study("budget_walk")
    assert walk.cells["walk"].budget.nats == 0.4 and walk.cells["walk-lbfgs"].calibrate.solver == "lbfgs"


def test_the_usable_study_s_recipes_are_the_command_line_s():
    """A cell's ``recipe`` and ``flags`` are `normlab convert`'s flags, read as the command line reads them: the
    `usable` study's recommended cell is the config `normlab convert --model smollm2 --to dyisru` plus the printed
    recipe resolves to, and a flag the command line does not have is refused naming the cell."""
    from normlab.cli import build_parser
    from normlab.cli.convert import convert_config
    from normlab.conversion.flags import RECOMMENDED

    usable = load_study("usable")
    args = build_parser().parse_args(["convert", "--model", "smollm2", "--to", "dyisru", *RECOMMENDED])
    assert usable.cells["recommended"].to_dict() == convert_config(args).to_dict()
    args = build_parser().parse_args(["convert", "--model", "qwen-coder", "--to", "dyisru", "--per", "channel",
                                      "--budget-nats", "0.4", "--heal-text", "self", "--heal-minutes", "15",
                                      "--heal-train", "lora", "--set", "heal.schedule=cooldown",
                                      "heal.teacher_top_k=1024", "heal.precision=auto"])  # fmt: skip
    assert usable.cells["qwen_budget_heal"].to_dict() == convert_config(args).to_dict()
    assert usable.cells["recommended_walk_float32"].budget.precision == "float32"


@pytest.mark.parametrize(("cell", "says"), [
    ('flags = ["--per", "channel", "--heal-speed", "2"]', r"\(a\): flags: '--heal-speed' is not one of --model"),
    ('flags = ["--init", "alpha_init=1"]', r"flags: '--init' takes a list: give its field in set"),
    ('recipe = "fast"', r"\(a\): recipe 'fast' is not one of recommended"),
    ('flags = ["--budget-nats", 0.1]', r"\(a\): flags: each flag and value is a string"),
])  # fmt: skip
def test_a_cell_s_unknown_flag_or_recipe_is_refused_before_any_work(tmp_path, cell, says):
    path = _study(tmp_path, f'[[cells]]\nname = "a"\n{cell}\n')
    with pytest.raises(ValueError, match=says):
        run_study(path, tmp_path / "runs", progress=False)
    assert not (tmp_path / "runs").exists()


def test_a_judged_cell_s_row_holds_the_judge_s_statistics(tmp_path):
    """What the README's table reads (same top-1, KL, the worst gap, the chat score, the blow-ups) is a study's row:
    a tiny Llama with a chat template, converted by flags and judged as used."""
    model = tiny_hf(tmp_path / "m")
    tiny_tokenizer().save_pretrained(model)
    (tmp_path / "calib.txt").write_text(CALIB)
    path = tmp_path / "judged.toml"
    flags = '["--to", "dyt", "--per", "channel", "--seq-len", "16", "--sequences", "4"]'
    text = tmp_path / "calib.txt"
    path.write_text(f'[base]\nmodel = "{model}"\n"data.text" = "{text}"\n[[cells]]\nname = "c"\nflags = {flags}\n')
    result = run_study(path, tmp_path / "runs", progress=False, bench=tmp_path / "bench")["c"]
    m = result["metrics"]
    assert result["status"] == "done" and m["sites"] == 5, result.get("error")
    for key in ("held_same_top1", "chat_same_top1", "held_kld_p99", "held_gap_worst", "chat_score"):
        assert isinstance(m[key], float) and m[key] >= 0, key
    assert 0 <= m["held_same_top1"] <= 1 and m["blowups"] >= 0 and m["stress_gap_worst"] is not None
    row = next(csv.DictReader((tmp_path / "bench" / "study_judged.csv").open()))
    assert float(row["held_same_top1"]) == pytest.approx(m["held_same_top1"])


@pytest.mark.slow
def test_a_killed_study_resumes_its_heal_from_the_cell_checkpoint(tmp_path):
    """A real process killed in a cell's heal: run again, the finished cell is skipped and the heal goes on from its
    checkpoint (its report says where it resumed from)."""
    path = _study(tmp_path, '[[cells]]\nname = "first"\n[[cells]]\nname = "heal"\n'
                            'set = { "heal.tokens" = 16000, "heal.eval_every" = 512 }\n')  # fmt: skip
    root = tmp_path / "runs"
    argv = [sys.executable, "-m", "normlab.cli", "study", str(path), "--root", str(root), "--no-progress"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    ckpt, deadline = root / "tiny" / "heal" / "heal.pt", time.monotonic() + 300
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if ckpt.exists() and torch_tokens(ckpt) >= 1024:
                break
            time.sleep(0.2)
        assert proc.poll() is None, "the study ended before it could be killed in its heal"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    first = (root / "tiny" / "first" / "result.json").stat().st_mtime_ns
    assert not (root / "tiny" / "heal" / "result.json").exists()
    spent = torch_report(ckpt)["seconds"]  # what the killed heal had run when it last saved
    assert main(["study", str(path), "--root", str(root), "--no-progress"]) == 0
    assert (root / "tiny" / "first" / "result.json").stat().st_mtime_ns == first
    heal = json.loads((root / "tiny" / "heal" / "result.json").read_text())["fidelity"]["heal"]
    assert heal["resumed_from"] >= 1024 and heal["tokens"] >= 16000
    assert spent > 0 and heal["seconds"] >= spent  # issue 65, G4: the seconds before the kill count
    assert not ckpt.exists()
    assert sorted(p.name for p in ckpt.parent.iterdir() if p.suffix != ".lock") == ["config.json", "result.json"]


def torch_report(ckpt: Path) -> dict:
    """A heal checkpoint's report ({"tokens": 0} while it is being replaced)."""
    import torch

    try:
        return torch.load(ckpt, weights_only=False)["report"]
    except Exception:  # noqa: BLE001  (a checkpoint being written)
        return {"tokens": 0}


def torch_tokens(ckpt: Path) -> int:
    """Tokens a heal checkpoint has trained (0 while it is being replaced)."""
    return torch_report(ckpt)["tokens"]


def test_two_studies_of_one_name_cannot_share_a_root(tmp_path, capsys):
    """issue 65, G5: ``a/s1.toml`` then ``b/s1.toml`` under one --root: the second is refused before any cell runs,
    naming both, and the first's results and checks are left as they were; the first runs again as before."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    first, second = _study(a, TWO_CELLS, name="s1"), _study(b, TWO_CELLS, name="s1")
    root = tmp_path / "runs"
    run_study(first, root, only=["global"], progress=False)
    result = (root / "s1" / "global" / "result.json").read_bytes()
    checks = (root / "s1" / "checks.json").read_bytes()
    with pytest.raises(ValueError, match=r"holds the study .*a/s1.toml, not .*b/s1.toml.*another --root"):
        run_study(second, root, progress=False)
    assert (root / "s1" / "global" / "result.json").read_bytes() == result
    assert (root / "s1" / "checks.json").read_bytes() == checks
    assert not (root / "s1" / "channel").exists()
    assert main(["study", str(second), "--root", str(root), "--no-progress"]) == 2
    assert "another --root" in capsys.readouterr().err
    run_study(first, root, only=["global"], progress=False)  # the study the root holds runs as before
    assert (root / "s1" / "global" / "result.json").read_bytes() == result


def test_a_cell_another_process_holds_is_left_to_it(tmp_path, capsys):
    """Two processes can share a study: a cell whose lock is held is skipped here ("busy"), the others run."""
    from normlab.owner import hold

    path = _study(tmp_path, TWO_CELLS)
    root = tmp_path / "runs"
    with hold(root / "tiny" / "global", "study cell"):  # another owner of the cell (a lock of its own)
        results = run_study(path, root, progress=False)
    assert results["global"]["status"] == "busy" and "in use by a live process" in results["global"]["error"]
    assert results["channel"]["status"] == "done"
    assert not (root / "tiny" / "global" / "result.json").exists()
    assert "tiny/global" in capsys.readouterr().err


def test_a_cell_records_the_commit_it_started_at(tmp_path, monkeypatch):
    """A commit made while a cell runs is not the code that ran: the result names the commit at the cell's start."""
    import normlab.conversion.workflow as workflow
    import normlab.study as study

    head = {"commit": "at-start"}
    convert = workflow.convert_model

    def convert_then_commit(*args, **kwargs):
        fid = convert(*args, **kwargs)
        head["commit"] = "made-while-it-ran"
        return fid

    monkeypatch.setattr(workflow, "convert_model", convert_then_commit)
    monkeypatch.setattr(study, "code_version", lambda: {"git_commit": head["commit"], "git_dirty": False})
    path = _study(tmp_path, '[[cells]]\nname = "global"\n')
    results = run_study(path, tmp_path / "runs", progress=False)
    assert results["global"]["git_commit"] == "at-start"


def test_a_file_given_to_bench_is_refused_before_the_first_cell(tmp_path):
    """issue 99 (STN4): `normlab study --bench FILE` ran the cell, then raised a raw FileExistsError making the
    folder. The folder is checked before any work."""
    path = _study(tmp_path, '[[cells]]\nname = "a"\n')
    (tmp_path / "table.csv").write_text("x\n")
    with pytest.raises(ValueError, match=r"--bench .*table.csv is a file; give a folder"):
        run_study(path, tmp_path / "runs", bench=tmp_path / "table.csv", progress=False)
    assert not (tmp_path / "runs" / "tiny" / "a").exists()


def test_a_study_moved_with_its_folder_keeps_its_finished_cells(tmp_path, monkeypatch, capsys):
    """issue 99 (STN1): a study file and its --root moved together (a project folder renamed) was refused as
    another study of the same name, and its finished cells were lost. Where the file lies from the study's folder
    names it too, so the moved study reads its cells back."""
    a = tmp_path / "a"
    a.mkdir()
    tiny_hf(a / "m")
    (a / "calib.txt").write_text(CALIB)
    body = 'model = "m"\n"data.text" = "calib.txt"\nseq_len = 16\nsequences = 4\n"data.judge" = "none"\n'
    (a / "s.toml").write_text(f'title = "t"\n[base]\n{body}[[cells]]\nname = "one"\n')
    monkeypatch.chdir(a)
    run_study("s.toml", "runs", progress=False)
    result = (a / "runs" / "s" / "one" / "result.json").read_bytes()
    (a).rename(tmp_path / "b")
    monkeypatch.chdir(tmp_path / "b")
    capsys.readouterr()
    run_study("s.toml", "runs", progress=False)
    assert "s/one: done before, skipped" in capsys.readouterr().out
    assert (tmp_path / "b" / "runs" / "s" / "one" / "result.json").read_bytes() == result
