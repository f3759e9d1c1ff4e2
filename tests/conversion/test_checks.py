"""What `normlab convert` checks before any work (normlab.conversion.checks): inputs that are not what they should
be, an output or checkpoint over an input, a model the walk and heal cannot measure, a machine that cannot hold
the conversion. Each refusal names the flag and the fix, and nothing is written."""

from __future__ import annotations

import json

import pytest

from conftest import CALIB, convert_argv, tiny_hf
from normlab.cli import main


def test_defect_5_a_checkpoint_inside_an_output_to_be_made_is_refused(tmp_path, capsys):
    model = tiny_hf(tmp_path / "m")
    text = tmp_path / "calib.txt"
    text.write_text(CALIB)
    rc = main(
        [
            "convert",
            "--model",
            str(model),
            "--calibrate",
            str(text),
            "--heal-tokens",
            "1000",
            "--out",
            str(tmp_path / "o"),
            "--checkpoint",
            str(tmp_path / "o" / "ck.pt"),
        ]
    )
    assert rc == 2 and "inside an input or the output" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("key", ["--calibrate", "--eval-text"])
def test_an_input_inside_the_output_to_be_cleared_is_refused_and_kept(models, tmp_path, capsys, key):
    out = tmp_path / "o1"
    assert main(convert_argv(models["m"], models["text"], "--out", out)) == 0
    mine = out / "mytext.txt"
    mine.write_text(models["text"].read_text())
    capsys.readouterr()
    args = convert_argv(models["m"], models["text"], "--out", out, "--overwrite")
    if key == "--calibrate":
        args[args.index("--calibrate") + 1] = str(mine)
    else:
        args += ["--eval-text", str(mine)]
    rc = main(args)
    err = capsys.readouterr().err
    assert rc == 2 and f"{key} {mine} lies inside --out" in err, err
    assert mine.is_file() and (out / "model.safetensors").is_file()


def test_an_empty_text_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch):
    """issue 50: an empty --eval-text failed only after the model had loaded."""
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    monkeypatch.setattr("normlab.conversion.workflow.load_model", lambda *a, **k: pytest.fail("loaded the model"))
    model = tiny_hf(tmp_path / "m")
    for flag_ in ("--eval-text", "--calibrate"):
        rc = main(["convert", "--model", str(model), flag_, str(empty), "--out", str(tmp_path / "o")])
        err = capsys.readouterr().err
        assert rc == 2 and f"{flag_} {empty} is empty" in err, err


def test_a_resume_from_a_file_that_is_no_checkpoint_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch):
    """issue 50: a file given to --checkpoint --resume that is not a checkpoint was found out after calibration."""
    monkeypatch.setattr("normlab.conversion.workflow.load_model", lambda *a, **k: pytest.fail("loaded the model"))
    text = tmp_path / "t.txt"
    text.write_text(CALIB)
    model = tiny_hf(tmp_path / "m")
    for content in (b"not a checkpoint", None):
        bogus = tmp_path / "bogus.pt"
        if content is None:
            import torch

            torch.save({"weights": torch.zeros(2)}, bogus)  # a torch file, but not a heal's state
        else:
            bogus.write_bytes(content)
        argv = ["convert", "--model", str(model), "--calibrate", str(text), "--heal-tokens", "1000", "--checkpoint",
                str(bogus), "--resume", "--no-progress", "--eval-text", "none"]  # fmt: skip
        assert main(argv) == 2
        assert f"--resume: {bogus} is not a heal checkpoint" in capsys.readouterr().err


def test_a_converted_folder_is_refused_as_an_original_and_the_cache_is_not_inside_out(
    models, tmp_path, capsys, monkeypatch
):
    """Issue 65, G3 and F21: `convert --model` of a converted folder loaded it as a plain model and reported a wrong
    original; an --out holding NORMLAB_CACHE lost the cache on --overwrite. Both are refused before any work."""
    out = tmp_path / "o"
    assert main(convert_argv(models["m"], models["text"], "--out", out)) == 0
    capsys.readouterr()
    assert main(convert_argv(out, models["text"], "--out", tmp_path / "o2")) == 2
    err = capsys.readouterr().err
    assert "is a converted model" in err and str(models["m"].resolve()) in err and not (tmp_path / "o2").exists()
    monkeypatch.setenv("NORMLAB_CACHE", str(out / "cache"))
    assert main(convert_argv(models["m"], models["text"], "--out", out, "--overwrite")) == 2
    assert "holds normlab's cache" in capsys.readouterr().err and (out / "normlab_conversion.json").is_file()


def test_a_masked_lm_gets_no_next_token_cross_entropy_and_no_walk_or_heal(tmp_path, capsys):
    """issue 65: a converted BERT printed a next-token cross-entropy, which means nothing for a masked LM (its
    logits predict their own position). Its KL is still measured; the budget walk and the heal, which rank and
    validate by that cross-entropy, are refused before calibration."""
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
    )
    transformers.BertForMaskedLM(cfg).save_pretrained(tmp_path / "bert")
    text = tmp_path / "t.txt"
    text.write_text(CALIB)
    argv = ["convert", "--model", str(tmp_path / "bert"), "--calibrate", str(text), "--seq-len", "16",
            "--no-progress", "--eval-text", str(text)]  # fmt: skip
    assert main([*argv, "--out", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    assert "KL" in out and "cross-entropy" not in out, out
    fid = json.loads((tmp_path / "o" / "fidelity.json").read_text())
    assert "kl" in fid and "ce_original" not in fid and "ce_original" not in fid["second_text"]
    for extra in (["--budget-nats", "0.2"], ["--heal-tokens", "1000"]):
        assert main([*argv, *extra]) == 2
        assert "does not predict the next token (a masked LM)" in capsys.readouterr().err


def test_a_conversion_the_machine_cannot_hold_is_refused_before_calibration(tmp_path, capsys, monkeypatch):
    """issue 66: a conversion that will not fit in memory is refused once the model is loaded, with the numbers
    (the peak measured on Qwen2.5-Coder-0.5B, 3.7x the float32 model), before any calibration."""
    from normlab.conversion.checks import CONVERSION_PEAK

    monkeypatch.setattr("normlab.errors.machine_memory", lambda: 10_000)  # bytes: less than the tiny model needs
    monkeypatch.setattr(
        "normlab.conversion.workflow.convert_norms", lambda *a, **k: pytest.fail("calibrated before refusing")
    )
    text = tmp_path / "t.txt"
    text.write_text(CALIB)
    argv = ["convert", "--model", str(tiny_hf(tmp_path / "m")), "--calibrate", str(text), "--seq-len", "16",
            "--eval-text", "none", "--no-progress", "--out", str(tmp_path / "o")]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"a peak of about {CONVERSION_PEAK:g}x the float32 model's" in err and "a job may take" in err, err
    assert not (tmp_path / "o").exists()
