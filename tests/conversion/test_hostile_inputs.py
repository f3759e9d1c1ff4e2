"""What a demanding user's hostile inputs to `normlab convert` and `normlab study` meet (issue 85, the re-try of
`scripts/retry_inputs.py`): a full disk before the work and in the middle of it, a warning, a model the command
cannot run. Each is one line naming the file or the flag and the fix, before the work where it can be."""

from __future__ import annotations

import pytest

from conftest import convert_argv
from normlab.cli import main

pytest.importorskip("transformers")


def test_a_full_disk_is_refused_before_the_work_naming_the_folder(models, tmpfs, capsys):
    """A real full disk: a 100 kB tmpfs cannot hold the tiny model's conversion. The check runs once the model is
    loaded, before any calibration, and names the folder, the space free and the space needed."""
    import shutil

    mount = tmpfs("100k")
    free = shutil.disk_usage(mount).free
    rc = main(convert_argv(models["m"], models["text"], "--out", mount / "o"))
    said = capsys.readouterr()
    assert rc == 2 and f"--out {mount / 'o'}: its disk has {free / 1e6:.1f} MB free" in said.err, said.err
    assert "calibrat" not in said.out.lower() and "Traceback" not in said.err
    assert not (mount / "o").exists()


def test_a_disk_that_fills_mid_command_is_one_line_naming_the_fix(models, tmpfs, capsys):
    """issue 85, the re-try: `normlab study` on a full disk died with a raw OSError traceback at its first write (the
    study's lock). A full disk or a folder that cannot be written, met anywhere in a command, is one line and exit 2,
    with the fix; any other OSError keeps its traceback."""
    mount = tmpfs("300k")
    with open(mount / "fill", "wb") as f, pytest.raises(OSError):
        while True:
            f.write(b"\0" * 65536)
            f.flush()
    study = mount.parent / "s.toml"
    base = f'model = "{models["m"]}"\n"data.text" = "{models["text"]}"'
    study.write_text(f'title = "t"\n[base]\n{base}\n[[cells]]\nname = "a"\n')
    assert main(["study", str(study), "--root", str(mount / "r"), "--no-progress"]) == 2
    said = capsys.readouterr()
    assert "normlab study: error: writing" in said.err and "No space left on device" in said.err, said.err
    assert "free some space" in said.err and "Traceback" not in said.err
    import os

    fds = [f"/proc/self/fd/{fd}" for fd in os.listdir("/proc/self/fd")]
    held = [os.readlink(fd) for fd in fds if os.path.exists(fd)]
    assert not [f for f in held if f.startswith(str(mount))], held  # the lock's descriptor was left open before


def test_a_warning_is_one_line_of_the_command_s(models, tmp_path, capsys):
    """issue 85, the re-try: a calibration text of random bytes was warned about as Python does, with the file and
    line of normlab's source and that line's code. The command prints one line of its own, and goes on."""
    noise = tmp_path / "noise.txt"
    noise.write_bytes(bytes(range(256)) * 40)
    assert main(convert_argv(models["m"], noise, "--eval-text", "none")) == 0
    err = capsys.readouterr().err
    assert "normlab convert: warning: " in err and "are not text" in err, err
    assert "UserWarning" not in err and ".py:" not in err, err


def test_a_model_the_command_cannot_run_is_refused_before_calibration(models, tmp_path, capsys):
    """issue 85, the re-try: an encoder-decoder (T5) failed in calibration with transformers' own message ("You must
    specify exactly one of input_ids or inputs_embeds"), blamed on "calibration batch 0"; a --seq-len beyond the
    model's positions ran for 12 minutes and more before it was killed. Both are refused once the model is loaded,
    before any calibration."""
    import transformers

    t5 = tmp_path / "t5"
    config = transformers.T5Config(vocab_size=256, d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16)
    transformers.T5ForConditionalGeneration(config).save_pretrained(t5)
    cases = (
        (convert_argv(t5, models["text"]), "is an encoder-decoder (T5ForConditionalGeneration)"),
        (convert_argv(models["m"], models["text"], "--seq-len", "100000"), "is longer than"),
    )
    for argv, says in cases:
        assert main(argv) == 2
        said = capsys.readouterr()
        assert says in said.err and "calibrat" not in said.out.lower() and "Traceback" not in said.err, said.err


def test_a_small_conversion_fits_a_small_disk_and_its_estimate_covers_what_is_written(models, tmp_path, tmpfs):
    """issue 99: the space check added 16 MB for a tokenizer to every estimate, so the tiny model's conversion
    (under 1 MB) was refused on a 1 MB disk. The estimate now counts the tokenizer that will be saved (its
    tokenizer.json, serialised in memory); it still covers every byte the folder holds."""
    from normlab.conversion.data.models import load_model
    from normlab.owner import saved_bytes

    assert main(convert_argv(models["m"], models["text"], "--out", tmp_path / "big", "--no-progress")) == 0
    written = sum(f.stat().st_size for f in (tmp_path / "big").rglob("*") if f.is_file())
    net, tok = load_model(models["m"], progress=False)
    assert written <= saved_bytes(net, tok) <= 2 * written + (256 << 10), (written, saved_bytes(net, tok))
    mount = tmpfs(f"{max(1 << 20, 2 * written) // 1024}k")
    assert main(convert_argv(models["m"], models["text"], "--out", mount / "o", "--no-progress")) == 0
    assert (mount / "o" / "config.json").is_file()
