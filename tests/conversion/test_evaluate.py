"""``normlab evaluate DIR`` (normlab.conversion.evaluate): a converted folder judged against the original it
records, as a user runs it, on a tiny Llama with a real tokenizer and a chat template."""

from __future__ import annotations

import json

import pytest

from conftest import TEXT, tiny_lm, tiny_tokenizer, with_sinks
from normlab.cli import main

pytest.importorskip("transformers")


@pytest.mark.slow
def test_evaluate_judges_a_converted_folder_against_its_original(tmp_path, capsys):
    src = tmp_path / "llama"
    with_sinks(tiny_lm(seed=4, max_position_embeddings=4096)).save_pretrained(src)
    tiny_tokenizer().save_pretrained(src)
    text = tmp_path / "text.txt"
    text.write_text(TEXT * 4)
    out = tmp_path / "o"
    argv = [
        "convert",
        "--model",
        str(src),
        "--calibrate",
        str(text),
        "--seq-len",
        "32",
        "--sequences",
        "8",
        "--eval-text",
        "none",
        "--per",
        "channel",
        "--no-progress",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    printed = capsys.readouterr()
    assert "judged as used" in printed.out and "blow-ups" in printed.out and "Q: What is the capital" in printed.out
    at_convert = json.loads((out / "fidelity.json").read_text())["usage"]
    assert main(["evaluate", str(out), "--prompts", "3"]) == 0
    printed = capsys.readouterr()
    assert "evaluate: judge: texts, chat answers, long sequences, stress inputs:" in printed.err  # its stages
    report = json.loads((out / "evaluation.json").read_text())
    assert report["generation"]["prompts"] == 3 and set(report["texts"]) == {"held-out", "chat"}
    got, want = report["texts"]["held-out"], at_convert["texts"]["held-out"]  # the same model on the same text
    assert got["kld"] == pytest.approx(want["kld"], rel=1e-4) and got["gap"] == pytest.approx(want["gap"], rel=1e-4)
    assert got["same_top1"] == want["same_top1"] and got["tokens"] == want["tokens"]
    assert main(["evaluate", str(out), "--original", str(tmp_path / "nothing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["evaluate", str(src)]) == 2
    assert "is not a converted model's folder" in capsys.readouterr().err
    # issue 85: the report says what it was judged against, and a conversion is never taken as the original
    assert report["original"]["path"] == str(src.resolve()) and report["original"]["architecture"] == "LlamaForCausalLM"
    assert list(report["original"]["weights_sha256"]) == ["model.safetensors"]
    before = (out / "evaluation.json").read_bytes()
    for wrong in (out, tmp_path / "o2"):
        if wrong != out:
            assert main([*argv[:-1], str(wrong)]) == 0  # another conversion of the same original
            capsys.readouterr()
        assert main(["evaluate", str(out), "--original", str(wrong)]) == 2
        err = capsys.readouterr().err
        assert "is a normlab conversion" in err and f"converted from ({src.resolve()})" in err, err
    assert (out / "evaluation.json").read_bytes() == before  # nothing judged, nothing overwritten


def test_a_masked_lm_is_refused_before_the_judgement(tmp_path, capsys):
    """issue 85: `normlab evaluate` on a converted masked LM died with a raw traceback at generate()."""
    import torch
    import transformers

    cfg = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=128)  # fmt: skip
    torch.manual_seed(0)
    transformers.BertForMaskedLM(cfg).save_pretrained(tmp_path / "bert")
    tiny_tokenizer().save_pretrained(tmp_path / "bert")
    (tmp_path / "t.txt").write_text(TEXT * 4)
    argv = ["convert", "--model", str(tmp_path / "bert"), "--to", "dyisru", "--calibrate", str(tmp_path / "t.txt"),
            "--seq-len", "16", "--sequences", "4", "--no-progress", "--out", str(tmp_path / "conv")]  # fmt: skip
    assert main(argv) == 0
    capsys.readouterr()
    assert main(["evaluate", str(tmp_path / "conv")]) == 2
    err = capsys.readouterr().err
    assert "holds a BertForMaskedLM, which does not predict the next token" in err and "Traceback" not in err
    assert not (tmp_path / "conv" / "evaluation.json").exists()


def _tiny_conversion(tmp_path):
    """A tiny Llama with a tokenizer (the original) and its quick conversion by `normlab convert` (the folder)."""
    src = tmp_path / "llama"
    tiny_lm(seed=4).save_pretrained(src)
    tiny_tokenizer().save_pretrained(src)
    (tmp_path / "text.txt").write_text(TEXT * 4)
    built = tmp_path / "o"
    argv = ["convert", "--model", str(src), "--calibrate", str(tmp_path / "text.txt"), "--seq-len", "16",
            "--sequences", "4", "--eval-text", "none", "--no-progress", "--out", str(built)]  # fmt: skip
    assert main(argv) == 0
    return src, built


def test_a_read_only_folder_is_refused_before_minutes_of_judging(tmp_path, capsys):
    """issue 85: `normlab evaluate` on a read-only folder judged for minutes, then failed raw writing its report.
    Here the folder sits on a tmpfs remounted read-only: refused at once, naming the report, nothing loaded."""
    import shutil
    import subprocess

    src, built = _tiny_conversion(tmp_path)
    mount = tmp_path / "ro"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        shutil.copytree(built, mount / "o")
        subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)
        capsys.readouterr()
        assert main(["evaluate", str(mount / "o"), "--original", str(src)]) == 2
        said = capsys.readouterr()
        assert f"the report {mount / 'o' / 'evaluation.json'}" in said.err and "not writable" in said.err, said.err
        assert "load the converted model" not in said.err and "Traceback" not in said.err
        # issue 99: a read-only conversion is judged with the report written elsewhere
        assert main(["evaluate", str(mount / "o"), "--original", str(src), "--report", str(tmp_path / "r.json")]) == 0
        assert json.loads((tmp_path / "r.json").read_text())["texts"]["held-out"]["tokens"] > 0
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_a_damaged_record_or_config_is_named_with_its_file(tmp_path, capsys):
    """issue 85, the re-try: a folder whose normlab_conversion.json was cut short (a full disk during a copy) made
    `normlab evaluate` print "Expecting value: line 3 column 13 (char 50)", naming no file. The file and the fix are
    named, for the record and for convert_config.json."""
    _, built = _tiny_conversion(tmp_path)
    for name in ("convert_config.json", "normlab_conversion.json"):
        path = built / name
        path.write_text(path.read_text()[:50])
        capsys.readouterr()
        assert main(["evaluate", str(built)]) == 2
        err = capsys.readouterr().err
        assert f"{path} is damaged (" in err and "convert the model again" in err and "Traceback" not in err, err


def test_evaluate_judges_the_conversions_own_texts_or_says_why_not(tmp_path, capsys, monkeypatch):
    """issue 99: evaluate judged other data than the conversion's without a word: the default texts when
    convert_config.json was gone, an edited text as "held-out", and a relative --calibrate path failed from another
    folder after both models were loaded; evaluation.json existing as a folder was found after the judgement. Each is
    refused before any model is loaded, or judged under the name it was given (--text)."""
    src = tmp_path / "llama"
    tiny_lm(seed=4).save_pretrained(src)
    tiny_tokenizer().save_pretrained(src)
    (tmp_path / "text.txt").write_text(TEXT * 4)
    monkeypatch.chdir(tmp_path)  # a relative --calibrate, as a user types it
    argv = ["convert", "--model", str(src), "--calibrate", "text.txt", "--seq-len", "16", "--sequences", "4",
            "--eval-text", "none", "--no-progress", "--out", "o"]  # fmt: skip
    assert main(argv) == 0
    built = tmp_path / "o"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    capsys.readouterr()
    assert main(["evaluate", str(built)]) == 0  # the config names the text by its absolute path
    assert "held-out" in json.loads((built / "evaluation.json").read_text())["texts"]

    def refused(*args: str) -> str:
        capsys.readouterr()
        assert main(["evaluate", str(built), *args]) == 2
        err = capsys.readouterr().err
        assert "load the converted model" not in err and "Traceback" not in err, err
        return err

    (built / "evaluation.json").unlink()
    (built / "evaluation.json").mkdir()
    assert "is a folder: remove it, or pass --report" in refused()
    (built / "evaluation.json").rmdir()
    (tmp_path / "text.txt").write_text(TEXT * 4 + "edited since")
    assert "is not the text" in refused() and "made_from.text_sha256" in refused()
    other = tmp_path / "other.txt"
    other.write_text(TEXT * 3)
    capsys.readouterr()
    assert main(["evaluate", str(built), "--text", str(other), "--report", "r.json"]) == 0
    assert set(json.loads((elsewhere / "r.json").read_text())["texts"]) >= {"given: other.txt"}
    (built / "convert_config.json").unlink()
    assert "convert_config.json is missing" in refused() and "--text FILE" in refused()


def test_several_conversions_are_judged_then_compared_answer_by_answer(tmp_path, capsys):
    """`normlab evaluate A B` (what scripts/chat_scores.py, answers_side_by_side.py and heal_guard.py did): each
    folder judged into its own evaluation.json, then their answers side by side, B's chat score against A's prompt by
    prompt, and the heal guard's rule between them; folders of two originals are refused before any model loads."""
    src, other = tmp_path / "llama", tmp_path / "other"
    for path, seed in ((src, 4), (other, 5)):
        tiny_lm(seed=seed).save_pretrained(path)
        tiny_tokenizer().save_pretrained(path)
    (tmp_path / "text.txt").write_text(TEXT * 4)

    def convert(model, out, *flags):
        argv = ["convert", "--model", str(model), "--calibrate", str(tmp_path / "text.txt"), "--seq-len", "16",
                "--sequences", "4", "--eval-text", "none", "--no-progress", "--out", str(out), *flags]  # fmt: skip
        assert main(argv) == 0

    convert(src, tmp_path / "a")
    convert(src, tmp_path / "b", "--per", "channel", "--to", "dyt")
    convert(other, tmp_path / "c")
    capsys.readouterr()
    assert main(["evaluate", str(tmp_path / "a"), str(tmp_path / "b"), "--names", "dyisru", "dyt", "--prompts", "4",
                 "--side-by-side", "2"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    table = [line for line in out.splitlines() if line.startswith("| ")]
    assert table[-3] == "| prompt | original | dyisru | dyt |" and table[-1].count(" | ") == 3
    assert table[-2].startswith("| What is the capital of France? | ")  # the first two prompts, answered
    assert "chat score: dyisru " in out and "chat score: dyt " in out and "dyt against dyisru: " in out
    assert "McNemar's exact p = " in out and "dyt against dyisru on held-out, the heal guard's rule: " in out
    for f in ("a", "b"):
        assert json.loads((tmp_path / f / "evaluation.json").read_text())["generation"]["prompts"] == 4
    assert main(["evaluate", str(tmp_path / "a"), str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert "converted from different originals" in err and "load the converted model" not in err
    assert main(["evaluate", str(tmp_path / "a"), str(tmp_path / "b"), "--report", str(tmp_path / "r.json")]) == 2
    assert "--report names one report" in capsys.readouterr().err
