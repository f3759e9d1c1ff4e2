"""A torch.compile cache folder of this CPU's own, for the processes normlab starts.

PyTorch keys Inductor's FX graph cache without the CPU's vector instruction set. Code generated on an AVX-512
machine, whose loops step 16 floats at a time, is then reused on an AVX2 machine and compiled there for 8-float
vectors. Measured with torch 2.13.0 on an AVX-512 EPYC, with ``ATEN_CPU_CAPABILITY=avx2`` on the second run: the
compiled ``w * tanh(0.5 * x) + 1`` was 3e35 from eager instead of 2e-7. In the test suite it crashed the processes
with ``munmap_chunk(): invalid pointer``. A cache folder is moved between machines more often than one would think:
a copied ``/tmp``, a shared home folder, a container image.

:func:`use_cache_of_this_cpu` points ``$TORCHINDUCTOR_CACHE_DIR`` at a folder named by the CPU's flags
(:func:`normlab.kernels.cpu_build.cpu_key`) and by the CPU kernels' source, unless it names a folder of the user's
choice, which is kept. The source, because the AOTAutograd cache keys a compiled backward by the forward graph: a
forward whose op kept its schema found the backward compiled against the previous ``pointwise_bwd`` (9 arguments
where 0.10.0's takes 8) and raised in every compiled point-wise norm's backward.
"""

from __future__ import annotations

import getpass
import os
import tempfile
from pathlib import Path

from normlab.kernels.cpu_build import cpu_key, source_key

ENV = "TORCHINDUCTOR_CACHE_DIR"


def default_folder() -> Path:
    """Inductor's own default cache folder, ``<temp>/torchinductor_<user>``."""
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        return Path(default_cache_dir()).absolute()
    except ImportError:  # an older torch: the same rule, written here
        try:
            user = getpass.getuser()
        except (KeyError, OSError):  # a uid with no name (some containers)
            user = f"uid_{os.getuid()}"
        return Path(tempfile.gettempdir()).absolute() / f"torchinductor_{user}"


def use_cache_of_this_cpu() -> Path | None:
    """Point ``$TORCHINDUCTOR_CACHE_DIR`` at ``<Inductor's default folder>-cpu-<key>-ops-<source key>``, unless it
    names another folder.

    Inductor writes its default folder into the variable as soon as it is imported, so that value counts as unset.
    Call this before the first ``torch.compile`` of the process; the processes this one starts inherit the variable.

    Returns:
        The folder now set, or None where the variable names a folder of the user's choice.
    """
    default = default_folder()
    chosen = os.environ.get(ENV)
    if chosen and Path(chosen).absolute() != default:
        return None
    folder = default.with_name(f"{default.name}-cpu-{cpu_key()}-ops-{source_key()}")
    os.environ[ENV] = str(folder)
    return folder
