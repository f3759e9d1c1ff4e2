"""Build the CPU kernels (``csrc/cpu_norms.cpp``) once per machine and load them in milliseconds.

The build is one call of the C++ compiler (``$CXX``, else ``c++``) against PyTorch's headers and
libraries, with the vector instruction set PyTorch picks for this CPU. Its product lives in the cache
folder (``$NORMLAB_CACHE``, else ``~/.cache/normlab``) under ``kernels/cpu-<key>/``, where the key hashes
the source, the torch version, the compiler's version and the flags: a new torch, compiler or source
builds afresh; nothing stale is ever loaded. Beside the library, ``build.json`` records what made it and
the library's size and SHA-256, checked before every load (a corrupt or truncated file is rebuilt, with
a message). Builds take a file lock, so that parallel workers build once and the others wait.

``load(wait=False)`` never blocks: with no build yet it starts one in a process of its own session, which finishes
even when the process that started it ends first, and returns False (the caller uses the reference math meanwhile; a
background thread loads the library once the build is done). ``load(wait=True)`` builds in the foreground if needed
(``normlab build-kernels``, ``kernel="cpu"``, and long jobs such as ``train``, which should use one path from their
first step). A machine without a working compiler gets one warning and False."""

from __future__ import annotations

import fcntl
import hashlib
import importlib.resources
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import torch

from normlab.corpus import cache_dir, sha256_file
from normlab.errors import NormlabError
from normlab.kernels.build_errors import (
    COMPILE_LOG,
    FAILED,
    BuildError,
    cxx_std,
    first_error,
    record_failure,
    recorded_failure,
    std_advice,
)

__all__ = ["load", "loaded", "failure", "build_dir", "library_folder", "compile_command", "source_path", "use_library",
           "status", "BuildError", "cxx_std", "first_error", "recorded_failure"]  # fmt: skip

_LOCK = threading.Lock()
_STATE: dict = {"loaded": False, "failure": None, "thread": None, "advice": None}


NO_COMPILER = "install a C++ compiler (Debian: apt-get install g++), or set CXX to one"


def source_path() -> Path:
    """The kernels' C++ source, as installed."""
    return Path(str(importlib.resources.files("normlab.kernels").joinpath("csrc/cpu_norms.cpp")))


def _source() -> bytes:
    return source_path().read_bytes()


def source_key() -> str:
    """The kernels' C++ source, hashed (16 hex digits): their ops and schemas change with it."""
    return hashlib.sha256(_source()).hexdigest()[:16]


def _compiler() -> str:
    return os.environ.get("CXX") or "c++"


def _isa() -> tuple[list[str], list[str]]:
    """(compiler flags, macros) of the vector instruction set PyTorch's own CPU code generator picks here
    (about 2.5 s to import and probe, so only at build time)."""
    try:
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        isa = pick_vec_isa()
        if isa:
            return isa.build_arch_flags().split(), list(isa.build_macro())
    except Exception:  # noqa: BLE001  (a private module: without it, ATen's portable vectors)
        pass
    return [], []


def _bf16_flags(macros: list[str]) -> list[str]:
    """``-mavx512bf16`` where PyTorch picked AVX-512 and the CPU has AVX512_BF16: bfloat16 results are then stored
    with one conversion instruction (vcvtneps2bf16) instead of ATen's integer rounding sequence. A compiler that
    does not know the flag builds without it (`_compile`)."""
    cpu = _cpuinfo_flags().split()
    return ["-mavx512bf16"] if "CPU_CAPABILITY_AVX512" in macros and "avx512_bf16" in cpu else []


def _torch_paths() -> tuple[Path, Path]:
    """(include folder, library folder) of the installed torch."""
    root = Path(torch.__file__).parent
    return root / "include", root / "lib"


def _flags() -> list[str]:
    arch, macros = _isa()
    include, lib = _torch_paths()
    return [
        "-O3",
        f"-std={cxx_std()}",
        "-shared",
        "-fPIC",
        "-fopenmp",
        "-w",
        "-ffp-contract=off",  # only the written fused multiply-adds: f recomputed in the backward equals the forward's
        *arch,
        *_bf16_flags(macros),
        *(f"-D{m}" for m in macros),
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        f"-I{include}",
        f"-I{include / 'torch/csrc/api/include'}",
        f"-L{lib}",
        "-lc10",
        "-ltorch_cpu",
        f"-Wl,-rpath,{lib}",
    ]


def _compiler_version(cxx: str) -> str:
    """The compiler's first line of ``--version``; a BuildError when ``cxx`` does not run as a compiler."""
    fix = f"CXX={cxx} does not run as a C++ compiler: set CXX to one (g++, clang++), or unset it for c++"
    try:
        proc = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60)
    except OSError as e:
        raise BuildError(f"`{cxx} --version` cannot run ({e})", fix) from None
    if proc.returncode != 0:
        raise BuildError(f"`{cxx} --version` failed: {(proc.stderr or proc.stdout).strip()[:200]}", fix)
    return proc.stdout.splitlines()[0] if proc.stdout else ""


def _cpuinfo_flags() -> str:
    """The CPU's feature-flags line from /proc/cpuinfo ("" where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        return next((line for line in text.splitlines() if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def cpu_key() -> str:
    """A hash of the CPU's feature flags and of ``$ATEN_CPU_CAPABILITY`` (which caps the vector instruction set
    PyTorch picks): a cache folder shared by two kinds of machine, or by two settings of the variable, keeps one
    build each."""
    import platform

    text = f"{platform.machine()} {_cpuinfo_flags()}"
    if os.environ.get("ATEN_CPU_CAPABILITY"):  # unset: the key it always had, so no build is redone for nothing
        text += f" ATEN_CPU_CAPABILITY={os.environ['ATEN_CPU_CAPABILITY']}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _identity(cxx: str) -> dict:
    """What a build depends on, cheap to compute (milliseconds): the key of its cache folder."""
    ident = {"source_sha256": hashlib.sha256(_source()).hexdigest(), "torch": torch.__version__, "compiler": cxx,
             "compiler_version": _compiler_version(cxx), "cpu": cpu_key(), "std": cxx_std()}  # fmt: skip
    ident["key"] = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
    return ident


def build_dir(ident: dict) -> Path:
    """The cache folder of one build: ``<cache>/kernels/cpu-<key>``, the key naming the source, the compiler, its
    version, torch and the CPU.

    Args:
        ident: The build's identity (its ``key``).
    """

    try:
        root = cache_dir()
    except NormlabError as e:  # NORMLAB_CACHE names a file
        raise BuildError(str(e), "point NORMLAB_CACHE at a folder, or unset it for ~/.cache/normlab") from None
    return root / "kernels" / f"cpu-{ident['key']}"


def _intact(folder: Path, ident: dict) -> str | None:
    """None if folder holds the library ``ident`` describes, size and SHA-256 as recorded; else why not."""
    so, manifest = folder / "normlab_cpu.so", folder / "build.json"
    if not manifest.is_file() and not so.exists():
        return "absent"
    try:
        rec = json.loads(manifest.read_text())
        if {k: rec.get(k) for k in ident} != ident:
            return "built from other inputs"
        if so.stat().st_size != rec["size"] or sha256_file(so) != rec["sha256"]:
            return "its size or SHA-256 differs from the record (a corrupt or truncated file)"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"unreadable ({type(e).__name__}: {e})"
    return None


def _compile(folder: Path, ident: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f"normlab_cpu.{os.getpid()}.{threading.get_ident()}.tmp.so"
    src = folder / "cpu_norms.cpp"
    src.write_bytes(_source())
    t0 = time.perf_counter()
    flags = _flags()
    proc = subprocess.run([ident["compiler"], str(src), "-o", str(tmp), *flags], capture_output=True, text=True)
    if proc.returncode != 0 and "-mavx512bf16" in flags:  # an older compiler: ATen's conversion instead
        flags = [f for f in flags if f != "-mavx512bf16"]
        proc = subprocess.run([ident["compiler"], str(src), "-o", str(tmp), *flags], capture_output=True, text=True)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        output = proc.stderr or proc.stdout
        command = " ".join([ident["compiler"], str(src), "-o", str(tmp), *flags])
        (folder / COMPILE_LOG).write_text(f"$ {command}\n{output}")
        error = BuildError(
            f"the compiler `{ident['compiler']}` failed on the kernels as {ident['std']} against torch "
            f"{ident['torch']}: {first_error(output)}",
            f"{std_advice(ident['std'])}, then run `normlab build-kernels` to retry; the whole output is in "
            f"{folder / COMPILE_LOG}",
        )
        record_failure(folder, ident, error)
        raise error
    if not tmp.is_file():
        raise BuildError(
            f"`{ident['compiler']}` exited 0 but wrote no library",
            f"CXX={ident['compiler']} is not a C++ compiler: set CXX to one (g++, clang++)",
        )
    rec = {**ident, "flags": flags, "size": tmp.stat().st_size, "sha256": sha256_file(tmp),
           "seconds": round(time.perf_counter() - t0, 1), "built": time.strftime("%Y-%m-%dT%H:%M:%S%z")}  # fmt: skip
    os.replace(tmp, folder / "normlab_cpu.so")
    (folder / FAILED).unlink(missing_ok=True)
    manifest_tmp = folder / f"build.json.{os.getpid()}.tmp"
    manifest_tmp.write_text(json.dumps(rec, indent=1) + "\n")
    os.replace(manifest_tmp, folder / "build.json")


# instruction sets a build can be forced to, to test the code paths this machine would not take by itself
ISA_FLAGS = {"avx2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2"], "default": []}


def compile_command(src: Path, out: Path, isa: str | None = None) -> list[str]:
    """The command that builds ``src`` into ``out`` as this machine's build does: the compiler and its flags (for
    scripts that build another version of the source to compare, ``scripts/bench_kernel_builds.py``). ``isa``
    ("avx2", "default": ATen's portable vectors) replaces the machine's instruction set, for tests.

    Args:
        src: The C++ source.
        out: The shared library written.
        isa: An instruction set in place of the machine's ("avx2", "default"), or None.
    """
    flags = _flags()
    if isa is not None:
        if isa not in ISA_FLAGS:
            raise ValueError(f"isa must be one of {sorted(ISA_FLAGS)}, got {isa!r}")
        arch, _ = _isa()
        drop = {*arch, "-mavx512bf16"}
        flags = [f for f in flags if f not in drop and not f.startswith("-DCPU_CAPABILITY")] + ISA_FLAGS[isa]
    return [_compiler(), str(src), "-o", str(out), *flags]


def library_folder() -> Path:
    """The cache folder of this machine's build of the current source (built or not)."""
    return build_dir(_identity(_compiler()))


def _built_here_without_compiler() -> Path | None:
    """A library built on this machine for this source, torch and CPU, whatever compiler made it: usable when the
    compiler has since gone (the cache key needs `$CXX --version`, which can no longer run)."""
    want = {"source_sha256": hashlib.sha256(_source()).hexdigest(), "torch": torch.__version__, "cpu": cpu_key()}
    try:
        root = cache_dir()
    except NormlabError:
        return None
    for manifest in sorted((root / "kernels").glob("cpu-*/build.json")):
        try:
            rec = json.loads(manifest.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(rec, dict) and {k: rec.get(k) for k in want} == want:
            ident = {k: rec.get(k) for k in ("source_sha256", "torch", "compiler", "compiler_version", "cpu", "key")}
            if _intact(manifest.parent, ident) is None:
                return manifest.parent
    return None


def _writable_folder(folder: Path) -> None:
    """The cache folder exists and can be written, or a BuildError that names it and the fix (not a compiler)."""
    fix = "set NORMLAB_CACHE to a folder you can write (or fix the permissions of this one)"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BuildError(f"the kernel cache folder {folder} cannot be made ({e.strerror or e})", fix) from None
    if not os.access(folder, os.W_OK):
        raise BuildError(f"the kernel cache folder {folder} is not writable", fix)


def _build_and_load(retry: bool = False) -> None:
    """Find or build the library, then load it into torch.ops.normlab_cpu. Raises OSError on failure; a failure
    recorded for the same inputs is raised again without compiling, unless ``retry``."""
    cxx = _compiler()
    if shutil.which(cxx) is None and not Path(cxx).is_file():
        found = _built_here_without_compiler()
        if found is None:
            raise BuildError(f"no C++ compiler `{cxx}` on this machine", NO_COMPILER)
        torch.ops.load_library(str(found / "normlab_cpu.so"))
        _STATE["folder"] = found
        return
    ident = _identity(cxx)
    folder = build_dir(ident)
    _sweep(folder)
    if _intact(folder, ident) is not None:
        _writable_folder(folder)
        with open(folder / "build.lock", "w") as lock:
            _wait_for(lock, folder)  # parallel workers: one builds, the others wait and load
            why = _intact(folder, ident)
            if why is not None:
                failed = None if retry else recorded_failure(folder, ident)
                if failed is not None:
                    raise failed
                _announce(folder, why)
                _compile(folder, ident)
    torch.ops.load_library(str(folder / "normlab_cpu.so"))
    _STATE["folder"] = folder


def _sweep(folder: Path) -> None:
    """Remove what a killed build left in ``folder``: a ``.tmp`` library or record whose name's process id is no
    longer running (a live build's are left to it)."""
    for tmp in folder.glob("*.tmp*"):
        pid = next((int(part) for part in tmp.name.split(".") if part.isdigit()), None)
        if pid is None:
            continue  # not one of ours
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            tmp.unlink(missing_ok=True)
        except PermissionError:
            pass  # another user's running process


def _wait_for(lock, folder: Path) -> None:
    """Take the build lock; when another process holds it (building), say so on stderr before waiting."""
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print(
            f"normlab: another process is building the CPU kernels into {folder}; waiting for it (one C++ compile, "
            "about 20-40 s)",
            file=sys.stderr,
            flush=True,
        )
        fcntl.flock(lock, fcntl.LOCK_EX)


def _announce(folder: Path, why: str) -> None:
    """Say on stderr that a build starts, and why (a cached library that is damaged is named)."""
    if why != "absent":
        print(f"normlab: the cached CPU kernels in {folder} are {why}; rebuilding", file=sys.stderr)
    print(
        f"normlab: building the CPU kernels for this machine, once (one C++ compile, about 20-40 s) into {folder}",
        file=sys.stderr,
        flush=True,
    )


def _build_detached() -> None:
    """Compile in a process of its own session, and wait for it: the build outlives this process, so a short
    script that ends before the compile does leaves a finished library for the next one (the build would
    otherwise die with it, and every short process would start over). Its output goes to ``build.log``
    beside the library; the library and ``build.json`` appear atomically when it is done."""
    cxx = _compiler()
    if shutil.which(cxx) is None and not Path(cxx).is_file():
        return  # _build_and_load finds a library built earlier, or says there is no compiler
    ident = _identity(cxx)
    folder = build_dir(ident)
    why = _intact(folder, ident)
    if why is None or recorded_failure(folder, ident) is not None:
        return  # built, or failed before: _build_and_load loads it, or raises the recorded error at once
    _writable_folder(folder)
    _announce(folder, why)  # here, where the user sees it; the build's own output goes to build.log
    with open(folder / "build.log", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "normlab.kernels.cpu_build"],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    proc.wait()


def _attempt(detached: bool = False, retry: bool = False) -> None:
    try:
        if detached:
            _build_detached()
        _build_and_load(retry)
    except Exception as e:  # noqa: BLE001  (a missing compiler, a failed compile, an unloadable library)
        _STATE["failure"] = f"{type(e).__name__}: {e}"
        _STATE["advice"] = getattr(e, "advice", None) or (
            "set NORMLAB_CACHE to a folder you can write" if isinstance(e, PermissionError) else NO_COMPILER
        )
        return
    _STATE["loaded"] = True


def load(wait: bool = True, retry: bool = False) -> bool:
    """Whether the kernels are loaded; build or load them first (in the background when ``wait`` is False). A build
    that failed for the same source, torch, compiler and CPU is not tried again in every process: its recorded error
    is raised at once (and warned once), unless ``retry``.

    Args:
        wait: Block until the build is done (else build in the background and return False meanwhile).
        retry: Compile again even where a failure is recorded (`normlab build-kernels`).
    """
    if _STATE["loaded"] or _STATE["failure"]:
        return _STATE["loaded"]
    with _LOCK:
        if _STATE["loaded"] or _STATE["failure"]:
            return _STATE["loaded"]
        thread = _STATE["thread"]
        if thread is None:
            thread = threading.Thread(target=_attempt, args=(not wait, retry), name="normlab-cpu-build", daemon=True)
            _STATE["thread"] = thread
            thread.start()
    if wait:
        thread.join()
    elif thread.is_alive():
        thread.join(timeout=0.05)  # a warm cache loads in milliseconds: take it now
    if _STATE["failure"] and not _STATE.get("warned"):
        _STATE["warned"] = True
        warnings.warn(
            f"normlab: the fused CPU kernels cannot be built on this machine ({_STATE['failure'][:700]}); "
            f"every norm falls back to the reference math (5-25x slower). To fix: {_STATE['advice']}; or pass "
            "kernel='reference' "
            "(NORMLAB_KERNEL=reference) to silence this.",
            RuntimeWarning,
            stacklevel=3,
        )
    return _STATE["loaded"]


def use_library(path: str | Path) -> None:
    """Load a library built elsewhere (another instruction set's build, `compile_command`) in place of this machine's:
    for tests of the code paths this machine would not take. Call it before anything loads the kernels.

    Args:
        path: The built shared library.
    """
    if _STATE["loaded"]:
        raise RuntimeError("normlab's CPU kernels are already loaded in this process")
    torch.ops.load_library(str(path))
    _STATE["loaded"] = True


def loaded() -> bool:
    return _STATE["loaded"]


def failure() -> str | None:
    """Why the kernels could not be built or loaded, and the fix that applies; None when they were."""
    if _STATE["failure"] is None:
        return None
    return f"{_STATE['failure']}; to fix: {_STATE['advice']}"


def status() -> dict:
    """What ``normlab build-kernels`` prints: the folder of the library loaded (else of this machine's build) and
    its record. A library loaded while $CXX cannot run (built earlier by another compiler) is described from its
    own record, without asking the compiler."""
    folder = _STATE.get("folder")
    if folder is None:
        ident = _identity(_compiler())
        folder = build_dir(ident)
        intact = _intact(folder, ident) is None
    else:
        intact = True
    manifest = Path(folder) / "build.json"
    return {
        "folder": str(folder),
        "intact": intact,
        "record": json.loads(manifest.read_text()) if manifest.is_file() else None,
    }


if __name__ == "__main__":  # the detached build of `load(wait=False)`: compile (under the build lock) and exit
    _build_and_load()
