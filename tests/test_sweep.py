"""Experiments as data: the sweep resumes after SIGKILL, records divergence, shards; the report reads it."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from normlab.report import write_report
from normlab.sweep import builtin_experiments, expand, load_experiment, parse_shard, run_sweep, write_index

TEXT = "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n" * 300

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
    assert builtin_experiments() == [*names, "scaling"]
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
    assert by_name == {"rms_norm": "completed", "dyt": "completed", "l1_norm": "completed",
                       "layer_scale_hot": "diverged"}  # fmt: skip
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
    a, b = (set(run_sweep(specs, shard=parse_shard(f"{i}/2"), progress=False)) for i in range(2))
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
    finished = {p: p.stat().st_mtime_ns for p in killed.glob("runs/*/summary.json")
                if json.loads(p.read_text()).get("status") in ("completed", "diverged")}  # fmt: skip
    assert 1 <= len(finished) < 4, "the sweep must be killed midway"
    subprocess.run([*cmd, "--root", str(killed)], check=True, capture_output=True)
    for p, t in finished.items():  # finished runs were not redone
        assert p.stat().st_mtime_ns == t
    assert _final(killed) == _final(ref)  # the final table equals an uninterrupted sweep's
