"""normlab's own errors: what the command line reports as one clear line (exit 2), because the user can fix it.

Any other exception (an out-of-memory error, a bug in a kernel) is not the user's input and keeps its traceback.
"""

from __future__ import annotations

__all__ = ["NormlabError"]


class NormlabError(RuntimeError):
    """A condition the user can act on: a locked folder, a checkpoint of another run, a missing download, a
    kernel choice this machine cannot run. ``ValueError``, ``TypeError`` and ``FileNotFoundError`` raised by
    normlab's own checks are reported the same way."""
