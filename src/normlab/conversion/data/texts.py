"""The texts a conversion reads: text as token sequences (`text_batches`, `text_splits`: calibration, held-out,
validation and stream parts, `TokenStream`), its own text cut so, and the second text it is measured on and never
trained on (``--eval-text``)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from normlab.conversion.config import ConvertConfig
from normlab.conversion.data.config import DataConfig
from normlab.conversion.data.models import leading_bos
from normlab.corpus import DOCS, fetch_docs

__all__ = ["token_chunks", "TextCut", "text_batches", "check_text", "TokenStream", "TextSplits", "text_splits",
           "ConversionTexts", "conversion_texts", "second_text", "eval_file"]  # fmt: skip


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


def check_text(text: str, path: str | Path) -> None:
    """Warn when a text file does not read as text: more than 5% of its characters undecodable as UTF-8 or control
    characters (random bytes, a binary file passed by mistake). Calibrating or measuring on it is allowed, not
    silent: the numbers would describe bytes, not language.

    Args:
        text: The file's text.
        path: The file, as named in the warning.
    """
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


@dataclass(frozen=True)
class ConversionTexts:
    """A run's texts, as batches: the conversion text's splits (with a heal or a budget; else None), its calibration
    and held-out parts, and the second text's held-out part with its name (None when ``--eval-text none``)."""

    splits: TextSplits | None
    calib: list
    held: list
    second: list | None = None
    second_name: str | None = None
    select: list | None = None  # what the budget walk selects on, when not the splits' validation part

    def selecting_on(self, select: list) -> ConversionTexts:
        """These texts with ``select`` as what the budget walk selects on (the original's own samples,
        ``data.walk = "self"``); the splits, the heal's validation among them, stay as they are."""
        return replace(self, select=select)

    def selection(self) -> list | None:
        """What the budget walk selects on: ``select``, else the splits' validation part (None without splits)."""
        return self.select if self.select is not None else self.splits.val if self.splits is not None else None

    def calibrating_on(self, calib: list) -> ConversionTexts:
        """These texts with ``calib`` as the calibration part (the original's own samples: ``data.calibrate``)."""
        splits = replace(self.splits, calib=calib) if self.splits is not None else None
        return replace(self, splits=splits, calib=calib)

    def on_samples(self, data: DataConfig, own: torch.Tensor, n: int) -> ConversionTexts:
        """These texts with the original's own samples ``own`` where ``data`` asks for them: the first ``n`` as the
        calibration part (``data.calibrate = "self"``), the next ``n`` as what the walk selects on (``data.walk =
        "self"``; the first ``n`` when calibration reads the text).

        Args:
            data: The config's data section.
            own: The original's samples, (count, seq_len) token ids.
            n: Sequences each part reads (the config's ``sequences``).
        """
        texts = self.calibrating_on(list(own[:n].split(8))) if data.calibrates_on_samples else self
        if data.walks_on_samples:
            at = n if data.calibrates_on_samples else 0
            texts = texts.selecting_on(list(own[at : at + n].split(8)))
        return texts

    def judged(self) -> dict[str, list]:
        """The texts the judgement reads, by name: the held-out part, and the second text when there is one."""
        return {"held-out": self.held} | ({self.second_name: self.second} if self.second is not None else {})


def eval_file(cfg: ConvertConfig) -> str | None:
    """The second text's path as given ('docs' for the docutils documentation), or None when it is off.

    Args:
        cfg: The conversion's config (its ``data.judge``).
    """
    e = cfg.data.judge
    return None if e is None or e.strip().lower() == "none" else e


def second_text(cfg: ConvertConfig, tokenizer: object | None, vocab: int) -> tuple[list | None, str | None]:
    """The second text's held-out batches and its name, or (None, None). Only its last sequences are read, and
    nothing of it reaches calibration or the heal.

    Args:
        cfg: The conversion's config (its ``data.judge``, ``seq_len`` and ``sequences``).
        tokenizer: The model's tokenizer, or None (byte ids).
        vocab: The model's vocabulary size.
    """
    e = eval_file(cfg)
    if e is None:
        return None, None
    path, name = (fetch_docs(), f"{DOCS} documentation") if e == "docs" else (e, Path(e).name)
    _, held = text_batches(path, tokenizer, vocab, TextCut(cfg.seq_len, n_calib=1, n_held=cfg.sequences))
    return held, name


def conversion_texts(cfg: ConvertConfig, text: str | Path, tokenizer: object | None, vocab: int) -> ConversionTexts:
    """The conversion text cut for this run (with a heal or a budget, its four splits; else its two ends) and the
    second text. A model whose tokenizer starts every text with BOS
    gets it at the start of every sequence (`normlab.conversion.data.models.leading_bos`), and the run says so.

    Args:
        cfg: The conversion's config (its sequence length and counts, whether it heals or walks a budget).
        text: The conversion text's file.
        tokenizer: The model's tokenizer, or None (byte ids).
        vocab: The model's vocabulary size.
    """
    bos = leading_bos(tokenizer)
    if bos is not None:
        print(f"every sequence starts with BOS (id {bos}), as {cfg.model}'s tokenizer starts every text")
    if cfg.heal.budgeted or cfg.budget.nats is not None:
        val = cfg.sequences if cfg.budget.nats is not None else TextCut.n_val  # a budget selects on as many as held
        cut = TextCut(cfg.seq_len, cfg.sequences, cfg.sequences, val, seed=cfg.data.seed)  # the stream's order
        splits = text_splits(text, tokenizer, vocab, cut)
        calib, held = splits.calib, splits.held
    else:
        splits = None
        calib, held = text_batches(text, tokenizer, vocab, TextCut(cfg.seq_len, cfg.sequences, cfg.sequences))
    return ConversionTexts(splits, calib, held, *second_text(cfg, tokenizer, vocab))
