"""The stages of a long command (``normlab convert``, ``normlab export``): the seconds of each, printed as it goes
where asked, and the library warnings that do not concern the user kept out of the way."""

from __future__ import annotations

import contextlib
import logging
import sys
import time
import warnings

__all__ = ["Stages", "library_noise"]


class Stages:
    """Wall-clock seconds of each stage, in the order they ran: ``with stages("load"): ...``. A stage entered twice
    (the measurement before and after a heal) adds up. With ``progress``, each stage's start and seconds are printed
    on stderr, behind ``prefix``.

    Args:
        progress: Print each stage as it starts and ends.
        prefix: What the printed lines start with (``"export: "``).
    """

    def __init__(self, progress: bool = False, prefix: str = "") -> None:
        self.seconds: dict[str, float] = {}
        self.progress, self.prefix = progress, prefix

    def say(self, line: str) -> None:
        """Print ``line`` on stderr when printing."""
        if self.progress:
            print(f"{self.prefix}{line}", file=sys.stderr, flush=True)

    @contextlib.contextmanager
    def __call__(self, name: str):
        self.say(f"{name} ...")
        t0 = time.perf_counter()
        try:
            yield
        finally:
            took = time.perf_counter() - t0
            self.seconds[name] = round(self.seconds.get(name, 0.0) + took, 2)
        self.say(f"{name}: {took:.1f} s")

    def line(self) -> str:
        """Every stage's seconds and the total, in one line."""
        total = sum(self.seconds.values())
        parts = ", ".join(f"{k} {v:.1f}" for k, v in self.seconds.items())
        return f"stage seconds: {parts} (total {total:.1f} s, {total / 60:.1f} min)"


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
