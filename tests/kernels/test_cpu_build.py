"""Building the C++ CPU kernels: the cache folder, the compiler, and a library built earlier."""

from __future__ import annotations

from pathlib import Path

import pytest


def _build_in_child(env: dict) -> str:
    """Build and load the CPU kernels in a fresh process with ``env``; what it printed (the warning included)."""
    import os
    import subprocess
    import sys

    code = (
        "import warnings; warnings.simplefilter('always')\n"
        "from normlab.kernels import cpu_build\n"
        "ok = cpu_build.load(wait=True)\nprint('LOADED' if ok else 'FAILED', cpu_build.failure())"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True, timeout=300
    )
    return proc.stdout + proc.stderr


def test_a_cache_that_cannot_be_written_says_so_not_install_a_compiler():
    out = _build_in_child({"NORMLAB_CACHE": "/proc/normlab-cache"})  # /proc: no folder can be made there
    assert "FAILED" in out and "/proc/normlab-cache" in out and "set NORMLAB_CACHE to a folder you can write" in out
    assert "install a C++ compiler" not in out


def test_a_cache_naming_a_file_says_so(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    out = _build_in_child({"NORMLAB_CACHE": str(f)})
    assert "FAILED" in out and "is a file, not a folder" in out and "install a C++ compiler" not in out


def test_an_empty_cache_variable_is_unset(monkeypatch):
    from normlab.corpus import cache_dir

    monkeypatch.setenv("NORMLAB_CACHE", "")
    assert cache_dir() == Path.home() / ".cache" / "normlab"


@pytest.mark.parametrize("cxx", ["/bin/false", "/bin/echo"])
def test_a_cxx_that_is_not_a_compiler_is_named(tmp_path, cxx):
    out = _build_in_child({"CXX": cxx, "NORMLAB_CACHE": str(tmp_path / "cache")})
    assert "FAILED" in out and f"CXX={cxx}" in out and "Traceback" not in out


@pytest.mark.slow
def test_a_library_built_here_loads_after_the_compiler_is_gone(tmp_path):
    """The cache key needs `$CXX --version`; with the compiler gone, a library this machine built for this source,
    torch and CPU is still found and loaded (it was ignored, and every norm fell back to the reference)."""
    import shutil

    from normlab.kernels import cpu, cpu_build

    assert cpu.ready(wait=True)  # this machine's build, with the compiler (make's setup built it), copied to a cache
    cache = tmp_path / "cache"
    shutil.copytree(cpu_build.library_folder(), cache / "kernels" / cpu_build.library_folder().name)
    out = _build_in_child({"NORMLAB_CACHE": str(cache), "CXX": str(tmp_path / "gone-c++")})
    assert "LOADED" in out, out
    # issue 50: `normlab build-kernels` loaded it, then crashed asking the missing compiler for the folder's key
    import os
    import subprocess
    import sys

    env = {**os.environ, "NORMLAB_CACHE": str(cache), "CXX": str(tmp_path / "gone-c++")}
    cli = subprocess.run([sys.executable, "-m", "normlab.cli", "build-kernels"], env=env, capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert cli.returncode == 0 and "normlab CPU kernels ready" in cli.stdout, cli.stderr[-2000:]
    assert str(cache) in cli.stdout and "Traceback" not in cli.stderr


@pytest.mark.slow
@pytest.mark.parametrize("isa", ["avx2", "default"])
def test_another_instruction_set_builds_and_passes_the_kernel_checks(tmp_path, isa):
    """The kernels have one branch per instruction set (AVX-512, AVX2, ATen's portable vectors); a machine builds and
    tests only its own. This builds the AVX2 branch and the portable one here (AVX2 when the CPU can run it) and runs
    test_cpu_edges.py (each approximation's bound, the edges, the saved-f backward) against each in a fresh process.
    (An AVX2 build once gave the backward's recomputed tanh other bits than the forward's: the compiler fused
    multiply-adds differently per call site; the portable build gave ELN f = 1 instead of 0 on a row of equal huge
    values: ATen's portable lane sum is sequential.)"""
    import shutil
    import subprocess
    import sys

    from normlab.kernels import cpu_build

    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if isa == "avx2" and not all(f in flags.split() for f in ("avx2", "fma", "f16c")):
        pytest.skip("this CPU cannot run an AVX2 build")
    if isa == "avx2" and "CPU_CAPABILITY_AVX2" in cpu_build._isa()[1]:
        pytest.skip("the machine's own build is the AVX2 one, and test_cpu_edges.py runs against it in this suite")
    cmd = cpu_build.compile_command(cpu_build.source_path(), tmp_path / "isa.so", isa=isa)
    if shutil.which(cmd[0]) is None:
        pytest.skip("no C++ compiler")
    subprocess.run(cmd, check=True, capture_output=True)
    runner = (
        "import sys, pytest\n"
        "from normlab.kernels import cpu_build\n"
        "cpu_build.use_library(sys.argv[1])  # this build instead of the machine's\n"
        "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', sys.argv[2]]))\n"
    )
    test_file = str(Path(__file__).with_name("test_cpu_edges.py"))
    proc = subprocess.run([sys.executable, "-c", runner, str(tmp_path / "isa.so"), test_file],
                          capture_output=True, text=True, cwd=Path(__file__).parent)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout


@pytest.mark.slow
def test_a_build_started_by_a_short_process_finishes_for_the_next(tmp_path):
    """A script that ends before the ~25 s compile does leaves a finished build: the next process runs fused
    (the build used to be a thread of the first process, and died with it)."""
    import os
    import subprocess
    import sys
    import time

    cache = tmp_path / "cache"
    env = {**os.environ, "NORMLAB_CACHE": str(cache)}
    env.pop("NORMLAB_KERNEL", None)
    code = (
        "import torch, normlab\nfrom normlab.kernels import cpu_build\n"
        "with torch.no_grad():\n    normlab.DyT(64)(torch.randn(256, 64))\n"
        "print('FUSED' if cpu_build.loaded() else 'REFERENCE')"
    )

    def run() -> str:
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stdout.strip()

    assert run() == "REFERENCE"  # the build has only started when the first script ends
    deadline = time.time() + 300
    while not list(cache.glob("kernels/cpu-*/build.json")) and time.time() < deadline:
        time.sleep(1)
    assert list(cache.glob("kernels/cpu-*/build.json")), "the build did not outlive the process that started it"
    assert run() == "FUSED"


def test_a_second_build_says_it_waits_for_the_first(tmp_path, monkeypatch):
    """issue 65: a second `build-kernels` while another process held the build lock waited 53 s without a word.
    Here the test holds the lock of an empty cache's build; the child says whom it waits for before it blocks."""
    import fcntl
    import os
    import subprocess
    import sys
    import time

    from normlab.kernels import cpu_build

    monkeypatch.setenv("NORMLAB_CACHE", str(tmp_path))
    folder = cpu_build.build_dir(cpu_build._identity(cpu_build._compiler()))
    folder.mkdir(parents=True)
    code = "from normlab.kernels import cpu_build\ncpu_build.load(wait=True)"
    with open(folder / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        env = {**os.environ, "NORMLAB_CACHE": str(tmp_path)}
        child = subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE, text=True)
        try:
            deadline, said = time.time() + 120, ""
            while "waiting for it" not in said and time.time() < deadline and child.poll() is None:
                said += child.stderr.readline()
            assert "another process is building the CPU kernels" in said and str(folder) in said, said
            assert child.poll() is None  # still waiting: the lock is the test's
        finally:
            child.kill()
            child.wait()


def test_the_build_takes_its_cxx_standard_from_torch():
    """torch 2.14's headers need C++20 (`std::strong_ordering`); a build that hard-coded -std=c++17 failed on every
    current torch. The standard is what torch.utils.cpp_extension passes (c++20 from the pinned 2.13 on)."""
    import torch

    from normlab.kernels import cpu_build

    text = (Path(torch.__file__).parent / "utils" / "cpp_extension.py").read_text()
    assert "-std=c++20" in text  # the pinned torch's own extension builder
    assert cpu_build.cxx_std() == "c++20"
    cmd = cpu_build.compile_command(Path("x.cpp"), Path("x.so"))
    assert f"-std={cpu_build.cxx_std()}" in cmd and "-std=c++17" not in cmd


@pytest.mark.parametrize("std", ["c++17", "c++20"])
def test_the_kernel_source_compiles_as_cxx17_and_cxx20(std, tmp_path):
    """The source stays clean for both standards against the pinned torch: C++20 for every current torch, C++17 for
    the older releases that pyproject.toml still admits (torch >= 2.4). -fsyntax-only: every template instantiated,
    no object code."""
    import shutil
    import subprocess

    import torch

    from normlab.kernels import cpu_build

    if std == "c++17" and tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 14):
        pytest.skip(f"torch {torch.__version__}'s own headers need C++20 (std::strong_ordering)")
    cmd = cpu_build.compile_command(cpu_build.source_path(), tmp_path / "x.so")
    if shutil.which(cmd[0]) is None:
        pytest.skip("no C++ compiler")
    cmd = [f for f in cmd if not f.startswith(("-std=", "-o", "-l", "-L", "-Wl")) and f != str(tmp_path / "x.so")]
    proc = subprocess.run([*cmd, f"-std={std}", "-fsyntax-only"], capture_output=True, text=True)
    assert proc.returncode == 0, cpu_build.first_error(proc.stderr)


def _failing_compiler(tmp_path: Path) -> tuple[Path, Path]:
    """A CXX that answers --version and fails every compile with one error line, counting its compiles."""
    count = tmp_path / "compiles"
    cxx = tmp_path / "fail-c++"
    cxx.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "--version" ]; then echo "fail-c++ 1.0"; exit 0; fi\n'
        f'case "$*" in *cpu_norms.cpp*) echo x >> "{count}";; esac\n'  # the kernels' compile, not torch's ISA probes
        'echo "/opt/torch/include/c10/util/x.h:7:3: error: the injected failure" >&2\n'
        "exit 1\n"
    )
    cxx.chmod(0o755)
    return cxx, count


@pytest.mark.slow
def test_a_failed_build_is_recorded_not_retried_in_every_process(tmp_path):
    """A build that failed cost a compile in every new process (20-40 s each) and said nothing in library use. Now
    the failure is recorded per machine, torch, compiler and source: the next process warns at once with the
    compiler's first error, and `normlab build-kernels` (asked for by name) tries again."""
    import os
    import subprocess
    import sys

    cxx, count = _failing_compiler(tmp_path)
    env = {"CXX": str(cxx), "NORMLAB_CACHE": str(tmp_path / "cache")}
    first = _build_in_child(env)
    assert "FAILED" in first and "c10/util/x.h:7:3: error: the injected failure" in first, first
    assert "/opt/torch/include/" not in first  # the header path shortened to what a person searches for
    second = _build_in_child(env)
    assert "FAILED" in second and "the injected failure" in second and "not retried in every process" in second
    assert "normlab build-kernels" in second  # the way to retry
    compiles = count.read_text().count("x")  # 2 at most: a first try with -mavx512bf16, where the CPU has it
    assert compiles in (1, 2)
    assert count.read_text().count("x") == compiles, "the second process compiled again"
    cli = subprocess.run([sys.executable, "-m", "normlab.cli", "build-kernels"], env={**os.environ, **env},
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert cli.returncode == 1 and "the injected failure" in cli.stderr and "Traceback" not in cli.stderr
    assert count.read_text().count("x") == 2 * compiles  # build-kernels retried


def test_a_failed_build_warns_once_in_library_use(tmp_path):
    """In a training script (no build-kernels), a recorded failure is one RuntimeWarning naming the error and the fix,
    however many norms run; the norms still compute, on the reference math."""
    import os
    import subprocess
    import sys

    cxx, _ = _failing_compiler(tmp_path)
    env = {**os.environ, "CXX": str(cxx), "NORMLAB_CACHE": str(tmp_path / "cache")}
    env.pop("NORMLAB_KERNEL", None)
    subprocess.run([sys.executable, "-m", "normlab.cli", "build-kernels"], env=env, capture_output=True, timeout=300)
    code = (
        "import torch, normlab\n"
        "m = torch.nn.Sequential(*[normlab.DyT(512) for _ in range(4)])\n"
        "x = torch.randn(256, 512, requires_grad=True)\n"
        "for _ in range(3):\n    m(x).sum().backward()\n"
        "print('GRAD', bool(torch.isfinite(x.grad).all()))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "GRAD True" in proc.stdout, proc.stderr[-2000:]
    assert proc.stderr.count("RuntimeWarning") == 1, proc.stderr
    assert "the injected failure" in proc.stderr and "reference math" in proc.stderr


def test_what_a_killed_build_left_is_removed_at_the_next_load(tmp_path):
    """issue 99: a background build killed while it compiled left its 400 kB ``normlab_cpu.<pid>.<tid>.tmp.so`` in
    the cache for good (the next load found the library whole and looked no further). A load removes a temporary
    file whose process is gone and leaves a running one's."""
    import os
    import shutil
    import subprocess
    import sys

    from normlab.kernels import cpu_build

    if not cpu_build.load(wait=True):
        pytest.skip("no CPU kernel library on this machine")
    built = cpu_build.library_folder()
    folder = tmp_path / "kernels" / built.name
    folder.mkdir(parents=True)
    for name in ("normlab_cpu.so", "build.json"):
        shutil.copy2(built / name, folder / name)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(gone.stdout)
    stale = [folder / f"normlab_cpu.{dead}.1.tmp.so", folder / f"build.json.{dead}.tmp"]
    live = folder / f"normlab_cpu.{os.getpid()}.1.tmp.so"
    for f in [*stale, live]:
        f.write_bytes(b"\0" * 1000)
    code = "from normlab.kernels import cpu_build\nassert cpu_build.load(wait=True)"
    env = {**os.environ, "NORMLAB_CACHE": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not any(f.exists() for f in stale) and live.exists(), (
        sorted(p.name for p in folder.iterdir()),
        proc.stderr[-2000:],
    )


def test_build_kernels_check_says_when_normlab_kernel_chose_the_paths(monkeypatch, capsys):
    """issue 99: under NORMLAB_KERNEL=reference, `normlab build-kernels --check` showed the reference math for
    every norm as if the kernels had not taken; it now says the variable chose it, and how to see the kernels'."""
    from normlab.cli import main
    from normlab.kernels import cpu_build

    if not cpu_build.load(wait=True):
        pytest.skip("no CPU kernel library on this machine")
    monkeypatch.setenv("NORMLAB_KERNEL", "reference")
    assert main(["build-kernels", "--check"]) == 0
    out = capsys.readouterr().out
    assert "dyt             reference math" in out and "NORMLAB_KERNEL=reference is set" in out, out
    monkeypatch.delenv("NORMLAB_KERNEL")
    assert main(["build-kernels", "--check"]) == 0
    assert "NORMLAB_KERNEL" not in capsys.readouterr().out
