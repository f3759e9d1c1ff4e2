"""What a build of the CPU kernels compiles as and what its failure leaves: the C++ standard taken from the installed
torch, the compiler's first error, and the record (``failed.json`` beside the build) that keeps a failed build from
being retried in every process. `normlab.kernels.cpu_build` builds; this module is its account of a failure."""

from __future__ import annotations

import functools
import json
import os
import re
import time
from pathlib import Path

import torch

__all__ = ["BuildError", "FALLBACK_STD", "COMPILE_LOG", "FAILED", "cxx_std", "torch_std", "first_error", "std_advice",
           "record_failure", "recorded_failure"]  # fmt: skip


class BuildError(OSError):
    """A build that cannot happen here, with the fix that applies to its cause (not always a compiler).

    Args:
        message: What went wrong.
        advice: The fix that applies to its cause.
    """

    def __init__(self, message: str, advice: str) -> None:
        super().__init__(message)
        self.advice = advice


FALLBACK_STD = "c++17"  # what a torch whose extension builder names no standard compiles with (torch 2.4-2.9)


def cxx_std() -> str:
    """The C++ standard the installed torch builds its own C++ extensions with (``torch.utils.cpp_extension``
    passes it to the compiler, and its headers need it): "c++20" in torch 2.13 and later (2.14's headers no longer
    compile as C++17). Read from that module's source, where torch writes it, so that a new torch brings its own
    standard; `FALLBACK_STD` where it names none. ``NORMLAB_CXX_STD`` overrides it (e.g. "c++20")."""
    forced = os.environ.get("NORMLAB_CXX_STD")
    if forced:
        if not re.fullmatch(r"c\+\+\d\d", forced):
            raise BuildError(f"NORMLAB_CXX_STD={forced!r} is not a C++ standard", "set c++17 or c++20, or unset it")
        return forced
    return torch_std()


@functools.lru_cache(maxsize=1)
def torch_std() -> str:
    try:  # read, not imported: importing it costs setuptools, and this runs in every process's cache key
        text = (Path(torch.__file__).parent / "utils" / "cpp_extension.py").read_text()
    except OSError:  # a torch without its extension builder
        return FALLBACK_STD
    found = re.findall(r"-std=c\+\+(\d\d)\b", text)  # the Unix flags it passes, '-std=c++20'
    return f"c++{max(found, key=int)}" if found else FALLBACK_STD


COMPILE_LOG, FAILED = "compile.log", "failed.json"


def first_error(output: str) -> str:
    """The compiler's first error line, its torch header path shortened to the part under ``include/`` (the line a
    person would search for), else its last lines.

    Args:
        output: What the compiler printed.
    """
    lines = output.strip().splitlines()
    hit = next((line for line in lines if re.search(r"\berror\b", line)), None)
    if hit is None:
        return " | ".join(lines[-3:])[:500] or "no output"
    return re.sub(r"\S*/include/", "", hit.strip())[:500]


def std_advice(std: str) -> str:
    """The fix for a compile that failed as ``std``: unset an override that departs from torch's own standard, else a
    compiler that has that standard.

    Args:
        std: The standard the build compiled as.
    """
    own = torch_std()
    if std != own:
        return f"unset NORMLAB_CXX_STD={std}: torch {torch.__version__} builds its extensions as {own}"
    need = {"c++20": " (g++ >= 10 or clang++ >= 12)", "c++17": " (g++ >= 9 or clang++ >= 10)"}.get(std, "")
    return f"set CXX to a compiler that builds {std} against torch's headers{need}"


def record_failure(folder: Path, ident: dict, error: BuildError) -> None:
    """Write ``failed.json`` beside the build: the next process (and the detached build's parent) read it instead of
    compiling again. `normlab build-kernels` (``load(retry=True)``) removes it and tries once more.

    Args:
        folder: The build's cache folder.
        ident: The build's identity (`normlab.kernels.cpu_build`'s cache key inputs).
        error: The failure, with its advice.
    """
    rec = {**ident, "error": str(error), "advice": error.advice, "when": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    tmp = folder / f"{FAILED}.{os.getpid()}.tmp"
    try:
        tmp.write_text(json.dumps(rec, indent=1) + "\n")
        os.replace(tmp, folder / FAILED)
    except OSError:
        pass  # a folder we could build in but not write a record to: the next process tries again


def recorded_failure(folder: Path, ident: dict) -> BuildError | None:
    """The failed build recorded in ``folder`` for exactly these inputs (source, torch, compiler, CPU, standard),
    as the error it raised; None when there is none (or it was made from other inputs: they build afresh).

    Args:
        folder: The build's cache folder.
        ident: The build's identity.
    """
    try:
        rec = json.loads((folder / FAILED).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(rec, dict) or {k: rec.get(k) for k in ident} != ident:
        return None
    return BuildError(
        f"{rec.get('error')} (recorded {rec.get('when')}; not retried in every process)", str(rec.get("advice"))
    )
