"""normlab.conversion.stages: each stage's seconds and peak memory, as `normlab convert` records them."""

from __future__ import annotations

from pathlib import Path

import pytest

from normlab.conversion.stages import peak_rss_gb

_STAGES = """
import json, torch
from normlab.conversion.stages import Stages
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
print(json.dumps({"peaks": stages.peak_gb, "seconds": stages.seconds, "line": stages.line()}))
"""


def test_each_stage_records_its_own_peak_memory_and_seconds():
    """issue 66: a stage that holds 400 MB peaks at least 0.4 GB above a stage that holds nothing, and the stage
    after it reads its own peak, not the one before (on Linux the count restarts per stage). In a process of its
    own: in the test process, freed memory still resident can take the 400 MB without the peak moving."""
    import json
    import subprocess
    import sys

    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("the peak restarts only where /proc/self/clear_refs exists (Linux)")
    run = subprocess.run([sys.executable, "-c", _STAGES], capture_output=True, text=True, timeout=300, check=True)
    out = json.loads(run.stdout.strip().splitlines()[-1])
    peaks, seconds, line = out["peaks"], out["seconds"], out["line"]
    assert peaks["large"] >= peaks["small"] + 0.38, peaks
    assert peaks["after"] < peaks["large"] - 0.3, peaks
    assert set(seconds) == {"small", "large", "after"} and all(s >= 0 for s in seconds.values())
    assert "t: large: " in run.stderr and " GB" in run.stderr
    assert line.startswith("stage seconds: small ") and "stage peak memory (GB, resident): small " in line
    assert 0 < peak_rss_gb() < 1e4
