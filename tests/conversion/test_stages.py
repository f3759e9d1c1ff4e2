"""normlab.conversion.stages: each stage's seconds and peak memory, as `normlab convert` records them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from normlab.conversion.stages import Stages, peak_rss_gb


def test_each_stage_records_its_own_peak_memory_and_seconds(capsys):
    """issue 66: a stage that holds 400 MB peaks at least 0.4 GB above a stage that holds nothing, and the stage
    after it reads its own peak, not the one before (on Linux the count restarts per stage)."""
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("the peak restarts only where /proc/self/clear_refs exists (Linux)")
    stages = Stages(progress=True, prefix="t: ")
    with stages("small"):
        pass
    with stages("large"):
        big = torch.ones(100_000_000)  # 400 MB, touched
        del big
    with stages("after"):
        pass
    with stages("small"):  # entered twice: the seconds add up, the larger peak stays
        pass
    peaks = stages.peak_gb
    assert peaks["large"] >= peaks["small"] + 0.38, peaks
    assert peaks["after"] < peaks["large"] - 0.3, peaks
    assert set(stages.seconds) == {"small", "large", "after"} and all(s >= 0 for s in stages.seconds.values())
    err = capsys.readouterr().err
    assert "t: large: " in err and " GB" in err
    line = stages.line()
    assert line.startswith("stage seconds: small ") and "stage peak memory (GB, resident): small " in line
    assert 0 < peak_rss_gb() < 1e4
