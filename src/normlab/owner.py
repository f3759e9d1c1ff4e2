"""Owners for what normlab writes outside a training run: a lock that names its holder, and write checks.

A training run's folder has its own lock (`normlab.lab.runs.RunFolder`). A conversion's output and a
heal checkpoint are held here, under a lock file beside them (``.<name>.lock``): an OS advisory lock, so it dies
with its process and a killed job never leaves a stale owner. The lock file itself is left in place (removing
it would race with a second process opening it); it holds only the last holder's pid and command.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from normlab.errors import NormlabError

if TYPE_CHECKING:
    from torch import nn

__all__ = [
    "SAVE_MARGIN",
    "saved_bytes",
    "publish",
    "tokenizer_bytes",
    "check_out_space",
    "Locked",
    "hold",
    "take_lock",
    "check_folder",
    "check_writable",
    "inside",
    "path_segment_error",
    "replace_text",
    "beside",
    "swap_in",
    "restore_swapped",
]


class Locked(NormlabError):
    """Another live process owns the output."""


def take_lock(lock: Path, wait: bool = False) -> int | str:
    """Take the OS advisory lock on the file ``lock`` (made if absent) and write this process into it: the
    open descriptor (close it to release), or, when a live process holds it, that holder's line (``wait=True``:
    wait for it instead). On a system without ``fcntl`` (not POSIX) there is no lock: -1.

    Args:
        lock: The lock file.
        wait: Wait for a live holder instead of answering with its line.
    """
    try:
        import fcntl
    except ImportError:
        return -1
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except OSError:
        holder = os.read(fd, 4096).decode(errors="replace").strip() or "another process"
        os.close(fd)
        return holder
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}: {' '.join(sys.argv) or 'python'}".encode())
    except BaseException:  # a full disk: the caller's error, and no lock held by a descriptor nobody closes
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def hold(target: str | Path, what: str, wait: bool = False):
    """Own ``target`` (a file or folder, existing or not) for the duration: a second process is refused with the
    first one's pid and command, or with ``wait=True`` waits its turn (a table's append; a sample set that another
    process is drawing), saying on stderr whom it waits for. The lock file is ``.<name>.lock`` beside the target.

    Args:
        target: The file or folder owned.
        what: What the path is, as errors name it ("the output folder").
        wait: Wait for another owner instead of refusing.
    """
    target = Path(target)
    lock = target.parent / f".{target.name}.lock"
    check_writable(lock, what)
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = take_lock(lock)
    if isinstance(fd, str) and wait:  # say whom we wait for (a sample set can take minutes), then wait
        print(f"waiting for {what} {target}, held by {fd}", file=sys.stderr, flush=True)
        fd = take_lock(lock, wait=True)
    if isinstance(fd, str):
        raise Locked(f"{what} {target} is in use by a live process ({fd}); wait for it to end, or choose another path")
    try:
        yield
    finally:
        if fd >= 0:
            os.close(fd)  # closing the descriptor releases the lock


def replace_text(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` beside it first, then move it into place: a kill or a full disk part-way leaves the
    previous file whole (or none), never a truncated one. The partial file is removed on an error.

    Args:
        path: The file to write.
        text: Its new content.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def publish(moves: list[tuple[Path, Path]], partial: Path) -> None:
    """Move finished files (``(done, final)`` pairs, in order, the last the one that says the set is whole) to their
    final names, then remove the ``partial`` folder they were written in; a move that fails takes back the ones
    already moved, so the final names hold the whole set or none of it.

    Args:
        moves: (written file, its final name) pairs; a written file that is absent is skipped.
        partial: The folder they were written in.
    """
    moved = []
    try:
        for done, final in moves:
            if done.exists():
                os.replace(done, final)
                moved.append(final)
    except BaseException:
        for final in moved:
            final.unlink(missing_ok=True)
        raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def beside(folder: str | Path, role: str) -> Path:
    """The hidden path beside ``folder`` (or a file) where a save keeps its ``role`` ("partial": what is being
    written; "replaced": the folder it replaces, between `swap_in`'s two renames): ``.NAME.ROLE``.

    Args:
        folder: The output folder, or file.
        role: "partial" or "replaced".
    """
    folder = Path(folder)
    return folder.parent / f".{folder.name}.{role}"


def swap_in(partial: str | Path, out: str | Path) -> None:
    """Move the finished folder ``partial`` to ``out`` in two renames, the folder there before waiting at
    ``beside(out, "replaced")`` between them: a kill at any point leaves one whole folder that `restore_swapped`
    puts back, never a mix of the two.

    Args:
        partial: The folder written beside ``out``.
        out: Where it goes.
    """
    out, replaced = Path(out), beside(out, "replaced")
    if out.exists():
        os.replace(out, replaced)
    os.replace(partial, out)
    shutil.rmtree(replaced, ignore_errors=True)


def restore_swapped(out: str | Path) -> str | None:
    """Undo what a save killed part-way left beside ``out``, under the lock of ``out`` (`hold`): a folder killed
    between `swap_in`'s renames goes back to ``out``; a partial folder, or a replaced one whose successor is in
    place, is removed. Returns what was done, in a sentence, or None when there was nothing to do.

    Args:
        out: The output folder.
    """
    out, partial, replaced = Path(out), beside(out, "partial"), beside(out, "replaced")
    said = []
    if replaced.exists() and not out.exists():
        os.replace(replaced, out)
        said.append(f"restored {out} from {replaced.name}, where a save killed part-way had left it")
    elif replaced.exists():
        shutil.rmtree(replaced)
        said.append(f"removed {replaced.name}, left by a save killed after its new output was in place")
    if partial.exists():
        shutil.rmtree(partial)
        said.append(f"removed {partial.name}, a partial output that a killed save left")
    return "; ".join(said) or None


def check_writable(path: str | Path, what: str) -> None:
    """Raise, before any work, if ``path`` could not be written: its nearest existing ancestor must be a writable
    folder, and the path itself must not be a folder where a file is meant (or the reverse).

    Args:
        path: The file or folder to be written.
        what: What the path is, as errors name it ("the output folder").
    """
    path = Path(path)
    probe = path if path.exists() else next((p for p in path.parents if p.exists()), Path("."))
    folder = probe if probe.is_dir() else probe.parent
    if probe != path and not probe.is_dir():
        raise ValueError(f"{what} {path}: {probe} is a file, not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"{what} {path}: the folder {folder} is not writable; choose another path")


def check_folder(path: str | Path, what: str) -> None:
    """A folder normlab will write into: not an existing file, and writable (`check_writable`).

    Args:
        path: The folder.
        what: What the path is, as errors name it ("the output folder").
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{what} {path} is a file; give a folder (or a path that does not exist yet)")
    check_writable(path, what)


def inside(path: str | Path, *roots: str | Path | None) -> str | None:
    """The first of ``roots`` (files or folders) that ``path`` equals or lies within, else None. A root that does
    not exist yet (an output folder to be made) counts as a folder.

    Args:
        path: The path tested.
        *roots: Files or folders (None entries are skipped).
    """
    p = Path(path).resolve()
    for root in roots:
        if root is None:
            continue
        r = Path(root).resolve()
        if p == r or ((r.is_dir() or not r.exists()) and p.is_relative_to(r)):
            return str(root)
    return None


def path_segment_error(name: object) -> str | None:
    """Why ``name`` cannot be one path segment (a file or folder name inside a root), or None when it can: a
    non-empty string with no separator, not '.' or '..', so that a file named after it stays in its root.

    Args:
        name: The proposed name.
    """
    if not isinstance(name, str) or not name.strip():
        return f"must be one path segment (a non-empty string), got {name!r}"
    if "/" in name or "\\" in name or name.strip(".") == "" or "\0" in name:
        return f"must be one path segment (no '/' or '\\', not '.' or '..'), got {name!r}"
    return None


SAVE_MARGIN = 1.10  # the weights' bytes, plus the records (measured: under 5% on SmolLM2)
SMALL_FILES = 64 << 10  # the configs, the reports and the modeling file (a tiny Llama's conversion: 31 kB of them)


def tokenizer_bytes(tokenizer: object | None) -> int:
    """About what saving ``tokenizer`` writes: its ``tokenizer.json`` serialised in memory (a fast tokenizer), or
    64 bytes a vocabulary entry otherwise, plus 64 kB for its small files; 0 without one (an ONNX export).

    Args:
        tokenizer: A Hugging Face tokenizer, or None.
    """
    if tokenizer is None:
        return 0
    backend = getattr(tokenizer, "backend_tokenizer", None)
    try:
        size = len(backend.to_str()) if backend is not None else 64 * len(tokenizer)
    except Exception:  # noqa: BLE001  (a tokenizer that cannot say: counted by its vocabulary)
        size = 64 * int(getattr(tokenizer, "vocab_size", 0) or 0)
    return size + (64 << 10)


def saved_bytes(net: nn.Module, tokenizer: object | None = None) -> int:
    """About what `normlab.save_converted` writes for ``net``: its unique tensors' bytes at their own dtype (tied
    weights once), times `SAVE_MARGIN`, plus the tokenizer's files (`tokenizer_bytes`) and `SMALL_FILES`.

    Args:
        net: The model to be saved.
        tokenizer: The tokenizer saved with it, or None.
    """
    seen, total = set(), 0
    for t in list(net.parameters()) + list(net.buffers()):
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return int(total * SAVE_MARGIN) + tokenizer_bytes(tokenizer) + SMALL_FILES


def check_out_space(
    out: str | None,
    net: nn.Module,
    what: str = "--out",
    kind: str = "the conversion",
    tokenizer: object | None = None,
    extra: int = 0,
) -> None:
    """Refuse, before the work and again before the write, an output whose disk cannot hold the conversion: the
    save writes a new folder beside the old one and swaps them, so the old one's space is not counted.

    Args:
        out: The output folder, or None.
        net: The model that will be saved.
        what: How errors name the folder.
        kind: How errors name what is written.
        tokenizer: The tokenizer saved with it, or None (nothing written for it).
        extra: Bytes written beside the weights (an ONNX graph).
    """
    if out is None:
        return
    parent = Path(out).resolve().parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    need, free = saved_bytes(net, tokenizer) + extra, shutil.disk_usage(parent).free
    if free < need:
        raise NormlabError(
            f"{what} {out}: its disk has {free / 1e6:.1f} MB free, and {kind} needs about {need / 1e6:.1f} MB "
            "(written beside any old output, which is replaced only once the new one is whole); free some space, "
            f"or put {what} on another disk"
        )
