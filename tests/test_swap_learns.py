"""issue 97: a Hugging Face Llama as transformers initialises it (std 0.02), its norms swapped with replace_norms'
default recipe, learns as fast as the RMSNorm model in its first 50 steps; the layers' own init does not. The run is
scripts/bench_swap_learns.py's (one source for the test and the docs' curves)."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_default_recipe_learns_within_0_15_nats_of_rmsnorm_in_50_steps(tmp_path):
    """2 blocks of width 128, AdamW 1e-3, 50 steps of 16 x 64 bytes of Shakespeare, seed 0: the mean of the last 10
    losses. Measured: RMSNorm 2.78, 'auto' 2.74, the layers' own init ('default', the 0.7.0 default) 3.41."""
    out = tmp_path / "learns.csv"
    cmd = [sys.executable, str(REPO / "scripts" / "bench_swap_learns.py"), "--steps", "50", "--seeds", "0",
           "--variants", "rms_norm", "auto", "default", "--csv", str(out)]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = list(csv.DictReader(out.open()))
    last10 = {v: sum(float(r["loss"]) for r in rows if r["variant"] == v and int(r["step"]) > 40) / 10
              for v in ("rms_norm", "auto", "default")}  # fmt: skip
    assert last10["auto"] <= last10["rms_norm"] + 0.15, last10
    assert last10["default"] > last10["rms_norm"] + 0.3, last10  # what the layers' own init gives: the test can fail
