"""scripts/gpu_check.sh at its tiny size on the CPU: every stage runs and writes what the GPU run will."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_gpu_check_runs_every_stage_at_a_tiny_size(tmp_path):
    env = {**os.environ, "TINY": "1", "OUT": str(tmp_path), "PY": sys.executable}
    env.pop("NORMLAB_KERNEL", None)
    run = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh")], env=env, capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "passed" in (tmp_path / "tests.log").read_text()
    rows = list(csv.DictReader((tmp_path / "kernels_gpu.csv").open()))
    got = {(r["op"], r["provider"], r["mode"]) for r in rows}
    providers = {"dyt": 3, "dyisru": 3, "derf": 3, "rms_norm": 4}  # eager, compile, normlab (+ torch's rms_norm)
    for op, n in providers.items():
        assert len({p for o, p, _ in got if o == op}) == n, (op, got)
    assert {m for *_, m in got} == {"forward", "backward", "full"}
    assert all(float(r["copy_GB/s"]) > 0 and float(r["ms"]) > 0 for r in rows)
    titan = "== 3. torchtitan" in run.stdout
    assert titan and ("skipped: torchtitan does not import here" in run.stdout or "loss:" in run.stdout), run.stdout
