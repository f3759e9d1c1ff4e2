"""What each stage of a conversion reads: the config's one data section, ``[data]``.

Four stages read data: calibration fits on it, the budget walk selects on it, the heal trains on it and the judge
measures on it. Each reads the conversion text (``text``, split into calibration, held-out, validation and stream
parts), the original's own samples ("self", drawn once and cached), or for the heal both ("self+text"). The judge
also reads a second text (``judge``). The samples' count, starts, temperature, seed and precision are written here
once, for every stage that reads them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from normlab.conversion.flags import flag, int_at_least
from normlab.typed import check_types

__all__ = ["DataConfig", "HEAL_SAMPLES"]

HEAL_SAMPLES = 1024  # the original's samples a heal on them draws by default (data.samples)


@dataclass
class DataConfig:
    """What calibration, the walk, the heal and the judge read, and how the original's samples are drawn."""

    text: str | None = None
    """The conversion text file (--calibrate FILE): calibration, held-out, validation and the heal's stream; None:
    the Shakespeare corpus."""
    calibrate: Literal["text", "self"] = "text"
    """What calibration fits on: the text's first sequences, or "self", the first of the original's own samples."""
    walk: Literal["text", "self"] = "text"
    """What the budget walk selects on: the text's validation split, or "self": ``sequences`` of the samples."""
    heal: Literal["text", "self", "self+text"] = "text"
    """What the heal trains on: the text's stream, "self" (the original's own samples) or "self+text"."""
    judge: str | None = "docs"
    """A second text, never calibrated or healed on, measured beside the held-out part: "docs" (docutils 0.23), a
    file, or None."""
    samples: int | None = None
    """The original's samples drawn (cached on disk). None: `HEAL_SAMPLES` (1,024) for a heal on samples, else what
    calibration and the walk on samples read, 2 x ``sequences`` + 8 (`normlab.conversion.config.ConvertConfig`)."""
    self_fraction: float = 0.5
    """Of every "self+text" heal batch, the part drawn from the samples."""
    starts: Literal["varied", "bos"] = "varied"
    """How samples begin: "varied", half chats through the template, a quarter at BOS, a quarter at a random token."""
    temperature: float = 1.0
    """Of the sampling."""
    seed: int = 0
    """Of the sampling, and of the order the text's stream is drawn in."""
    precision: Literal["auto", "float32", "bf16"] = "auto"
    """The sampling's arithmetic: "bf16" autocasts its forward passes; "auto" takes float32 on a CPU, where its
    samples are the same on every instruction set (`normlab.conversion.data.samples.TIE`), and bf16 on a GPU that
    runs it. bf16 on a CPU draws other tokens on other CPUs (SmolLM2, 2 cores: 1,024 samples in 2.6 min bf16, 5.2
    float32)."""

    @property
    def calibrates_on_samples(self) -> bool:
        """Whether calibration fits on the original's samples (``calibrate = "self"``)."""
        return self.calibrate == "self"

    @property
    def walks_on_samples(self) -> bool:
        """Whether the budget walk selects on the original's samples (``walk = "self"``)."""
        return self.walk == "self"

    @property
    def heals_on_samples(self) -> bool:
        """Whether a heal, where there is one, trains on the original's samples ("self" or "self+text")."""
        return self.heal != "text"

    @property
    def converts_on_samples(self) -> bool:
        """Whether calibration or the walk reads the original's samples (drawn before the conversion)."""
        return self.calibrates_on_samples or self.walks_on_samples

    def reads_samples(self, healing: bool) -> bool:
        """Whether a stage reads the original's samples (the heal only when there is one: ``healing``).

        Args:
            healing: Whether the conversion heals.
        """
        return (healing and self.heals_on_samples) or self.converts_on_samples

    def calibration_words(self) -> str:
        """Where calibration's sequences come from, in words (the printed conversion line)."""
        return "of the original's own samples" if self.calibrates_on_samples else "from the text's start"

    def selection_words(self) -> str:
        """What the walk selects on, in words (the printed walk line)."""
        return "of the original's own samples" if self.walks_on_samples else "validation sequences"

    def validate(self) -> None:
        """Each field alone; how they combine with the rest of the conversion is `ConvertConfig.validate`'s."""
        check_types(self, "data.")
        if self.text is not None and not self.text.strip():
            raise ValueError(f"{flag('data.text')} must name a text file, got {self.text!r}")
        if self.judge is not None and not self.judge.strip():
            raise ValueError(f"{flag('data.judge')} must be 'docs', a text file, or none, got {self.judge!r}")
        if self.samples is not None:
            int_at_least("data.samples", self.samples, 2)
        int_at_least("data.seed", self.seed, 0)
        for name, lo, hi in (("self_fraction", 0.0, 1.0), ("temperature", 0.0, math.inf)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo < v < hi:
                raise ValueError(f"{flag('data.' + name)} must be a number in ({lo:g}, {hi:g}), got {v!r}")
