"""The version of normlab, written here once: pyproject.toml reads it (``[tool.setuptools.dynamic]``), the package
exports it as ``normlab.__version__``, and files normlab writes record it."""

__version__ = "0.13.0"


def code_version() -> dict:
    """The code a result came from: normlab's and torch's versions, and in a git checkout the commit and whether
    normlab's sources differ from it (``git_dirty``)."""
    import subprocess
    from pathlib import Path

    import torch

    package = Path(__file__).resolve().parent
    info = {"normlab": __version__, "torch": torch.__version__}
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=package, capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", str(package)], cwd=package, capture_output=True, text=True, timeout=5
        )
        if commit.returncode == 0:
            info["git_commit"] = commit.stdout.strip()
            info["git_dirty"] = bool(dirty.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return info
