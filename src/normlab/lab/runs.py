"""The run folder: its files, how they are written and read, and the rules that keep one run whole.

A run folder holds:
    config.json      the resolved config
    version.json     normlab / torch versions and the git commit of the code
    metrics.jsonl    one JSON object per logged step (train/val loss, tokens/s, probes)
    summary.json     status (running, completed, diverged, interrupted), final losses, unigram entropy
    checkpoint.pt    model, optimizer, step and RNG state, written atomically (by the trainer)
    .lock            held by the live run: its pid and command

The rules (``RunFolder.begin``):
* one live run per folder: a second process is refused with the pid and command of the first;
* a fresh start in a folder that already holds a run is refused unless ``overwrite=True``;
* a resume continues at the checkpoint and drops the metrics written after it;
* a finished run is never rewritten by a resume (a completed one may be trained longer: more steps).

The trainer, the sweep, the report and the benchmarks read runs through this module.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from normlab.errors import NormlabError
from normlab.owner import inside, take_lock

__all__ = ["RunFolder", "RunLocked", "TERMINAL", "escape_step", "read_jsonl", "read_summary",
           "write_json"]  # fmt: skip

CONFIG, VERSION, METRICS, SUMMARY, CHECKPOINT, LOCK = (
    "config.json", "version.json", "metrics.jsonl", "summary.json", "checkpoint.pt", ".lock")  # fmt: skip
RUN_FILES = (CONFIG, VERSION, METRICS, SUMMARY, CHECKPOINT)
TERMINAL = ("completed", "diverged")  # a run in one of these states is finished


class RunLocked(NormlabError):
    """Another live process owns the run folder."""


def write_json(path: Path, obj: object) -> None:
    """Write to a temporary file, then rename: a kill never leaves half a JSON file.

    Args:
        path: The file.
        obj: What is written, as JSON.
    """
    tmp = path.with_suffix(path.suffix + ".tmp")
    try:
        tmp.write_text(json.dumps(obj, indent=2) + "\n")
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)  # a full disk leaves no half file behind
        raise


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSONL log; a line cut short by a kill mid-write is skipped, not fatal.

    Args:
        path: The log.
    """
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):  # a line that is JSON but not a record (junk) is skipped too
            rows.append(row)
    return rows


def read_summary(run_dir: str | Path) -> dict | None:
    """summary.json of a run, or None when it has none (or only a half-written one). A summary that is JSON
    but not an object was not written by normlab: a clear error naming the file.

    Args:
        run_dir: The run's folder.
    """
    p = Path(run_dir) / SUMMARY
    try:
        summary = json.loads(p.read_text()) if p.exists() else None
    except json.JSONDecodeError:
        return None
    if summary is not None and not isinstance(summary, dict):
        raise NormlabError(
            f"{p} is not a JSON object (a run summary); delete it, and the run resumes from its checkpoint"
        )
    return summary


ESCAPE_MARGIN = 0.1  # nats below the unigram entropy that count as having left the attractor


def escape_step(rows: list[dict], entropy: float | None) -> int | None:
    """The first evaluation step whose validation loss is ESCAPE_MARGIN below the unigram entropy (the
    embedding-only attractor of the dissection), or None if the run never got there.

    Args:
        rows: The run's metrics rows.
        entropy: The unigram entropy (nats); None: the answer is None.
    """
    if entropy is None:
        return None
    for r in rows:
        if r.get("val_loss") is not None and r["val_loss"] <= entropy - ESCAPE_MARGIN:
            return r["step"]
    return None


class RunFolder:
    """One run's folder. ``begin`` applies the rules; ``lock`` makes this process its only writer.

    Args:
        path: The run's folder.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock_fd: int | None = None

    def file(self, name: str) -> Path:
        return self.path / name

    @property
    def checkpoint(self) -> Path:
        return self.path / CHECKPOINT

    # ---- reading -----------------------------------------------------------------------------------------
    def summary(self) -> dict | None:
        return read_summary(self.path)

    def metrics(self) -> list[dict]:
        return read_jsonl(self.path / METRICS)

    def config(self) -> dict | None:
        p = self.path / CONFIG
        return json.loads(p.read_text()) if p.exists() else None

    def used(self) -> bool:
        """True when the folder already holds (part of) a run."""
        return any((self.path / f).exists() for f in RUN_FILES)

    def foreign(self) -> str | None:
        """The run-named files in the folder that normlab did not write (a model's config.json, say), or None.
        A run's identity is its version.json (written first, naming normlab) or any of its logs."""
        if not self.used():
            return None
        try:
            ours = "normlab" in json.loads((self.path / VERSION).read_text())
        except (OSError, ValueError, TypeError):
            ours = False
        if ours or any((self.path / f).exists() for f in (METRICS, SUMMARY, CHECKPOINT)):
            return None
        return ", ".join(f for f in RUN_FILES if (self.path / f).exists())

    def describe(self) -> str:
        s = self.summary() or {}
        status = s.get("status", "unfinished")
        if status == "running" and not self._held_elsewhere():
            status = "killed while running"
        steps = [r["step"] for r in self.metrics() if "step" in r]
        return f"{status}, metrics up to step {max(steps)}" if steps else status

    # ---- writing -----------------------------------------------------------------------------------------
    def create(self) -> None:
        """Make the folder, and check that it is writable, before any work is done."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            probe = self.path / ".write-test"
            probe.write_text("ok")
            probe.unlink()
        except OSError as e:
            reason = e.strerror or str(e)
            raise ValueError(
                f"out: run directory {str(self.path)!r} is not writable ({reason}); choose another --out"
            ) from None

    def write_json(self, name: str, obj) -> None:
        write_json(self.path / name, obj)

    def append_metrics(self, record: dict) -> None:
        with (self.path / METRICS).open("a") as f:
            f.write(json.dumps(record) + "\n")

    def truncate_metrics(self, step: int) -> None:
        """Drop the log lines written after ``step`` (the checkpoint a resume starts from); at step 0 all
        of them, the init's row included (a run that starts over logs it again)."""
        path = self.path / METRICS
        if path.exists():
            kept = "".join(json.dumps(r) + "\n" for r in read_jsonl(path) if step and r.get("step", 0) <= step)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(kept)
            os.replace(tmp, path)

    def clears(self, path: str | Path) -> str | None:
        """The name of the run file (or ``tb/``) that ``path`` is or lies in, which `clear` removes; else None."""
        names = (*RUN_FILES, CHECKPOINT.replace(".pt", ".tmp"), "tb")
        hit = inside(path, *(self.path / n for n in names))
        return None if hit is None else Path(hit).name

    def clear(self) -> None:
        """Remove the run's files (and nothing else the user keeps in the folder)."""
        for name in (*RUN_FILES, CHECKPOINT.replace(".pt", ".tmp")):
            (self.path / name).unlink(missing_ok=True)
        tb = self.path / "tb"
        if tb.is_dir():
            import shutil

            shutil.rmtree(tb)

    # ---- the rules ---------------------------------------------------------------------------------------
    def begin(self, *, resume: bool, overwrite: bool, steps: int) -> bool:
        """Apply the rules for a run about to start; True when it continues from the checkpoint.

        Must be called with the lock held. Raises ValueError, before any work, when the rules refuse.
        """
        if resume and overwrite:
            raise ValueError("--resume and --overwrite contradict each other: pick one")
        where = str(self.path)
        foreign = self.foreign()
        if foreign:
            raise ValueError(
                f"out: {where} is not a normlab run folder: it holds {foreign}, which normlab did not "
                "write; nothing there is touched, whatever the flags. Choose another --out"
            )
        if not resume:
            if self.used():
                if not overwrite:
                    raise ValueError(
                        f"out: {where} already holds a run ({self.describe()}); pass --resume to "
                        "continue it, --overwrite to start it over, or choose another --out"
                    )
                self.clear()
            return False
        if not self.used():
            raise ValueError(f"out: nothing to resume in {where} (no run there); drop --resume to start one")
        done = self.summary() or {}
        status, steps_done = done.get("status"), done.get("steps_done") or 0
        if status == "diverged" or (status == "completed" and steps <= steps_done):
            raise ValueError(
                f"out: the run in {where} is already {status} at step {steps_done}; its results are "
                "kept. To train a completed run longer, resume it with --set steps=N for a larger N"
            )
        if not self.checkpoint.exists():  # killed before its first checkpoint: resume means from step 0
            self.truncate_metrics(0)
            return False
        return True  # the caller reads the step from the checkpoint, then calls truncate_metrics(step)

    # ---- one live run per folder -------------------------------------------------------------------------
    def _held_elsewhere(self) -> bool:
        """Whether a live process holds this folder's lock now."""
        try:
            import fcntl
        except ImportError:
            return True
        path = self.path / LOCK
        if not path.exists() or self._lock_fd is not None:  # no lock file, or we hold it
            return False
        fd = os.open(path, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
            return False
        except OSError:
            return True
        finally:
            os.close(fd)

    def lock(self) -> RunFolder:
        """Take the folder's lock, or raise RunLocked naming the process that holds it.

        An OS advisory lock (flock): it dies with its process, so a killed run never leaves a stale lock.
        """
        fd = take_lock(self.path / LOCK)  # not on POSIX: no lock (-1), the other rules still hold
        if isinstance(fd, str):
            raise RunLocked(
                f"out: {self.path} is in use by a live run ({fd}); wait for it to end, or choose another --out"
            )
        self._lock_fd = fd if fd >= 0 else None
        return self

    def unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the descriptor releases the flock
            self._lock_fd = None

    def __enter__(self) -> RunFolder:
        return self.lock()

    def __exit__(self, *exc) -> None:
        self.unlock()
