"""The package as a user gets it: one version, a wheel and an sdist that carry the kernel sources, and a wheel that
installs into a fresh virtual environment and runs the command line, the kernel build and the README's example."""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

import normlab

REPO = Path(__file__).resolve().parents[1]


def test_the_version_is_written_once_and_the_changelog_names_it():
    pyproject = (REPO / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject and not re.search(r"^version\s*=\s*\"", pyproject, re.M)
    assert importlib.metadata.version("normlab") == normlab.__version__
    newest = re.search(r"^## (\S+)", (REPO / "CHANGELOG.md").read_text(), re.M).group(1)
    assert newest == normlab.__version__, "a new version needs its CHANGELOG.md entry"
    assert "MIT License" in (REPO / "LICENSE").read_text()
    assert 'license = "MIT"' in pyproject and 'license-files = ["LICENSE"]' in pyproject  # SPDX, not a TOML table


def _readme_example() -> str:
    text = (REPO / "README.md").read_text()
    return re.search(r"```python\n(.*?)```", text, re.S).group(1)  # the first one, on the front page


@pytest.mark.slow
def test_the_wheel_installs_in_a_fresh_venv_and_runs(tmp_path):
    """`python -m build` writes an sdist and a wheel with the C++ sources; the wheel, installed into a new venv
    (its dependencies read from this one's site-packages, normlab only from the wheel), runs `normlab --help`,
    builds the kernels from its own sources into an empty cache, and runs the README's Python example."""
    dist = tmp_path / "dist"
    built = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(REPO)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-3000:]
    assert "TOML table is deprecated" not in built.stdout + built.stderr  # issue 65: the license as SPDX
    wheel = next(dist.glob(f"normlab-{normlab.__version__}-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "normlab/kernels/csrc/cpu_norms.cpp" in names and "normlab/version.py" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") or n.endswith(".dist-info/LICENSE") for n in names)
    assert any(n.startswith("normlab/experiments/") and n.endswith(".toml") for n in names)
    with tarfile.open(next(dist.glob(f"normlab-{normlab.__version__}.tar.gz"))) as sdist:
        assert any(n.endswith("src/normlab/kernels/csrc/cpu_norms.cpp") for n in sdist.getnames())

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    site = subprocess.run(
        [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True
    ).stdout.strip()
    (Path(site) / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # torch, numpy, ... from here
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index", str(wheel)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert install.returncode == 0, install.stderr[-3000:]
    env = {**os.environ, "NORMLAB_CACHE": str(tmp_path / "cache"), "PYTHONPATH": ""}
    where = subprocess.run(
        [py, "-c", "import normlab; print(normlab.__file__)"], capture_output=True, text=True, env=env
    )
    assert where.stdout.strip().startswith(site), where.stdout + where.stderr  # the wheel's, not this checkout's
    cli = venv / "bin" / "normlab"
    assert subprocess.run([cli, "--help"], capture_output=True, env=env, timeout=300).returncode == 0
    kernels = subprocess.run([cli, "build-kernels"], capture_output=True, text=True, env=env, timeout=600)
    assert kernels.returncode == 0 and "normlab CPU kernels ready" in kernels.stdout, kernels.stderr[-2000:]
    example = subprocess.run(
        [py, "-c", _readme_example()], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600
    )
    assert example.returncode == 0, example.stderr[-3000:]
