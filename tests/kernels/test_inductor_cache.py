"""torch.compile's cache is kept per CPU (normlab.kernels.inductor_cache): code generated for one vector width is
never reused for another."""

import json
import os
import subprocess
import sys

import pytest

from normlab.kernels import cpu_build
from normlab.kernels.inductor_cache import ENV, default_folder, use_cache_of_this_cpu

# A DyT forward, compiled, against eager; then what the FX graph cache did.
SCRIPT = """
import json, sys
import torch
from torch._dynamo.utils import counters
from normlab.kernels.inductor_cache import use_cache_of_this_cpu
if sys.argv[1] == "own":
    use_cache_of_this_cpu()
f = lambda x, w: w * torch.tanh(0.5 * x) + 1.0
x, w = torch.randn(37, 1000), torch.randn(1000)
err = (torch.compile(f)(x, w) - f(x, w)).abs().max().item()
print(json.dumps({"err": err, "cache": dict(counters["inductor"])}))
"""


def test_the_folder_is_named_by_the_cpu_and_the_kernels_source_and_a_chosen_one_is_kept(monkeypatch, tmp_path):
    """The kernels' source names the folder too: with 0.10.0's pointwise_bwd (one argument fewer), a warm cache gave
    every compiled point-wise norm the backward compiled against the old op, which raised."""
    monkeypatch.setenv(ENV, str(default_folder()))  # as Inductor leaves it once imported
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    folder = use_cache_of_this_cpu()
    name = f"{default_folder().name}-cpu-{cpu_build.cpu_key()}-ops-{cpu_build.source_key()}"
    assert folder == default_folder().with_name(name)
    monkeypatch.setattr(cpu_build, "_source", lambda: b"// another source")
    monkeypatch.setenv(ENV, str(default_folder()))
    assert use_cache_of_this_cpu() != folder  # another source, another cache
    monkeypatch.undo()
    monkeypatch.setenv(ENV, str(default_folder()))
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    assert use_cache_of_this_cpu() == folder
    assert os.environ[ENV] == str(folder)
    native = cpu_build.cpu_key()
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert cpu_build.cpu_key() != native  # a capped instruction set is another CPU to the caches
    monkeypatch.setenv(ENV, str(tmp_path))
    assert use_cache_of_this_cpu() is None
    assert os.environ[ENV] == str(tmp_path)


def _run(tmp_path, mode: str, isa: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in (ENV, "ATEN_CPU_CAPABILITY")}
    env["TMPDIR"] = str(tmp_path)  # Inductor's default folder, and ours beside it, start empty
    if isa:
        env["ATEN_CPU_CAPABILITY"] = isa
    proc = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_code_compiled_for_avx512_is_not_reused_for_avx2(tmp_path):
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    if "avx512" not in str(pick_vec_isa()):
        pytest.skip("the two vector widths need an AVX-512 CPU (ATEN_CPU_CAPABILITY=avx2 gives the other)")
    first = _run(tmp_path, "own", None)
    second = _run(tmp_path, "own", "avx2")
    assert first["err"] < 1e-5
    assert second["err"] < 1e-5, f"AVX-512 code reused under AVX2: {second}"
    assert second["cache"].get("fxgraph_cache_hit", 0) == 0, second
