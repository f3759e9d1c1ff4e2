"""Run folders and commands you can trust (issue 12): one test per defect, each failing on the old code.

Real processes and real signals: two `normlab train` processes on one folder, SIGINT, SIGTERM, SIGKILL.
"""

from __future__ import annotations

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

from normlab.lab import resolve_config, train
from normlab.lab.runs import RunFolder, RunLocked
from normlab.lab.train import check_cpu_bf16

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _cfg(corpus_file, out, **overrides):
    return resolve_config("tiny", overrides, data=[corpus_file], out=str(out))


def _steps(out) -> list[int]:
    """The training steps logged (the row of step 0, the telemetry at init, is not a training step)."""
    return [r["step"] for r in RunFolder(out).metrics() if r["step"] > 0]


def _cmd(corpus_file, out, *extra, steps=3000, norm="rms_norm"):
    return [sys.executable, "-m", "normlab.cli", "train", "--preset", "tiny", "--norm", norm, "--data", corpus_file,
            "--out", str(out), "--no-progress", "--set", f"steps={steps}", "log_every=1", *extra]  # fmt: skip


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


# ------------------------------------------------------------------ defect 1: two runs, one folder
@pytest.mark.slow
def test_a_second_run_on_a_live_folder_is_refused_naming_the_first(corpus_file, tmp_path):
    out = tmp_path / "run"
    first = _start(_cmd(corpus_file, out), out)
    try:
        second = subprocess.run(_cmd(corpus_file, out, norm="dyt"), capture_output=True, text=True, env=ENV,
                                timeout=120)  # fmt: skip
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


# ------------------------------------------------------------------ defect 2: starting over in a used folder
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
    plain = subprocess.run(_cmd(corpus_file, out, "checkpoint_every=1000", steps=40), capture_output=True, text=True,
                           env=ENV)  # fmt: skip
    assert plain.returncode == 2 and "already holds a run" in plain.stderr
    resumed = subprocess.run([*_cmd(corpus_file, out, "checkpoint_every=1000", steps=40), "--resume"],
                             capture_output=True, text=True, env=ENV)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert _steps(out) == list(range(1, 41))
    assert [r["step"] for r in RunFolder(out).metrics()].count(0) == 1  # the init's row once, not twice


# ------------------------------------------------------------------ defect 9: SIGINT and SIGTERM
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
    resumed = subprocess.run([sys.executable, "-m", "normlab.cli", *argv[1:]], capture_output=True, text=True,
                             env=ENV)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert _steps(out) == list(range(1, 61))
    assert json.loads((out / "summary.json").read_text())["status"] == "completed"


# ------------------------------------------------------------------ defect 10: late failures
@pytest.mark.parametrize("setting, match", [
    ("jacobian_site=nope", "jacobian_site 'nope' is not a norm site"),
    ("seed=abc", "seed must be int, got 'abc'"),
    ("beta1=5", r"beta1 must be in \[0, 1\)"),
    ("lr=true", "lr must be float, got True"),
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


# ------------------------------------------------------------------ defect 5: jacobian's default --init
def test_jacobian_default_init_applies_only_to_norms_that_take_it(capsys):
    from normlab.cli import main

    assert main(["jacobian", "--norm", "rms_norm", "--width", "8"]) == 0
    assert "gain+rank-1" in capsys.readouterr().out
    assert main(["jacobian", "--norm", "rms_norm", "--width", "8", "--init", "alpha_init=2"]) == 2  # a user's: strict
    assert main(["jacobian", "--norm", "rms_norm", "--width", "100000"]) == 2
    assert "GiB" in capsys.readouterr().err


# ------------------------------------------------------------------ defect 6: rms_ema in every dtype, NaN batches
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_rms_ema_trains_in_every_dtype_and_a_nan_batch_does_not_poison_it(dtype):
    from normlab.registry import create_norm

    m = create_norm("rms_ema", 8).to(dtype).train()
    x = torch.randn(4, 8, dtype=dtype)
    m(x)
    before = m.running_ms.clone()
    bad = x.clone()
    bad[0, 0] = float("nan")
    m(bad)
    assert torch.equal(m.running_ms, before)
    assert torch.isfinite(m.eval()(x)).all()


# ------------------------------------------------------------------ the GPU preset's code paths, on the CPU
@pytest.mark.slow
def test_bf16_autocast_and_compile_train_on_the_cpu(corpus_file, tmp_path):
    env = {**ENV, "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}  # see check_cpu_bf16
    out = tmp_path / "run"
    proc = subprocess.run(_cmd(corpus_file, out, "amp=bf16", "compile=true", steps=6), capture_output=True,
                          text=True, env=env, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["final_val_loss"] < 5.6


def test_a_bf16_probe_that_dies_with_sigill_becomes_a_clear_error():
    die = "import os, signal; os.kill(os.getpid(), signal.SIGILL)"  # a real child killed by SIGILL
    with pytest.raises(RuntimeError, match="SIGILL .*ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16"):
        check_cpu_bf16(die)
    try:
        check_cpu_bf16()  # this machine, with its environment: passes, or names the fix
    except RuntimeError as e:
        assert "ONEDNN_MAX_CPU_ISA" in str(e)


# ------------------------------------------------------------------ poor messages, now clear errors at the boundary
@pytest.mark.parametrize("name, dim, kwargs, match", [
    ("dyt", 8, {"alpha_init": 1e40}, "alpha_init at most 3.4e\\+38 in magnitude"),
    ("dyt", 8, {"alpha_init": True}, "alpha_init to be a finite number"),
    ("dyisru", 8, {"beta_init": True}, "beta_init to be a finite number > 0"),
    ("group_rms", 8, {"group_size": True}, "group_size to be an int >= 1"),
    ("scaled_dyt", "8", {}, "ScaledDyT: expected dim .* got '8'"),
    ("dyt", 8, {"per_channel_alpha": "yes"}, "per_channel_alpha to be True or False"),
    ("layer_norm", 8, {"bias": "no"}, "bias to be True or False"),
])  # fmt: skip
def test_bad_norm_arguments_are_clear_value_errors(name, dim, kwargs, match):
    from normlab.registry import create_norm

    with pytest.raises(ValueError, match=match):
        create_norm(name, dim, **kwargs)


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


@pytest.mark.parametrize("suffix, content", [(".json", '{"a": 1}'), (".txt", b"\x00\xff\xfe binary"),
                                             (".npy", b"not numpy")])  # fmt: skip
def test_simulate_on_a_file_that_is_not_numbers_is_a_clear_error(tmp_path, capsys, suffix, content):
    from normlab.cli import main

    p = tmp_path / f"x{suffix}"
    p.write_bytes(content if isinstance(content, bytes) else content.encode())
    assert main(["simulate", "--x", str(p), "--out", str(tmp_path / "o")]) == 2
    assert "is not a list of numbers" in capsys.readouterr().err


@pytest.mark.parametrize("x, alpha", [([[1.0, 2.0]], "0.5"), ([[1 + 2j, 2.0]], 0.5), ([[1.0, 2.0]], True)])
def test_reference_dynamic_tanh_refuses_a_string_alpha_and_complex_x(x, alpha):
    from normlab.reference import dynamic_tanh

    with pytest.raises(ValueError, match="dynamic_tanh: expected"):
        dynamic_tanh(x, alpha, [1.0, 1.0], [0.0, 0.0])


def test_an_extra_class_without_a_channel_count_is_an_error_not_a_wrong_skip():
    from torch import nn

    from normlab.conversion.convert import convert_norms

    class MyNorm(nn.Module):
        def forward(self, x):
            return x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()

    model = nn.Sequential(nn.Linear(4, 4), MyNorm())
    with pytest.raises(ValueError, match=r"extra_classes\[MyNorm\]: cannot convert 1: its channel count is unknown"):
        convert_norms(model, to="dyt", extra_classes={MyNorm: "rms_norm"})
