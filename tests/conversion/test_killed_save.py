"""issue 85: a `normlab convert --overwrite` killed by SIGKILL while it saves. The kill is real (a process of its
own, killed at a chosen point of the save), and so is what it leaves on disk; the next run puts it right."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import convert_argv, file_sha256
from normlab.cli import main

pytestmark = pytest.mark.slow

# Runs `normlab convert` in a process that kills itself with SIGKILL at one point of the save: "written" once the
# new folder is whole beside --out, "swapping" between moving the old output aside and moving the new one in.
KILLER = """
import os, signal, sys
import normlab.conversion.workflow as workflow
from normlab.cli import main

point, argv = sys.argv[1], sys.argv[2:]
real_save, real_replace = workflow.save_converted, os.replace

def save_then_die(*args, **kwargs):
    real_save(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGKILL)

def replace_or_die(src, dst):
    if str(src).endswith(".partial"):  # the second rename: the old output is aside, the new one not yet in
        os.kill(os.getpid(), signal.SIGKILL)
    real_replace(src, dst)

if point == "written":
    workflow.save_converted = save_then_die
else:
    os.replace = replace_or_die
sys.exit(main(argv))
"""


def _tree(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): file_sha256(p) for p in sorted(folder.rglob("*")) if p.is_file()}


def _beside(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".o."))


@pytest.mark.parametrize("point", ["written", "swapping"])
def test_a_save_killed_part_way_leaves_a_whole_output_that_the_next_run_restores(point, models, tmp_path, capsys):
    out = tmp_path / "o"
    assert main(convert_argv(models["m"], models["text"], "--out", out)) == 0
    before = _tree(out)
    argv = convert_argv(models["m"], models["text"], "--to", "dyt", "--out", out, "--overwrite")
    proc = subprocess.run([sys.executable, "-c", KILLER, point, *argv], capture_output=True, text=True, timeout=600)
    assert proc.returncode == -9, proc.stderr[-2000:]  # killed, not ended
    if point == "written":  # the old output untouched, the new one whole beside it
        assert _tree(out) == before and _beside(tmp_path) == [".o.lock", ".o.partial"]
    else:  # the old output aside: --out itself is missing until the next run
        assert not out.exists() and _beside(tmp_path) == [".o.lock", ".o.partial", ".o.replaced"]
    capsys.readouterr()
    # the next run puts back what was there before it checks --out: without --overwrite, --out is refused as
    # existing, and it holds the old output, file for file
    assert main(convert_argv(models["m"], models["text"], "--to", "dyt", "--out", out)) == 2
    err = capsys.readouterr().err
    assert "already exists" in err and ("restored" in err) == (point == "swapping"), err
    assert _tree(out) == before
    assert main(argv) == 0  # and the conversion that was killed goes through, clearing what the kill left
    err = capsys.readouterr().err
    assert ("a partial output that a killed save left" in err) == (point == "written"), err
    assert json.loads((out / "normlab_conversion.json").read_text())["target"] == "dyt"
    assert _beside(tmp_path) == [".o.lock"]


def test_a_replaced_folder_whose_successor_is_in_place_is_removed(tmp_path):
    """Killed after the second rename, before the old folder was removed: the new output stays, the old goes."""
    from normlab.owner import beside, restore_swapped

    out = tmp_path / "o"
    for folder, text in ((out, "new"), (beside(out, "replaced"), "old")):
        folder.mkdir()
        (folder / "f").write_text(text)
    assert "left by a save killed after its new output was in place" in restore_swapped(out)
    assert (out / "f").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["o"]
    assert restore_swapped(out) is None
