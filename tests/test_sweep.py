"""Experiments as data: the sweep resumes after SIGKILL, records divergence, shards; the report reads it."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import TEXT, write_experiment
from normlab.cli import main
from normlab.lab.runs import RunFolder
from normlab.report import write_report
from normlab.sweep import Workers, builtin_experiments, expand, load_experiment, parse_shard, run_sweep, write_index

EXPERIMENT = """
name = "smoke"
title = "Smoke test"
claim = "none"

[base]
set = {{ data = ["{data}"], steps = 40 }}

[[runs]]
name = "rms_norm"
set = {{ "model.norm" = "rms_norm" }}
paper = 3.21

[[runs]]
name = "dyt"
set = {{ "model.norm" = "dyt", "model.norm_kwargs" = {{ alpha_init = 1.0 }} }}
paper = 7.54

[[runs]]
name = "l1_norm"
set = {{ "model.norm" = "l1_norm" }}
paper = 3.21

[[runs]]
name = "layer_scale_hot"
label = "LayerScale at lr 1e3 (forced to diverge)"
set = {{ "model.norm" = "layer_scale", lr = 1e3, grad_clip = 0 }}
paper = "diverged"
"""


@pytest.fixture()
def experiment(tmp_path):
    data = tmp_path / "text.txt"
    data.write_text(TEXT)
    path = tmp_path / "smoke.toml"
    path.write_text(EXPERIMENT.format(data=data))
    return str(path)


def _final(root: Path) -> dict:
    out = {}
    for d in sorted((root / "runs").iterdir()):
        s = json.loads((d / "summary.json").read_text())
        out[d.name] = (s["status"], s.get("final_val_loss"))
    return out


def test_builtin_experiments_cover_every_table_and_resolve():
    names = builtin_experiments("default")  # what reproduce runs; the scaling study runs only at its own profile
    assert names == ["phase", "pointwise", "width", "denominator", "coupling", "coupling_sweep", "rank", "beyond"]
    assert builtin_experiments() == [*names, "quantize", "scaling"]  # the two studies run at their own profile
    quantize = expand(load_experiment("quantize"), "scaling", "/tmp/x")
    assert len(quantize) == 144 and {s.seed for s in quantize} == {0, 1}  # every rate of every grid, two seeds
    single = [s for s in quantize if s.config.model.norm_kwargs.get("scalar_gain")]
    assert len(single) == 12  # DyT with one scalar gamma, AdamW and Muon at width 64
    for profile in ("quick", "default", "long", "full", "gpu"):
        for n in names:
            assert expand(load_experiment(n), profile, "/tmp/x")  # every config validates at every profile
    beyond = expand(load_experiment("beyond"), "default", "/tmp/x")
    assert {s.seed for s in beyond} == {0, 1}  # two seeds at the default budget, three at the long one
    assert {s.seed for s in expand(load_experiment("width"), "long", "/tmp/x")} == {0, 1, 2}
    rms_gain = [s for s in beyond if s.name == "dyisru_rmsgain"][0]
    assert rms_gain.config.model.norm_kwargs["beta_init"] == pytest.approx(64 * 0.02**2)


def test_bad_experiment_and_shard_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown experiment 'nope'; built-in: phase, pointwise"):
        load_experiment("nope")
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\n[[runs]]\nname = "a"\n')
    with pytest.raises(ValueError, match="run 0 needs 'name' and 'set'"):
        load_experiment(str(bad))
    bad.write_text('name = "x"\n[[runs]]\nname = "a"\nset = { "model.norm" = "dty" }\n')
    with pytest.raises(ValueError, match="model.norm: unknown norm 'dty'"):
        expand(load_experiment(str(bad)), "tiny", tmp_path)
    with pytest.raises(ValueError, match="--shard i/n needs 0 <= i < n"):
        parse_shard("2/2")


def test_sweep_records_divergence_and_report_says_so(experiment, tmp_path):
    exp = load_experiment(experiment)
    root = tmp_path / "root"
    specs = expand(exp, "tiny", root)
    statuses = run_sweep(specs, progress=False)
    by_name = {s.name: statuses[s.run_id] for s in specs}
    assert by_name == {
        "rms_norm": "completed",
        "dyt": "completed",
        "l1_norm": "completed",
        "layer_scale_hot": "diverged",
    }
    write_index([exp], "tiny", root)
    report = write_report(root).read_text()
    row = [line for line in report.splitlines() if line.startswith("| LayerScale at lr 1e3")][0]
    assert "**diverged**" in row and "| diverged |" in row
    for s in specs:  # every number links to its run directory
        assert f"runs/{s.run_id}/" in report
    # a rerun finds everything finished and trains nothing
    mtimes = {p: p.stat().st_mtime_ns for p in root.glob("runs/*/summary.json")}
    assert run_sweep(specs, progress=False) == statuses
    assert mtimes == {p: p.stat().st_mtime_ns for p in root.glob("runs/*/summary.json")}


def test_shards_partition_the_runs(experiment, tmp_path):
    specs = expand(load_experiment(experiment), "tiny", tmp_path)
    ids = {s.run_id for s in specs}
    a, b = (set(run_sweep(specs, workers=Workers(shard=parse_shard(f"{i}/2")), progress=False)) for i in range(2))
    assert a | b == ids and not a & b


@pytest.mark.slow
def test_killed_sweep_resumes_without_redoing_finished_runs(experiment, tmp_path):
    cmd = [sys.executable, "-m", "normlab.cli", "sweep", experiment, "--profile", "tiny", "--jobs", "1",
           "--no-progress"]  # fmt: skip
    ref, killed = tmp_path / "ref", tmp_path / "killed"
    subprocess.run([*cmd, "--root", str(ref)], check=True, capture_output=True)
    proc = subprocess.Popen([*cmd, "--root", str(killed)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline:  # kill once one run has finished and the next has started
        done = [p for p in killed.glob("runs/*/summary.json") if json.loads(p.read_text()).get("status") == "completed"]
        started = list(killed.glob("runs/*/metrics.jsonl"))
        if done and len(started) > len(done):
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    finished = {
        p: p.stat().st_mtime_ns
        for p in killed.glob("runs/*/summary.json")
        if json.loads(p.read_text()).get("status") in ("completed", "diverged")
    }
    assert 1 <= len(finished) < 4, "the sweep must be killed midway"
    subprocess.run([*cmd, "--root", str(killed)], check=True, capture_output=True)
    for p, t in finished.items():  # finished runs were not redone
        assert p.stat().st_mtime_ns == t
    assert _final(killed) == _final(ref)  # the final table equals an uninterrupted sweep's


@pytest.mark.slow
def test_defect_6_one_ctrl_c_stops_a_sweep_with_jobs_1(corpus, tmp_path):
    exp = write_experiment(tmp_path, corpus, 200000)
    root = tmp_path / "root"
    cmd = [sys.executable, "-m", "normlab.cli", "sweep", str(exp), "--profile", "tiny", "--jobs", "1", "--root",
           str(root), "--no-progress"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not list(root.glob("runs/*/checkpoint.pt")):
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0, err
    assert "sweep interrupted" in err and "Continue with: normlab sweep" in err, err
    summaries = [json.loads(p.read_text()) for p in root.glob("runs/*/summary.json")]
    assert [s["status"] for s in summaries] == ["interrupted"]  # the run in flight; the next one never started
    assert len(list(root.glob("runs/*/checkpoint.pt"))) == 1
    assert json.loads((root / "index.json").read_text())["experiments"][0]["name"] == "own"


def test_defect_7_a_run_finished_by_another_process_is_never_marked_failed(corpus, tmp_path):
    from normlab.lab.train import train
    from normlab.sweep import _run_one, expand

    spec = expand(
        load_experiment(str(write_experiment(tmp_path, corpus, 10, runs=("rms_norm",)))), "tiny", tmp_path / "root"
    )[0]
    train(spec.config, progress=False)  # "process B" completes it
    done = RunFolder(spec.config.out).summary()
    assert done["status"] == "completed"
    run_id, status, _ = _run_one(spec)  # "process A" arrives with its resume
    assert status == "completed"
    assert RunFolder(spec.config.out).summary() == done


def test_defect_8_two_runs_of_one_name_are_refused(corpus, tmp_path):

    exp = write_experiment(tmp_path, corpus, 10, runs=("dyt", "dyt"))
    with pytest.raises(ValueError, match=r"own\.toml: two runs are named 'dyt'"):
        load_experiment(str(exp))


def test_a_bad_field_in_a_toml_names_the_file_and_the_run(corpus, tmp_path):
    from normlab.sweep import expand

    path = tmp_path / "bad.toml"
    path.write_text('name = "bad"\n[[runs]]\nname = "x"\nset = { lr = "fast" }\n')
    with pytest.raises(ValueError, match=r"bad\.toml: run 'x': lr must be"):
        expand(load_experiment(str(path)), "tiny", tmp_path / "root")


def test_a_sweep_with_a_failed_run_exits_non_zero(corpus, tmp_path, capsys):
    path = tmp_path / "fails.toml"
    path.write_text(
        f'name = "fails"\n[base]\nset = {{ data = ["{corpus}"], steps = 5 }}\n[[runs]]\nname = "x"\n'
        'set = { "model.context" = 100000 }\n'
    )
    assert (
        main(["sweep", str(path), "--profile", "tiny", "--jobs", "1", "--root", str(tmp_path / "r"), "--no-progress"])
        == 1
    )
    assert "1 run(s) failed" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["../../escape", "a/b", "..", ".", "", "a\\b"])
def test_defect_7_an_experiment_name_cannot_leave_its_root(tmp_path, name):
    """`name = "../../escape"` in a TOML made `normlab report` write escape_loss.png two levels above the root."""

    toml = tmp_path / "e.toml"
    toml.write_text(f'name = {json.dumps(name)}\n[[runs]]\nname = "a"\nset = {{}}\n')
    with pytest.raises(ValueError, match=r"e\.toml: name must be one path segment"):
        load_experiment(str(toml))


_TOML = {"name": "fz", "title": "t", "source": "s", "claim": "c", "seeds": [0], "metrics": ["final_val_loss"],
         "base": {"set": {}}, "baseline": "a", "figures": ["loss"], "guard": True, "mechanism": ["a"],
         "profiles": ["tiny"]}  # fmt: skip


_WRONG = [5, "x", [1, 2], {"k": 1}, True, 1.5]


def value(v) -> str:
    """A value as TOML."""
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{json.dumps(k)} = {value(x)}" for k, x in v.items()) + " }"
    if isinstance(v, list):
        return "[" + ", ".join(value(x) for x in v) + "]"
    return json.dumps(v) if not isinstance(v, bool) else str(v).lower()


def _toml_text(top: dict, run: dict) -> str:
    lines = [f"{k} = {value(v)}" for k, v in top.items()]
    return "\n".join(lines) + "\n[[runs]]\n" + "\n".join(f"{k} = {value(v)}" for k, v in run.items()) + "\n"


def _kind_ok(field: str, v) -> bool:
    """Whether ``v`` happens to be a valid value of ``field`` (then it is not a wrong kind for it)."""
    from normlab.experiment import _Run, _Top
    from normlab.typed import check_table, hints

    schema = _Top if field in hints(_Top) else _Run if field in hints(_Run) else None
    if schema is None:
        return False
    try:
        check_table({field: v}, schema, "t")
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("field", [*_TOML, "runs"])
def test_fuzz_every_toml_field_of_the_wrong_kind_is_one_line_naming_file_and_field(tmp_path, capsys, field):
    run = {"name": "a", "set": {"model.norm": "rms_norm"}}
    tried = 0
    for wrong in _WRONG:
        if _kind_ok(field, wrong) or field in ("name",) and isinstance(wrong, str):
            continue
        top = {**_TOML, field: wrong}
        path = tmp_path / f"e{tried}.toml"
        text = (
            _toml_text(top, run)
            if field != "runs"
            else _toml_text(_TOML, run).split("[[runs]]")[0] + (f"runs = {value(wrong)}\n")
        )
        path.write_text(text)
        rc = main(["sweep", str(path), "--profile", "tiny", "--root", str(tmp_path / "root"), "--no-progress"])
        err = capsys.readouterr().err.strip()
        assert rc == 2, (field, wrong, err)
        assert len(err.splitlines()) == 1 and str(path) in err and field in err, (field, wrong, err)
        assert "Traceback" not in err
        tried += 1
    assert tried >= 3
    assert not (tmp_path / "root" / "runs").exists()  # nothing trained


@pytest.mark.parametrize("field", ["name", "label", "set", "shape", "profiles", "budget", "lrs", "lr_field"])
def test_fuzz_every_run_field_of_the_wrong_kind(tmp_path, capsys, field):
    tried = 0
    for wrong in _WRONG:
        if _kind_ok(field, wrong):
            continue
        path = tmp_path / f"r{tried}.toml"
        path.write_text(_toml_text({"name": "fz"}, {"name": "a", "set": {}, field: wrong}))
        rc = main(["sweep", str(path), "--profile", "tiny", "--root", str(tmp_path / "root"), "--no-progress"])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and len(err.splitlines()) == 1 and str(path) in err and field in err, (field, wrong, err)
        tried += 1
    assert tried >= 3


def test_sweep_and_reproduce_check_their_arguments_before_writing(tmp_path, capsys):
    """issue 50: `sweep --shard 3/2` wrote index.json before refusing; a --root that is a file raised
    FileExistsError."""
    from normlab.cli import main

    root = tmp_path / "root"
    assert main(["sweep", "--root", str(root), "--shard", "3/2", "--no-progress"]) == 2
    assert "--shard i/n needs 0 <= i < n" in capsys.readouterr().err and not root.exists()
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for command in (["sweep"], ["reproduce", "--quick"]):
        assert main([*command, "--root", str(a_file), "--no-progress"]) == 2
        assert f"--root {a_file} is a file; give a folder" in capsys.readouterr().err
    assert a_file.read_text() == "x"


@pytest.mark.parametrize("seeds", ["[]", "[0, 0]", "[-1]"])
def test_an_experiment_with_no_seed_or_a_repeated_one_is_refused(corpus, tmp_path, capsys, seeds):
    """issue 65: a sweep with seeds = [] exited 0 and wrote a report of nothing."""
    exp = write_experiment(tmp_path, corpus, 5)
    exp.write_text(f"seeds = {seeds}\n" + exp.read_text())
    with pytest.raises(ValueError, match=r"own\.toml: seeds must list at least one distinct int >= 0"):
        load_experiment(str(exp))
    assert main(["sweep", str(exp), "--profile", "tiny", "--root", str(tmp_path / "r"), "--no-progress"]) == 2
    assert not (tmp_path / "r").exists()


def test_a_sweep_bar_is_redrawn_while_no_run_ends():
    """issue 86: `make demo` printed nothing past 0/98 for minutes, its runs in flight: the bar was drawn only when
    a run ended. The heartbeat redraws it, its elapsed time moving, every so many seconds (30 in a sweep)."""
    import io
    import time

    from tqdm import tqdm

    from normlab.sweep import heartbeat

    out = io.StringIO()
    bar = tqdm(total=98, file=out, desc="sweep", unit="run")
    with heartbeat(bar, every=0.05):
        time.sleep(0.6)
    frames = out.getvalue().count("sweep:")
    bar.close()
    assert frames >= 6, out.getvalue()  # the first frame, then one about every 0.05 s; without it, one
    assert "0/98 [00:00" in out.getvalue()


def test_a_sweep_says_its_steps_and_time_left_before_its_first_run_ends(tmp_path, monkeypatch, capsys):
    """issue 86: `make demo` showed an ETA only once its first run ended, minutes in. The heartbeat reads the runs'
    metrics logs as they train, and says how far the runs in flight are and about how long the sweep has left."""
    import normlab.sweep as sweep

    corpus = tmp_path / "text.txt"
    corpus.write_text(TEXT * 4)
    specs = expand(load_experiment(str(write_experiment(tmp_path, corpus, 300, runs=("rms_norm",)))), "tiny",
                   tmp_path / "r", {"log_every": 5})  # fmt: skip
    monkeypatch.setattr(sweep, "HEARTBEAT_SECONDS", 0.2)
    assert run_sweep(specs, workers=Workers(jobs=1)) == {specs[0].run_id: "completed"}
    bar = capsys.readouterr().err.replace("\r", "\n")
    before_end = bar[: bar.index("1/1")]
    assert re.search(r"in flight: 1 at \d+% of their steps; about \d+ min left", before_end), bar[-2000:]
    assert sweep.eta_text(specs, {specs[0].run_id}, {specs[0].run_id: 0.0}, 10.0) == "no run in flight"
