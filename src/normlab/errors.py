"""normlab's own errors: what the command line reports as one clear line (exit 2), because the user can fix it.

Any other exception (an out-of-memory error, a bug in a kernel) is not the user's input and keeps its traceback.
"""

from __future__ import annotations

__all__ = ["NormlabError", "check_memory", "machine_memory"]


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
            f"{what} needs about {need / 2**30:.1f} GiB, more than this machine's {total / 2**30:.0f} GiB "
            f"can give; {fix}"
        )
