"""The stages of a long command (``normlab convert``, ``normlab export``): the seconds and the peak memory of each,
printed as it goes where asked, and the library warnings that do not concern the user kept out of the way."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sys
import time
import warnings
from pathlib import Path

__all__ = ["Stages", "library_noise", "peak_rss_gb", "stages_file", "earlier_stages", "count_every_process"]


def _reset_peak() -> bool:
    """Start the process's peak resident set size afresh (Linux: ``5`` to ``/proc/self/clear_refs``); False where
    it cannot be, so a peak reads since the process began."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_gb() -> float:
    """The process's peak resident set size in GB (1e9 bytes) since it began or since the last `_reset_peak`:
    ``VmHWM`` of /proc/self/status, or ``ru_maxrss`` where there is none."""
    try:
        with open("/proc/self/status") as f:
            return int(re.search(r"VmHWM:\s+(\d+)\s+kB", f.read()).group(1)) * 1e3 / 1e9
    except (OSError, AttributeError):
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KB on Linux, bytes on macOS
        return peak / (1e9 if sys.platform == "darwin" else 1e6)


class Stages:
    """Wall-clock seconds and peak memory of each stage, in the order they ran: ``with stages("load"): ...``. A
    stage entered twice (the measurement before and after a heal) adds up its seconds and keeps the larger peak.
    The peak is the process's resident set size at its highest during the stage (``peak_gb``, GB), where the system
    can restart the count (Linux); elsewhere it is the peak since the process began. With ``progress``, each
    stage's start, seconds and peak are printed on stderr, behind ``prefix``.

    Args:
        progress: Print each stage as it starts and ends.
        prefix: What the printed lines start with (``"export: "``).
    """

    def __init__(self, progress: bool = False, prefix: str = "") -> None:
        self.seconds: dict[str, float] = {}
        self.peak_gb: dict[str, float] = {}
        self.progress, self.prefix = progress, prefix

    def say(self, line: str) -> None:
        """Print ``line`` on stderr when printing."""
        if self.progress:
            print(f"{self.prefix}{line}", file=sys.stderr, flush=True)

    @contextlib.contextmanager
    def __call__(self, name: str):
        self.say(f"{name} ...")
        _reset_peak()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            took = time.perf_counter() - t0
            self.seconds[name] = round(self.seconds.get(name, 0.0) + took, 2)
            self.peak_gb[name] = round(max(self.peak_gb.get(name, 0.0), peak_rss_gb()), 2)
        self.say(f"{name}: {took:.1f} s, peak {self.peak_gb[name]:.1f} GB")

    def line(self) -> str:
        """Every stage's seconds and peak memory, and the total, in two lines."""
        total = sum(self.seconds.values())
        parts = ", ".join(f"{k} {v:.1f}" for k, v in self.seconds.items())
        peaks = ", ".join(f"{k} {v:.1f}" for k, v in self.peak_gb.items())
        head = f"stage seconds: {parts} (total {total:.1f} s, {total / 60:.1f} min)"
        return f"{head}\nstage peak memory (GB, resident): {peaks}"


class _NoTorchvision(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "torchvision" not in record.getMessage()


@contextlib.contextmanager
def library_noise():
    """torch.onnx's own deprecation warnings and its note that torchvision is absent (it registers torchvision's
    operators when it can) concern a library's internals, not the user: silenced while the block runs (torch.onnx's
    loggers to errors only; the warnings filtered)."""
    quiet = _NoTorchvision()
    handlers = logging.getLogger().handlers
    onnx_log = logging.getLogger("torch.onnx")
    level = onnx_log.level
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", message=".*torchvision.*")
        onnx_log.setLevel(logging.ERROR)
        for h in handlers:
            h.addFilter(quiet)
        try:
            yield
        finally:
            onnx_log.setLevel(level)
            for h in handlers:
                h.removeFilter(quiet)


def stages_file(ckpt: str) -> Path:
    """Where a heal's stage seconds are kept between its processes: beside its checkpoint.

    Args:
        ckpt: The heal checkpoint's path.
    """
    return Path(f"{ckpt}.stages.json")


def earlier_stages(ckpt: str | None, resume: bool, stages: Stages) -> dict:
    """The stage seconds of the processes before this one, for a heal resumed from its checkpoint (read from
    ``<checkpoint>.stages.json``; {} for a fresh heal); then that file is rewritten with them plus this process's
    stages so far, so that a process killed during the heal leaves its share for the next. The heal's own seconds
    over all processes are in its report (`count_every_process`).

    Args:
        ckpt: The heal checkpoint's path, or None (no checkpoint: nothing to count).
        resume: Whether this process resumes the heal.
        stages: This process's stages so far.
    """
    if ckpt is None:
        return {}
    where = stages_file(ckpt)
    earlier: dict = {}
    if resume and Path(ckpt).is_file():
        try:
            if where.is_file():
                earlier = {k: float(v) for k, v in json.loads(where.read_text()).get("stages", {}).items()}
            import torch  # the heal's seconds before this process, as its checkpoint's report counts them

            state = torch.load(ckpt, map_location="cpu", mmap=True, weights_only=False)
            earlier["heal"] = float(state["report"]["seconds"])
        except Exception as e:  # noqa: BLE001  (an unreadable record only loses the count; the heal checks its own)
            print(
                f"the earlier processes' stage seconds could not be read ({type(e).__name__}): this run's stages "
                "count only this process",
                file=sys.stderr,
            )
    mine = dict(stages.seconds)
    before = {k: v for k, v in earlier.items() if k != "heal"}  # the checkpoint holds the heal's own count
    upto = {k: round(before.get(k, 0.0) + mine.get(k, 0.0), 2) for k in {**before, **mine}}
    tmp = where.with_suffix(".tmp")
    try:
        tmp.write_text(json.dumps({"stages": upto, "processes": int(bool(earlier)) + 1}) + "\n")
        os.replace(tmp, where)
    except OSError:
        pass  # the checkpoint's own folder was checked writable: a failure here only loses the count
    return earlier


def count_every_process(stages: Stages, earlier: dict) -> None:
    """A resumed heal's stages as every process spent them: each stage's seconds plus the earlier processes', and
    the heal's from its checkpoint (this process's share alone made a resumed cell's minutes too small, issue 85).

    Args:
        stages: This process's stages, updated in place.
        earlier: What `earlier_stages` read.
    """
    for k, v in earlier.items():
        stages.seconds[k] = round(stages.seconds.get(k, 0.0) + v, 2)
