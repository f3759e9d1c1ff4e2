"""`normlab.integrations.torchtitan` in torchtitan's own trainer (``torchtitan.train`` under torchrun, gloo on the CPU):
the Llama 3 debug model with DyT trains on 1 process, on 2 with FSDP2 and on 2 with TP=2 and sequence parallel, and
resumes from its distributed checkpoint with the losses of an uninterrupted run.

torchtitan 0.3.0 needs torch 2.14, so these run in the second venv `make titan` builds (``.venv-titan``; another with
``NORMLAB_TITAN_VENV``), through ``titan_cpu.py`` (the CPU shim, kept here and never in the library), on the tokenizer
and Shakespeare passages in ``assets/``."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import second_venv

HERE = Path(__file__).parent
VENV = second_venv("torchtitan")
TORCHRUN = VENV / "bin" / "torchrun"

pytestmark = pytest.mark.slow
STEP = re.compile(r"step:\s+(\d+)\s+loss:\s+([0-9.]+)")


def titan(tmp: Path, config: str, *args: str, procs: int = 1, steps: int = 4) -> dict[int, str]:
    """One torchtitan run; returns {step: loss as logged}. Fails with the run's last lines if it fails."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "NORMLAB_KERNEL"))}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [str(TORCHRUN), "--standalone", f"--nproc-per-node={procs}", str(HERE / "titan_cpu.py"),
           "--module", "cpu_configs", "--config", config, "--training.steps", str(steps),
           "--dump_folder", str(tmp), *args]  # fmt: skip
    run = subprocess.run(cmd, cwd=HERE, env=env, capture_output=True, text=True, timeout=400)
    out = re.sub(r"\x1b\[[0-9;]*m", "", run.stdout + run.stderr)
    assert run.returncode == 0, f"torchtitan failed ({run.returncode}):\n" + "\n".join(out.splitlines()[-30:])
    return {int(s): loss for s, loss in STEP.findall(out)}, out


def _learns(losses: dict[int, str], steps: int) -> None:
    assert sorted(losses) == list(range(1, steps + 1)), losses
    assert float(losses[steps]) < float(losses[1]), losses


def _trains(losses: dict[int, str], steps: int) -> None:
    """Every step ran and its loss is a number below the uniform guess's plus 1 nat (ln 2048 = 7.6): 3 steps are too
    few for a loss that falls at every step, on new batches each."""
    assert sorted(losses) == list(range(1, steps + 1)), losses
    assert all(0 < float(v) < 8.7 for v in losses.values()), losses


@pytest.mark.parametrize(
    "route, parallel",
    [("override", ["--parallelism.data_parallel_shard_degree", "2"]),
     ("converter", ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"])],
    ids=["fsdp2", "tp2_sp"],
)  # fmt: skip
def test_dyt_trains_in_torchtitan_on_two_processes(route, parallel, tmp_path):
    """FSDP2 over 2 ranks with full activation checkpointing and torch.compile of each block and the loss (DyT through
    the ``--override.imports`` route, no code of the user's), and TP=2 with
    sequence parallel (the converter route): alpha and bias placed as the norm's weight, the norm computing on its
    sequence shard."""
    extra = (
        ["--override.imports", "normlab.integrations.torchtitan.dyt", "--compile.enable"] if route == "override" else []
    )
    config = "llama3_debug_cpu_full_ac" if route == "override" else "llama3_debug_cpu_dyt"
    losses, out = titan(tmp_path, config, *extra, *parallel, procs=2, steps=3)
    _trains(losses, 3)
    if route == "override":
        assert "TitanDyT" in out and "Applied" in out  # torchtitan's own log of the replacement
        assert "Applied FullAC activation checkpointing" in out
        assert "Compiling each TransformerBlock with torch.compile" in out  # Inductor on the CPU, each rank


def test_a_resumed_dyt_run_repeats_the_uninterrupted_losses(tmp_path):
    """The model converter puts DyT at every site (the DyT paper's alpha0 by role); the trainer builds it on the meta
    device, initialises it through init_states, applies its selective activation checkpointing, trains and saves
    distributed checkpoints holding the layers' alpha. Then a run given only the step-2 checkpoint resumes from it:
    steps 3 and 4 log the losses of the run that never stopped, to the digits logged."""
    ckpt = ["--checkpoint.enable", "--checkpoint.interval", "2"]
    whole, out = titan(tmp_path / "whole", "llama3_debug_cpu_dyt", *ckpt, steps=4)
    _learns(whole, 4)
    assert "Applied SelectiveAC activation checkpointing" in out
    step = tmp_path / "whole" / "checkpoint" / "step-4"
    assert step.is_dir(), out[-2000:]
    meta = subprocess.run(
        [str(VENV / "bin" / "python"), "-c", "import sys, torch.distributed.checkpoint as d; "
         "print('\\n'.join(d.FileSystemReader(sys.argv[1]).read_metadata().state_dict_metadata))", str(step)],
        capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    assert any(k.endswith("layers.0.attention_norm.alpha") for k in meta), meta[:20]
    assert not any(k.endswith("attention_norm.weight") and "alpha" in k for k in meta)
    assert not any(k.endswith("norm.bias") for k in meta)  # the DyT paper's LLaMA layer has no bias
    # the step-2 checkpoint alone in a fresh folder, as a run stopped after step 2 leaves it (one launch fewer than
    # running those two steps again: each torchrun start costs about 20 s here)
    shutil.copytree(tmp_path / "whole" / "checkpoint" / "step-2", tmp_path / "parts" / "checkpoint" / "step-2")
    second, out = titan(tmp_path / "parts", "llama3_debug_cpu_dyt", *ckpt, steps=4)
    assert sorted(second) == [3, 4], out[-2000:]  # it resumed at step 2
    assert second == {3: whole[3], 4: whole[4]}


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
