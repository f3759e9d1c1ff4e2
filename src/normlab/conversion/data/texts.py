"""The texts a conversion reads: its own text cut into calibration, held-out, validation and stream parts, and the
second text it is measured on and never trained on (``--eval-text``)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from normlab.conversion.config import ConvertConfig
from normlab.conversion.data.config import DataConfig
from normlab.conversion.data.models import TextCut, leading_bos, text_batches, text_splits
from normlab.corpus import DOCS, fetch_docs

if TYPE_CHECKING:
    import torch

__all__ = ["ConversionTexts", "conversion_texts", "second_text", "eval_file"]


@dataclass(frozen=True)
class ConversionTexts:
    """A run's texts, as batches: the conversion text's splits (with a heal or a budget; else None), its calibration
    and held-out parts, and the second text's held-out part with its name (None when ``--eval-text none``)."""

    splits: object | None  # normlab.conversion.data.models.TextSplits
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
