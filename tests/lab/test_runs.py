"""A run folder's life: its lock, a fresh start against a used folder, resume after a kill or a signal, a full disk."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from normlab.cli import main
from normlab.lab import resolve_config, train
from normlab.lab.runs import RunFolder, RunLocked


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _train(out, data, *sets, flags=()) -> list[str]:
    args = ["train", "--preset", "tiny", "--data", str(data), "--out", str(out), "--no-progress", *flags]
    return [*args, "--set", *sets] if sets else args  # one group: the code before kept only the last --set


@pytest.mark.parametrize("setting", ["model.norm_kwargs.alpha_init=abc", "lr=nan", "model.vocab_size=10",
                                     "min_lr=nan", "weight_decay=inf", "grad_clip=nan", "lr=inf"])  # fmt: skip
def test_defect_10_a_bad_value_with_overwrite_keeps_the_old_run(corpus, tmp_path, capsys, setting):
    out = tmp_path / "finished"
    assert main(_train(out, corpus, "steps=10", "model.norm=dyt")) == 0
    before = {f: _sha(out / f) for f in ("summary.json", "config.json", "checkpoint.pt")}
    capsys.readouterr()
    rc = main(_train(out, corpus, "steps=10", "model.norm=dyt", setting, flags=["--overwrite"]))
    assert rc == 2, capsys.readouterr()
    assert {f: _sha(out / f) for f in before} == before


def test_defect_10_tensorboard_without_the_package(corpus, tmp_path, capsys):
    pytest.importorskip("torch")
    try:
        import tensorboard  # noqa: F401

        pytest.skip("tensorboard is installed here")
    except ImportError:
        pass
    out = tmp_path / "finished"
    assert main(_train(out, corpus, "steps=10")) == 0
    before = _sha(out / "summary.json")
    assert main(_train(out, corpus, "steps=10", "tensorboard=true", flags=["--overwrite"])) == 2
    assert "pip install tensorboard" in capsys.readouterr().err and _sha(out / "summary.json") == before


@pytest.mark.slow
def test_defect_11_resume_with_fewer_steps_is_refused_with_the_numbers(corpus, tmp_path, capsys):
    out = tmp_path / "long"
    cmd = [sys.executable, "-m", "normlab.cli", *_train(out, corpus, "steps=200000", "checkpoint_every=10")]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and not (out / "checkpoint.pt").exists():
        time.sleep(0.05)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=120)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "interrupted"
    at = summary["interrupted_at"]
    rc = main(_train(out, corpus, "steps=5", "checkpoint_every=10", flags=["--resume"]))
    err = capsys.readouterr().err
    assert rc == 2 and f"at step {at}, beyond steps = 5" in err, err
    assert json.loads((out / "summary.json").read_text())["status"] == "interrupted"  # still resumable


def test_defect_12_resume_at_the_final_checkpoint_keeps_the_result(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(_train(out, corpus, "steps=20", "eval_every=10")) == 0
    first = json.loads((out / "summary.json").read_text())
    assert first["final_val_loss"] is not None
    (out / "summary.json").unlink()
    assert main(_train(out, corpus, "steps=20", "eval_every=10", flags=["--resume"])) == 0
    again = json.loads((out / "summary.json").read_text())
    assert again["status"] == "completed"
    assert again["final_val_loss"] == first["final_val_loss"] and again["escape_step"] == first["escape_step"]


def test_defect_13_a_folder_that_is_not_a_run_is_never_touched(models, corpus, capsys):
    folder = models["m"]
    before = _sha(folder / "config.json")
    for flags in ([], ["--overwrite"], ["--resume"]):
        rc = main(_train(folder, corpus, "steps=5", flags=flags))
        err = capsys.readouterr().err
        assert rc == 2 and "is not a normlab run folder" in err, err
    assert _sha(folder / "config.json") == before and not (folder / "metrics.jsonl").exists()


@pytest.mark.parametrize("setting,message", [
    ("data=[1,2]", "data must be a list (a string each)"),
    ("model=5", "model must be a table of model settings"),
    ("out=", "out must name a folder"),
])  # fmt: skip
def test_train_settings_of_the_wrong_shape(setting, message, corpus, tmp_path, capsys):
    args = ["train", "--preset", "tiny", "--data", str(corpus), "--no-progress", "--set", setting]
    if not setting.startswith("out="):
        args += ["--out", str(tmp_path / "run")]
    assert main(args) == 2
    assert message in capsys.readouterr().err


def test_a_checkpoint_missing_a_key_and_a_killed_run_are_named(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(_train(out, corpus, "steps=10")) == 0
    state = torch.load(out / "checkpoint.pt", weights_only=False)
    del state["optimizer"]
    torch.save(state, out / "checkpoint.pt")
    summary = json.loads((out / "summary.json").read_text())
    (out / "summary.json").write_text(json.dumps({**summary, "status": "running"}))  # as a killed run leaves it
    capsys.readouterr()
    assert main(_train(out, corpus, "steps=20", flags=["--resume"])) == 2
    assert "lacks optimizer" in capsys.readouterr().err
    assert main(_train(out, corpus, "steps=20")) == 2
    assert "killed while running" in capsys.readouterr().err


@pytest.mark.slow
def test_a_full_disk_mid_run_is_a_clear_error_and_the_run_stays_resumable(corpus, tmp_path):
    """A real failed write: the process may write no file beyond 200 KB (RLIMIT_FSIZE, SIGXFSZ ignored, so
    write() fails with EFBIG as on a full disk); the tiny model's checkpoint is about 430 KB."""
    out = tmp_path / "run"
    code = (
        "import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
        "resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000)); "
        "from normlab.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    args = _train(out, corpus, "steps=20", "checkpoint_every=10")
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "could not write the checkpoint" in proc.stderr and "resume with" in proc.stderr, proc.stderr
    assert not list(out.glob("*.tmp"))  # no half file left behind
    assert json.loads((out / "summary.json").read_text())["status"] == "failed"  # not "running"
    assert main([*args, "--resume"]) == 0  # with room again, it resumes (from step 0: no checkpoint was written)
    assert json.loads((out / "summary.json").read_text())["status"] == "completed"


ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _cfg(corpus_file, out, **overrides):
    return resolve_config("tiny", overrides, data=[corpus_file], out=str(out))


def _steps(out) -> list[int]:
    """The training steps logged (the row of step 0, the telemetry at init, is not a training step)."""
    return [r["step"] for r in RunFolder(out).metrics() if r["step"] > 0]


def _cmd(corpus_file, out, *extra, steps=3000, norm="rms_norm"):
    return [
        sys.executable,
        "-m",
        "normlab.cli",
        "train",
        "--preset",
        "tiny",
        "--norm",
        norm,
        "--data",
        corpus_file,
        "--out",
        str(out),
        "--no-progress",
        "--set",
        f"steps={steps}",
        "log_every=1",
        *extra,
    ]


def _start(cmd, out, *, min_step=3) -> subprocess.Popen:
    """Start a run and return once it has logged ``min_step`` steps."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if (Path(out) / "metrics.jsonl").exists() and _steps(out) and _steps(out)[-1] >= min_step:
            return proc
        time.sleep(0.02)
    proc.kill()
    raise AssertionError(f"the run did not reach step {min_step}: {proc.communicate()[1][-2000:]}")


@pytest.mark.slow
def test_a_second_run_on_a_live_folder_is_refused_naming_the_first(corpus_file, tmp_path):
    out = tmp_path / "run"
    first = _start(_cmd(corpus_file, out), out)
    try:
        second = subprocess.run(
            _cmd(corpus_file, out, norm="dyt"), capture_output=True, text=True, env=ENV, timeout=120
        )
        assert second.returncode == 2
        assert f"in use by a live run (pid {first.pid}" in second.stderr
        assert json.loads((out / "config.json").read_text())["model"]["norm"] == "rms_norm"
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=120)
    steps = _steps(out)
    assert steps == list(range(1, len(steps) + 1))  # one run's rows, each step once


def test_the_lock_dies_with_its_holder(tmp_path):
    folder = RunFolder(tmp_path)
    with folder:
        with pytest.raises(RunLocked, match=f"pid {os.getpid()}"):
            RunFolder(tmp_path).lock()
    with RunFolder(tmp_path):  # released: the next run takes it
        pass


def test_a_fresh_start_in_a_used_folder_is_refused_unless_overwrite(corpus_file, tmp_path):
    out = tmp_path / "run"
    train(_cfg(corpus_file, out, steps=6, checkpoint_every=3, log_every=1), progress=False)
    (out / "checkpoint.pt").unlink()  # as a corrupt checkpoint's message once advised
    before = (out / "metrics.jsonl").read_text()
    with pytest.raises(ValueError, match="already holds a run .*--overwrite to start it over"):
        train(_cfg(corpus_file, out, steps=6, checkpoint_every=3, log_every=1), progress=False)
    assert (out / "metrics.jsonl").read_text() == before
    train(_cfg(corpus_file, out, steps=6, checkpoint_every=3, log_every=1), overwrite=True, progress=False)
    assert _steps(out) == list(range(1, 7))


def test_resume_with_nothing_to_resume_and_resume_with_overwrite_are_refused(corpus_file, tmp_path):
    with pytest.raises(ValueError, match="nothing to resume"):
        train(_cfg(corpus_file, tmp_path / "empty"), resume=True, progress=False)
    with pytest.raises(ValueError, match="contradict"):
        train(_cfg(corpus_file, tmp_path / "empty"), resume=True, overwrite=True, progress=False)


@pytest.mark.slow
def test_sigkill_before_the_first_checkpoint_then_resume_logs_each_step_once(corpus_file, tmp_path):
    out = tmp_path / "run"
    proc = _start(_cmd(corpus_file, out, "checkpoint_every=1000", steps=40), out, min_step=5)
    proc.kill()
    proc.communicate()
    assert not (out / "checkpoint.pt").exists() and _steps(out)[-1] >= 5
    plain = subprocess.run(
        _cmd(corpus_file, out, "checkpoint_every=1000", steps=40), capture_output=True, text=True, env=ENV
    )
    assert plain.returncode == 2 and "already holds a run" in plain.stderr
    resumed = subprocess.run(
        [*_cmd(corpus_file, out, "checkpoint_every=1000", steps=40), "--resume"],
        capture_output=True,
        text=True,
        env=ENV,
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert _steps(out) == list(range(1, 41))
    assert [r["step"] for r in RunFolder(out).metrics()].count(0) == 1  # the init's row once, not twice


@pytest.mark.slow
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_ends_with_a_checkpoint_and_the_command_to_resume(corpus_file, tmp_path, sig, code):
    out = tmp_path / "run"
    proc = _start(_cmd(corpus_file, out, steps=60), out, min_step=4)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err[-2000:]
    assert "Traceback" not in err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["signal"] == sig.name
    assert torch.load(out / "checkpoint.pt", weights_only=False)["step"] == summary["interrupted_at"]
    command = err.split("Resume with:")[1].strip().splitlines()[0]
    assert command == summary["resume"] and "--resume" in command
    argv = shlex.split(command)
    assert argv[0] == "normlab"
    resumed = subprocess.run([sys.executable, "-m", "normlab.cli", *argv[1:]], capture_output=True, text=True, env=ENV)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert _steps(out) == list(range(1, 61))
    assert json.loads((out / "summary.json").read_text())["status"] == "completed"


@pytest.mark.parametrize("setting, match", [
    ("jacobian_site=nope", "jacobian_site 'nope' is not a norm site"),
    ("seed=abc", r"seed must be an int \(not 2.0, not true\), got 'abc'"),
    ("beta1=5", r"beta1 must be in \[0, 1\)"),
    ("lr=true", "lr must be a number, got True"),
    ("model.context=20000", "validation split .* not more than model.context"),
])  # fmt: skip
def test_a_bad_config_fails_before_any_work_and_leaves_no_folder(corpus_file, tmp_path, capsys, setting, match):
    from normlab.cli import main

    out = tmp_path / "run"
    code = main(["train", "--preset", "tiny", "--data", corpus_file, "--out", str(out), "--set", setting])
    assert code == 2
    err = capsys.readouterr().err
    assert __import__("re").search(match, err), err
    assert not out.exists()


def test_amp_none_is_the_documented_word_not_python_none(corpus_file, tmp_path):
    assert resolve_config("tiny", ["amp=none"]).amp == "none"
    assert resolve_config("tiny", ["model.norm_attn=null"]).model.norm_attn is None


def test_a_text_that_a_fresh_start_would_clear_is_refused(tmp_path, capsys):
    """issue 50, inputs are never outputs: a --data file that is one of the run's own files in --out (cleared by
    --overwrite) is refused before any work, and stays as it was."""
    from conftest import TEXT
    from normlab.cli import main

    out = tmp_path / "run"
    out.mkdir()
    data = out / "metrics.jsonl"
    data.write_text(TEXT)
    assert main(["train", "--preset", "tiny", "--data", str(data), "--out", str(out), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert f"data: {data} is the run's own metrics.jsonl in out = {out}, which a fresh start clears" in err, err
    assert data.read_text() == TEXT
