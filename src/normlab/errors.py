"""normlab's own errors: what the command line reports as one clear line (exit 2), because the user can fix it.

Any other exception (an out-of-memory error, a bug in a kernel) is not the user's input and keeps its traceback.
"""

from __future__ import annotations

import functools
import signal
import subprocess
import sys

__all__ = ["NormlabError", "check_cpu_bf16", "check_memory", "machine_memory"]


class NormlabError(RuntimeError):
    """A condition the user can act on: a locked folder, a checkpoint of another run, a missing download, a
    kernel choice this machine cannot run. ``ValueError``, ``TypeError`` and ``FileNotFoundError`` raised by
    normlab's own checks are reported the same way."""


def machine_memory() -> int:
    """This machine's physical memory in bytes (0 where the system does not say)."""
    import os

    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def check_memory(need: float, what: str, fix: str) -> None:
    """Refuse up front a job that would need more than 80% of this machine's memory: a ValueError with the size it
    needs, the machine's, and ``fix`` (the smaller value to use), instead of an out-of-memory kill later."""
    total = machine_memory()
    if total and need > 0.8 * total:
        raise ValueError(
            f"{what} needs about {need / 2**30:.1f} GiB, more than the {0.8 * total / 2**30:.1f} GiB (80%) of this "
            f"machine's {total / 2**30:.1f} GiB a job may take; {fix}"
        )


_BF16_PROBE = """
import torch
a = torch.randn(64, 64)
with torch.autocast("cpu", dtype=torch.bfloat16):
    (a @ a).sum().item()
"""


@functools.cache
def check_cpu_bf16(code: str = _BF16_PROBE, what: str = "amp=bf16", instead: str = "amp=none") -> None:
    """Run a bf16 matmul under CPU autocast in a child process, and raise a clear error if it dies.

    Some virtual machines advertise AMX but do not enable it: oneDNN then picks AMX kernels and the
    process dies with SIGILL (Illegal instruction), with no Python error. Capping oneDNN's instruction
    set with ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 avoids it. The child inherits this environment.
    """
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    if proc.returncode == -signal.SIGILL:
        raise NormlabError(
            f"{what} on this CPU dies with SIGILL (Illegal instruction): the CPU advertises "
            "instructions (AMX) the machine does not enable, as some virtual machines do. Set "
            f"ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 in the environment and rerun, or use {instead}"
        )
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise NormlabError(
            f"{what}: a bf16 matmul under CPU autocast fails on this machine "
            f"(exit {proc.returncode}: {tail}); use {instead}"
        )
