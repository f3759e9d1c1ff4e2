"""normlab convert, end to end: every flag and field checked before any work, the output folder and the heal
checkpoint owned, resumes refused across models, texts and settings."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import normlab
from conftest import CALIB, convert_argv, file_sha256, tiny_hf
from normlab.cli import main

transformers = pytest.importorskip("transformers")


# 8: --max-batches counted sequences; the flag says so now
def test_convert_names_the_number_of_sequences(capsys):
    from normlab.cli import build_parser

    args = build_parser().parse_args(["convert", "--model", "m", "--to", "dyt", "--out", "o", "--sequences", "8"])
    assert args.sequences == 8
    with pytest.raises(SystemExit):
        build_parser().parse_args(["convert", "--model", "m", "--to", "dyt", "--out", "o", "--max-batches", "8"])


def test_defect_1_heal_resume_from_another_models_checkpoint_is_refused(models, tmp_path, capsys):
    ck = tmp_path / "ck.pt"
    assert (
        main(
            convert_argv(
                models["m"], models["text"], "--heal-tokens", 500, "--checkpoint", ck, "--out", tmp_path / "o1"
            )
        )
        == 0
    )
    assert ck.is_file()  # named by the user: kept, and the output says so (issue 65)
    assert f"the heal checkpoint {ck} is kept, as --checkpoint named it" in capsys.readouterr().out
    rc = main(
        convert_argv(
            models["m2"], models["text"], "--heal-tokens", 500, "--checkpoint", ck, "--resume", "--out", tmp_path / "o2"
        )
    )
    err = capsys.readouterr().err
    assert rc == 2 and "made from another model" in err and "model: checkpoint" in err, err  # before loading
    assert not (tmp_path / "o2").exists()
    # the same path with other weights (a model replaced in place): refused by the weights' fingerprint
    import shutil

    shutil.copy(models["m2"] / "model.safetensors", models["m"] / "model.safetensors")
    rc = main(
        convert_argv(
            models["m"], models["text"], "--heal-tokens", 500, "--checkpoint", ck, "--resume", "--out", tmp_path / "o3"
        )
    )
    err = capsys.readouterr().err
    assert rc == 2 and "model_fingerprint" in err, err
    assert not (tmp_path / "o3").exists()


def test_defect_2_heal_resume_with_another_text_is_refused(models, tmp_path, capsys):
    ck = tmp_path / "ck.pt"
    assert main(convert_argv(models["m"], models["text"], "--heal-tokens", 500, "--checkpoint", ck)) == 0
    capsys.readouterr()
    rc = main(convert_argv(models["m"], models["other"], "--heal-tokens", 500, "--checkpoint", ck, "--resume"))
    err = capsys.readouterr().err
    assert rc == 2 and "text_sha256" in err, err
    # the same model, text and settings resume
    assert main(convert_argv(models["m"], models["text"], "--heal-tokens", 500, "--checkpoint", ck, "--resume")) == 0


def test_defect_3_default_heal_checkpoint_in_a_missing_parent_folder(models, tmp_path, capsys):
    out = tmp_path / "nest" / "child"
    assert main(convert_argv(models["m"], models["text"], "--heal-tokens", 100, "--out", out)) == 0
    assert (out / "normlab_conversion.json").is_file()
    assert not (tmp_path / "nest" / "child.heal.pt").exists()  # the default checkpoint is removed once saved


def test_defect_4_checkpoint_never_writes_over_an_input_or_an_existing_file(models, tmp_path, capsys):
    weights = models["m"] / "model.safetensors"
    before = file_sha256(weights)
    rc = main(
        convert_argv(
            models["m"], models["text"], "--heal-tokens", 100, "--checkpoint", weights, "--out", tmp_path / "x"
        )
    )
    assert rc == 2 and "over or inside an input" in capsys.readouterr().err
    assert file_sha256(weights) == before
    keep = tmp_path / "notes.txt"
    keep.write_text("mine")
    rc = main(convert_argv(models["m"], models["text"], "--heal-tokens", 100, "--checkpoint", keep))
    assert rc == 2 and "already exists" in capsys.readouterr().err
    assert keep.read_text() == "mine" and not (tmp_path / "x").exists()


@pytest.mark.slow
def test_defect_5_two_converts_to_one_folder_one_is_refused(models, tmp_path, capsys):
    out = tmp_path / "cc"
    cmd = [sys.executable, "-m", "normlab.cli", *convert_argv(models["m"], models["text"], "--heal-minutes", 0.3,
                                                          "--out", out)]  # fmt: skip
    first = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lock = tmp_path / ".cc.lock"
    deadline = time.time() + 120
    while time.time() < deadline and not (lock.exists() and lock.read_text().startswith("pid")):
        time.sleep(0.05)
    rc = main(convert_argv(models["m"], models["text"], "--out", out))
    err = capsys.readouterr().err
    stdout, _ = first.communicate(timeout=300)
    assert first.returncode == 0 and "saved to" in stdout
    assert rc == 2 and "in use by a live process" in err and f"pid {first.pid}" in err, err
    assert json.loads((out / "normlab_conversion.json").read_text())  # the first one's result, whole


def test_an_existing_folder_normlab_did_not_write_is_never_cleared(models, tmp_path, capsys):
    rc = main(convert_argv(models["m"], models["text"], "--out", models["m2"], "--overwrite"))
    assert rc == 2 and "normlab did not write" in capsys.readouterr().err
    assert (models["m2"] / "config.json").is_file()


@pytest.mark.parametrize("extra,message", [
    (["--exclude", "no.such.module"], "matches no module"),
    (["--budget-nats", "-1"], "--budget-nats must be a finite number >= 0 (nats of held-out cross-entropy rise)"),
    (["--budget-nats", "-1", "--set", "budget.metric=kl"], "(nats of KL divergence to the original), got -1.0"),
    (["--budget-nats", "0.5", "--no-calibrate"], "drop --no-calibrate"),
    (["--budget-nats", "0.02", "--set", "data.walk=self", "data.samples=10000000"],
     "--set data.samples 10,000,000: without a heal on them the conversion reads 16"),
    (["--heal-minutes", "inf"], "finite number > 0"),
    (["--set", "heal.objective=blocks"], "--set heal.objective: the heal's objective (block-wise reconstruction, "
                                         "'blocks') was retired in 0.10.0"),
    (["--resume", "--heal-train", "all"], "--heal-train, --resume apply only to a heal"),
    (["--heal-tokens", "100", "--resume", "--checkpoint", "missing.pt"], "no heal checkpoint at"),
    (["--seq-len", "0"], "--seq-len must be >= 2"),
])  # fmt: skip
def test_convert_flags_fail_before_any_work(models, tmp_path, capsys, extra, message, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = convert_argv(models["m"], models["text"], "--out", tmp_path / "out")
    args[args.index("--seq-len") + 1] = extra[1] if extra[0] == "--seq-len" else "16"
    rc = main([*args, *([] if extra[0] == "--seq-len" else extra)])
    err = capsys.readouterr().err
    assert rc == 2 and message in err, err
    assert not (tmp_path / "out").exists()


def test_convert_text_that_is_a_folder_and_out_under_a_file(models, tmp_path, capsys):
    assert main(convert_argv(models["m"], tmp_path)) == 2
    assert "is a folder" in capsys.readouterr().err
    assert main(convert_argv(models["m"], models["text"], "--out", models["text"] / "child")) == 2
    assert "is a file, not a folder" in capsys.readouterr().err


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


@pytest.mark.slow
def test_ctrl_c_during_a_heal_prints_the_command_that_resumes_it(models, tmp_path):
    ck = tmp_path / "heal.pt"
    cmd = [sys.executable, "-m", "normlab.cli", *convert_argv(models["m"], models["text"], "--heal-minutes", 2,
                                                          "--checkpoint", ck, "--out", tmp_path / "out")]  # fmt: skip
    # Ctrl-C reaches the child as in a terminal, even when this suite runs in the background (where a shell starts
    # every process with SIGINT ignored, and Python then installs no KeyboardInterrupt handler)
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.time() + 180
    while time.time() < deadline and not ck.exists():
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert f"its checkpoint is {ck}" in err and "--resume" in err and "Continue with: normlab convert" in err, err
    assert not (tmp_path / "out").exists()


def test_defect_5_a_trailing_slash_keeps_the_heal_checkpoint_beside_the_output(tmp_path, capsys):
    """`--out DIR/` put the heal checkpoint inside the output (DIR/.heal.pt) and left `..heal.pt.lock` in the saved
    model. The checkpoint is DIR.heal.pt for DIR and DIR/ alike, and nothing of it is inside DIR."""
    model = tiny_hf(tmp_path / "m")
    text = tmp_path / "calib.txt"
    text.write_text(CALIB)
    out = str(tmp_path / "o") + "/"
    rc = main(
        [
            "convert",
            "--model",
            str(model),
            "--calibrate",
            str(text),
            "--seq-len",
            "16",
            "--sequences",
            "4",
            "--no-progress",
            "--heal-tokens",
            "1000",
            "--out",
            out,
        ]
    )
    assert rc == 0, capsys.readouterr().err
    inside = sorted(p.name for p in (tmp_path / "o").iterdir())
    assert not [n for n in inside if "heal" in n and n != "heal_curve.csv" and n != "heal_curve.png"], inside
    assert (tmp_path / ".o.heal.pt.lock").is_file()  # the checkpoint's owner, beside the output (the heal ended)
    normlab.load_converted(tmp_path / "o")


@pytest.mark.parametrize("args,match", [
    (["--to", "layer_norm"], r"--to layer_norm: calibration fits .* pass --no-calibrate"),
    (["--init", "beta_init=-1"], r"--init beta_init=-1: .*beta"),
])  # fmt: skip
def test_convert_flags_are_checked_before_the_model_loads(tmp_path, capsys, args, match):
    import re

    out = tmp_path / "o"
    rc = main(["convert", "--model", str(tmp_path / "missing-model"), "--out", str(out), *args])
    err = capsys.readouterr().err
    assert rc == 2 and re.search(match, err), err  # the flag, before the model (which does not even exist)
    assert not out.exists()


def test_a_bogus_kernel_variable_leaves_no_output(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("NORMLAB_KERNEL", "bogus")
    model = tiny_hf(tmp_path / "m")
    out = tmp_path / "o"
    rc = main(["convert", "--model", str(model), "--out", str(out), "--no-calibrate", "--to", "dyt"])
    assert rc == 2 and "NORMLAB_KERNEL='bogus'" in capsys.readouterr().err
    assert not out.exists() and not list(tmp_path.glob(".o.lock"))


# issue 50, E1: an untyped boolean once replaced an existing output (`--set overwrite=no` is the string "no")
@pytest.mark.parametrize("pair", ["overwrite=no", "heal.resume=no", "overwrite=0", "calibrate.enabled=yes"])
def test_a_boolean_from_set_is_true_or_false_only_and_nothing_is_replaced(models, tmp_path, capsys, pair):
    out = tmp_path / "keep"
    assert main(convert_argv(models["m"], models["text"], "--out", out)) == 0
    before = file_sha256(out / "model.safetensors")
    capsys.readouterr()
    rc = main(convert_argv(models["m"], models["text"], "--to", "dyt", "--out", out, "--set", pair))
    err = capsys.readouterr().err
    assert rc == 2 and f"--set {pair.split('=')[0]} must be true or false" in err, err
    assert (
        file_sha256(out / "model.safetensors") == before
        and json.loads((out / "convert_config.json").read_text())["to"] == "dyisru"
    )


@pytest.mark.parametrize(("pair", "message"), [
    ("seq_len=32.0", "--set seq_len must be an int (not 2.0, not true), got 32.0"),
    ("heal.batch_size=2.5", "--set heal.batch_size must be an int"),
    ("per=1", "--set per must be 'global' or 'channel', got 1"),
    ("data.judge=3", "--set data.judge must be a string or null, got 3"),
])  # fmt: skip
def test_every_config_value_is_typed_at_the_boundary(pair, message):
    from normlab.conversion.config import resolve_convert_config

    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve_convert_config([pair], model="m")


def test_a_config_file_holding_a_list_is_refused_by_name():
    from normlab.conversion.config import ConvertConfig

    with pytest.raises(ValueError, match="must be an object of fields, got list"):
        ConvertConfig.from_dict([1, 2])


# issue 50, E2: --overwrite once deleted the run's own input text when it sat inside the old output folder


def test_make_clean_never_removes_a_folder_that_is_not_a_venv(tmp_path):
    """issue 50: `make clean VENV=<path>` ran rm -rf on whatever path it was given. The Makefile runs in a copy, so
    the repository's own files are not touched."""
    import shutil

    shutil.copy(Path(__file__).resolve().parents[2] / "Makefile", tmp_path / "Makefile")
    keep, venv = tmp_path / "mine", tmp_path / "venv"
    keep.mkdir()
    (keep / "data.txt").write_text("x")
    venv.mkdir()
    (venv / "pyvenv.cfg").write_text("home = /usr\n")
    proc = subprocess.run(["make", "clean", f"VENV={keep}"], cwd=tmp_path, capture_output=True, text=True)
    assert "is not a virtual environment" in proc.stdout and (keep / "data.txt").is_file()
    subprocess.run(["make", "clean", f"VENV={venv}"], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert not venv.exists()  # a real venv is still cleaned


def test_every_conversion_records_and_prints_its_stage_seconds_and_no_progress_is_quiet(models, tmp_path, capfd):
    """issue 48: the seconds of each stage in fidelity.json and the summary; --no-progress silences transformers'
    own loading and saving bars too; the record says which calibration path ran."""
    out = tmp_path / "o"
    capfd.readouterr()  # the fixture's own saving
    assert main(convert_argv(models["m"], models["text"], "--out", out, "--heal-tokens", 64)) == 0
    captured = capfd.readouterr()
    fid = json.loads((out / "fidelity.json").read_text())
    assert list(fid["stages"]) == ["load", "calibration", "measurement", "heal"]  # no samples stage: a text heal
    assert all(isinstance(v, float) and v >= 0 for v in fid["stages"].values())
    assert "stage seconds: load " in captured.out
    assert "Loading weights" not in captured.err and "Writing model shards" not in captured.err, captured.err
    assert fid["calibration"]["path"] == "blocks" and fid["calibration"]["blocks"] == "model.layers (2)"


@pytest.mark.parametrize(("flags", "pair", "message"), [
    (["--heal-tokens", "1000"], "heal.tokens=2000", "--heal-tokens 1000 and --set heal.tokens=2000 disagree"),
    (["--to", "dyt"], "to=derf", "--to 'dyt' and --set to='derf' disagree"),
])  # fmt: skip
def test_a_flag_and_a_set_of_the_same_field_that_disagree_are_an_error(models, tmp_path, capsys, flags, pair, message):
    """issue 50: `--to dyt --set to=derf` converted to Derf, silently."""
    rc = main(convert_argv(models["m"], models["text"], "--out", tmp_path / "o", *flags, "--set", pair))
    err = capsys.readouterr().err
    assert rc == 2 and message in err, err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "settings, message",
    [
        (["heal.batch_size=10000000"], "healing 0M parameters at heal.batch_size=10000000 x seq_len=16 needs about"),
        (["heal.train=lora", "heal.lora_rank=1000"], "heal.lora_rank = 1000 is above the smallest dimension"),
    ],
)
def test_a_heal_the_machine_cannot_run_is_refused_before_the_calibration(tmp_path, capsys, monkeypatch, settings,
                                                                         message):  # fmt: skip
    """issue 50: heal.batch_size=100000 calibrated, then died from the out-of-memory kill with no message; a LoRA
    rank above the layers' dimensions was accepted."""
    monkeypatch.setattr(
        "normlab.conversion.workflow.convert_norms", lambda *a, **k: pytest.fail("calibrated before refusing")
    )
    text = tmp_path / "t.txt"
    text.write_text(CALIB)
    model = tiny_hf(tmp_path / "m")
    argv = ["convert", "--model", str(model), "--calibrate", str(text), "--seq-len", "16", "--sequences", "2",
            "--eval-text", "none", "--heal-minutes", "1", "--no-progress", "--set", *settings]  # fmt: skip
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2 and message in err, err


@pytest.mark.slow
def test_the_gpu_convert_script_runs_on_the_cpu_on_a_tiny_model(tmp_path):
    """scripts/gpu_convert.sh end to end with DEVICE=cpu: its four conversions (per channel, the budget walk, the
    self recipe's heal, every site with a full-rank heal) and its table of stage seconds, each row read from the
    run's fidelity.json."""
    import os

    from conftest import tiny_hf

    repo = Path(__file__).resolve().parents[2]
    text = tmp_path / "t.txt"
    text.write_text("the of and to in a is that it was for on are as with his they at be this " * 300)
    env = {**os.environ, "OUT": str(tmp_path / "out"), "DEVICE": "cpu", "MODEL": str(tiny_hf(tmp_path / "m")),
           "NORMLAB": str(Path(sys.executable).parent / "normlab"), "PYTHON": sys.executable,
           "EXTRA": f"--calibrate {text} --seq-len 16 --sequences 4 --eval-text none",
           "HEAL": "--heal-tokens 256 --set data.samples=32",
           "FULL_BUDGET": "--heal-tokens 256", "FULL_SAMPLES": "32"}  # fmt: skip  # the default FULL's own --set
    proc = subprocess.run(
        ["bash", str(repo / "scripts" / "gpu_convert.sh")], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = proc.stdout.strip().splitlines()[-4:]
    names = ["per-channel", "budget-walk", "self-recipe", "every-site-full"]
    assert [r.split()[0] for r in rows] == names, proc.stdout[-1500:]
    assert "budget walk" in rows[1] and "heal" in rows[2] and "samples" in rows[2]
    assert "5 sites" in rows[3] and "heal 256 tokens" in rows[3], rows[3]  # every norm of the tiny Llama
    for name in names:
        cfg = json.loads((tmp_path / "out" / name / "convert_config.json").read_text())
        assert cfg["device"] == "cpu" and cfg["per"] == "channel"
    full = json.loads((tmp_path / "out" / "every-site-full" / "convert_config.json").read_text())
    assert full["heal"]["train"] == "all" and full["calibrate"]["massive_tokens"] == "route"


def test_heal_seed_orders_the_text_stream(models, tmp_path):
    """issue 48: data.seed draws the order of the text's stream too (0, the default, keeps every earlier order)."""
    curves = {}
    for seed in (0, 0, 1):
        out = tmp_path / f"o{seed}-{len(curves)}"
        assert main(convert_argv(models["m"], models["text"], "--out", out, "--heal-tokens", 256, "--set",
                             f"data.seed={seed}")) == 0  # fmt: skip
        curve = json.loads((out / "fidelity.json").read_text())["heal"]["curve"]
        curves.setdefault(seed, []).append([{k: v for k, v in p.items() if k != "seconds"} for p in curve])
    assert curves[0][0] == curves[0][1]  # a seed is one order (the clock aside)
    assert curves[0][0] != curves[1][0]


def test_saving_over_the_folder_the_model_was_loaded_from_is_refused(models):
    """Issue 65, A30: save_converted into the folder the model came from would replace its original weights."""
    from normlab.conversion.data.models import load_model

    net, _ = load_model(models["m"], progress=False)
    rec = normlab.convert_norms(net, "dyisru", progress=False)
    with pytest.raises(ValueError, match="is the folder the model was loaded from"):
        normlab.save_converted(net, rec, models["m"])


def _tree(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): file_sha256(p) for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_save_that_fails_part_way_keeps_the_previous_output(models, tmp_path, capsys, monkeypatch):
    """issue 85: `--overwrite` removed the old output and only then wrote the new one, so a full disk (or a kill)
    during the save lost both. Now the new one is written beside and moved into place: a failure after the weights'
    first bytes leaves the old folder file for file, says so without a traceback, and leaves no partial folder."""
    from normlab.conversion import workflow

    out = tmp_path / "o"
    assert main(convert_argv(models["m"], models["text"], "--out", out)) == 0
    before = _tree(out)
    real = workflow.save_converted

    def full_disk(net, record, path, **kw):
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "model.safetensors").write_bytes(b"\0" * 1000)  # part of the weights, then the disk is full
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(workflow, "save_converted", full_disk)
    capsys.readouterr()
    rc = main(convert_argv(models["m"], models["text"], "--to", "dyt", "--out", out, "--overwrite"))
    err = capsys.readouterr().err
    assert rc == 2 and "writing the conversion failed" in err and f"the previous {out} is as it was" in err, err
    assert "No space left on device" in err and "Traceback" not in err
    assert _tree(out) == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".o.")] == [".o.lock"]  # no partial left
    monkeypatch.setattr(workflow, "save_converted", real)
    assert main(convert_argv(models["m"], models["text"], "--to", "dyt", "--out", out, "--overwrite")) == 0
    assert json.loads((out / "normlab_conversion.json").read_text())["target"] == "dyt"  # replaced, once whole


@pytest.mark.slow
def test_a_resumed_heal_counts_every_process_s_minutes(models, tmp_path):
    """issue 85: a resumed cell's stages counted only the last process (4.05 minutes recorded where its own heal line
    said 7.4), so a `minutes <= 30` check passed wrongly. Now the heal's seconds are its checkpoint's over all
    processes, and the stages before it add up across processes."""
    ck, out = tmp_path / "heal.pt", tmp_path / "out"
    argv = [sys.executable, "-m", "normlab.cli", *convert_argv(models["m"], models["text"], "--heal-minutes", 0.2,
                                                           "--checkpoint", ck, "--out", out)]  # fmt: skip
    first = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    deadline = time.time() + 180
    while time.time() < deadline and not ck.exists():
        time.sleep(0.05)
    time.sleep(4)  # some heal seconds in the first process
    first.send_signal(signal.SIGINT)
    first.communicate(timeout=120)
    assert first.returncode == 130
    earlier = json.loads((tmp_path / "heal.pt.stages.json").read_text())["stages"]  # the first process's share
    second = subprocess.run([*argv, "--resume"], capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr[-2000:]
    fid = json.loads((out / "fidelity.json").read_text())
    assert fid["heal"]["seconds"] >= 4 and fid["heal"]["resumed_from"] > 0
    assert fid["stages"]["heal"] >= fid["heal"]["seconds"]  # every process's heal, plus this one's guard
    assert all(fid["stages"][k] > v for k, v in earlier.items())  # the first process's load, samples, ... added
    assert not (tmp_path / "heal.pt.stages.json").exists()


def test_the_resume_command_names_a_checkpoint_only_where_it_is_not_the_default(monkeypatch):
    """issue 99 (N41): the command printed after an interrupted heal added ``--checkpoint OUT.heal.pt``, the path
    ``--out`` gives by default. It is added only for a checkpoint the command line did not name and --out does not
    give."""
    from normlab.conversion.workflow import _resume_command

    argv = ["normlab", "convert", "--model", "m", "--heal-minutes", "2", "--out", "o"]
    monkeypatch.setattr(sys, "argv", argv)
    assert _resume_command("o.heal.pt", "o") == "normlab convert --model m --heal-minutes 2 --out o --resume"
    assert _resume_command("/elsewhere.pt", "o").endswith("--out o --checkpoint /elsewhere.pt --resume")
    monkeypatch.setattr(sys, "argv", [*argv, "--checkpoint", "c.pt"])
    assert _resume_command("c.pt", "o").endswith("--out o --checkpoint c.pt --resume")
