"""Training's edge cases: a diverged run, knobs that would be ignored, the EMA statistics in every dtype."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from normlab.cli import main
from normlab.errors import check_cpu_bf16
from normlab.lab import GPTConfig, resolve_config, train
from normlab.lab.runs import read_summary


# 6: a diverged run reads as diverged
def test_a_diverged_runs_final_train_loss_stays_nan(corpus_file, tmp_path):
    cfg = resolve_config(
        "tiny",
        ["lr=1e6", "grad_clip=0", "warmup=0", "steps=40", "log_every=1"],
        data=[corpus_file],
        out=str(tmp_path / "run"),
        norm="layer_scale",
    )
    summary = train(cfg, progress=False)
    assert summary["status"] == "diverged"
    assert math.isnan(summary["final_train_loss"])
    assert math.isnan(read_summary(tmp_path / "run")["final_train_loss"])


ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


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


@pytest.mark.slow
def test_bf16_autocast_and_compile_train_on_the_cpu(corpus_file, tmp_path):
    env = {**ENV, "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}  # see check_cpu_bf16
    out = tmp_path / "run"
    proc = subprocess.run(
        _cmd(corpus_file, out, "amp=bf16", "compile=true", steps=6),
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
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


def test_rms_ema_is_read_as_training_sets_it():
    """predict and jacobian read rms_ema at the running mean training sets from its first batch (they read the
    placeholder 1.0); match_rms no longer moves it (its forwards ran in train mode)."""
    from normlab.lab import GPT
    from normlab.lab.phase import predict
    from normlab.theory.jacobian import jacobian_table

    rows = {r["norm"]: r for r in jacobian_table(["rms_norm", "rms_ema"], [64], std=0.02, tokens=2)}
    assert rows["rms_ema"]["total"] == pytest.approx(rows["rms_norm"]["total"], rel=0.2)  # was ~0.02 of it
    cfg = GPTConfig(width=32, depth=1, heads=2, context=16, norm="rms_ema", norm_final="dyt", norm_init="match_rms")
    p = predict(cfg)
    assert p["rms_out"] == pytest.approx(1.0, rel=0.05)  # normalised as in training, not by the placeholder
    torch.manual_seed(0)
    model = GPT(cfg).train()
    idx = torch.randint(256, (2, 16))
    model(idx)  # the first training forward sets the running means
    before = {n: float(m.running_ms) for n, m in model.named_modules() if hasattr(m, "running_ms")}
    model.match_rms_(idx)
    after = {n: float(m.running_ms) for n, m in model.named_modules() if hasattr(m, "running_ms")}
    assert before == after and model.training


@pytest.mark.parametrize("setting,match", [
    (["model.norm_init=match_rms"], "match_rms' scales the gamma of point-wise norms; no site"),
    (["model.recipe=dyt_paper"], "model.recipe = 'dyt_paper' sets nothing at any site of this model: init 'dyt_paper'"),
    (["model.norm=dyt", "model.recipe=derf_paper"], "sets nothing at any site of this model: init 'derf_paper' is"),
    (["model.norm=dyt", "model.recipe=dyt_paper@"], "names no width after '@'"),
])  # fmt: skip
def test_knobs_that_would_be_ignored_are_refused(tmp_path, capsys, setting, match):
    out = tmp_path / "r"
    assert main(["train", "--preset", "tiny", "--out", str(out), "--set", *setting]) == 2
    assert match in capsys.readouterr().err and not out.exists()


def test_a_bad_kernel_choice_or_a_data_folder_is_refused_before_the_run_folder(tmp_path, capsys, monkeypatch):
    """issue 65: NORMLAB_KERNEL=bogus left a run folder behind, and --data naming a folder said "not found"."""
    out = tmp_path / "r"
    monkeypatch.setenv("NORMLAB_KERNEL", "bogus")
    assert main(["train", "--preset", "tiny", "--out", str(out), "--no-progress"]) == 2
    assert "NORMLAB_KERNEL='bogus'" in capsys.readouterr().err and not out.exists()
    monkeypatch.delenv("NORMLAB_KERNEL")
    (tmp_path / "texts").mkdir()
    assert main(["train", "--preset", "tiny", "--out", str(out), "--data", str(tmp_path / "texts")]) == 2
    assert f"{tmp_path / 'texts'} is a folder; give its text files instead" in capsys.readouterr().err
    assert not out.exists()
