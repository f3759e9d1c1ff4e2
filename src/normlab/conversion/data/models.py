"""Real models where users have them: a local Hugging Face folder or a GGUF file, loaded with their tokenizer.

    from normlab.conversion.data.models import load_model
    model, tokenizer = load_model("path/to/model")            # folder with config.json + weights
    model, tokenizer = load_model("path/to/model.Q4_1.gguf")  # GGUF, dequantized to float32

Loading needs the ``[hf]`` extra (transformers, plus gguf and accelerate for GGUF files). The real models the tests and
benchmarks name (``--model smollm2``) are `normlab.conversion.data.fixtures`; text as token batches is
`normlab.conversion.data.texts`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from pathlib import Path

import torch
from torch import nn

from normlab.record import RECORD_FILE

__all__ = ["quiet", "load_model", "leading_bos", "usable_tokenizer"]
_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


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
