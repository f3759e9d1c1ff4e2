"""The original's own samples (`normlab.conversion.data.samples`) as a conversion's data: the set its config names
(`own_samples`), calibration batches from it, and the heal's splits (`heal_splits`), where `MixedStream` draws a fixed
fraction of every batch from the samples and the rest from the user's text (``data.heal = "self+text"``).
"""

from __future__ import annotations

import torch
from torch import nn

from normlab.conversion.batches import autocast_dtype, model_device
from normlab.conversion.data.config import HEAL_SAMPLES, DataConfig
from normlab.conversion.data.samples import SampleSet, Starts, self_samples, weights_fingerprint
from normlab.conversion.data.texts import TextSplits, TokenStream

__all__ = ["MixedStream", "own_samples", "sample_set", "calibration_samples", "heal_splits"]


class MixedStream:
    """Two token streams as one: ``fraction`` of every draw (rounded) from ``first``, the rest from ``second``.
    It has a TokenStream's interface (``next``, ``state``/``load_state``, ``chunks``, ``seq_len``, ``drawn``).

    Args:
        first: The stream ``fraction`` of each batch comes from.
        second: The stream of the rest.
        fraction: The share of ``first``, in [0, 1].
    """

    def __init__(self, first: TokenStream, second: TokenStream, fraction: float) -> None:
        if first.seq_len != second.seq_len:
            raise ValueError(f"MixedStream: sequence lengths differ ({first.seq_len} vs {second.seq_len})")
        if not 0.0 < fraction < 1.0:
            raise ValueError(f"MixedStream: fraction must be in (0, 1), got {fraction!r}")
        self.first, self.second, self.fraction = first, second, fraction
        self.chunks = torch.cat([first.chunks, second.chunks])

    def __len__(self) -> int:
        return len(self.chunks)

    @property
    def seq_len(self) -> int:
        return self.first.seq_len

    @property
    def drawn(self) -> int:
        return self.first.drawn + self.second.drawn

    def next(self, n: int) -> torch.Tensor:
        k = round(n * self.fraction)
        parts = [self.first.next(k)] if k else []
        if n - k:
            parts.append(self.second.next(n - k))
        return torch.cat(parts)

    def state(self) -> dict:
        return {"first": self.first.state(), "second": self.second.state(), "fraction": self.fraction}

    def load_state(self, state: dict) -> None:
        if state.get("fraction") != self.fraction or "first" not in state:
            raise ValueError(
                f"MixedStream: the saved stream mixed {state.get('fraction')!r} of samples, this one "
                f"{self.fraction!r}; resume with the same data.self_fraction"
            )
        self.first.load_state(state["first"])
        self.second.load_state(state["second"])


def own_samples(
    original: nn.Module, cfg: DataConfig, seq_len: int, *, starts: Starts, progress: bool = False
) -> torch.Tensor:
    """The original's sample set that ``cfg`` (a `normlab.conversion.data.config.DataConfig`) names: its
    ``samples`` count, seed and temperature, cached under the original's `weights_fingerprint`. The heal's
    ``self`` stream, ``data.calibrate = "self"`` and ``data.walk = "self"`` read the same set.

    Args:
        original: The unconverted model, which samples.
        cfg: The data section, a `normlab.conversion.data.config.DataConfig`.
        seq_len: Tokens per sample.
        starts: How the samples begin (`sample_starts` of the model's tokenizer).
        progress: Show a progress bar while it samples.
    """
    return self_samples(original, sample_set(original, cfg, seq_len, starts), progress=progress)


def sample_set(original: nn.Module, cfg: DataConfig, seq_len: int, starts: Starts) -> SampleSet:
    """Which sample set `own_samples` reads or draws for ``cfg`` (its cache file: `sample_path`).

    Args:
        original: The unconverted model, which samples.
        cfg: The data section, a `normlab.conversion.data.config.DataConfig`.
        seq_len: Tokens per sample.
        starts: How the samples begin (`sample_starts` of the model's tokenizer).
    """
    on_cpu = (model_device(original) or torch.device("cpu")).type == "cpu"
    precision = "float32" if cfg.precision == "auto" and on_cpu else cfg.precision  # the same samples on every CPU
    dtype, _ = autocast_dtype(precision, original, "data.precision")
    return SampleSet(
        weights_fingerprint(original),
        cfg.samples if cfg.samples is not None else HEAL_SAMPLES,  # a ConvertConfig resolves it
        seq_len,
        starts,
        cfg.seed,
        cfg.temperature,
        precision="bf16" if dtype is not None else "float32",
    )


def calibration_samples(
    original: nn.Module, cfg: DataConfig, seq_len: int, n: int, *, starts: Starts, progress: bool = False
) -> list[torch.Tensor]:
    """The first ``n`` of the original's own samples (`own_samples`) as calibration batches of 8, (8, seq_len):
    calibration that needs no text. They are drawn before the heal's validation part, which they never reach.

    Args:
        original: The unconverted model, which samples.
        cfg: The data section, a `normlab.conversion.data.config.DataConfig`.
        seq_len: Tokens per sample.
        n: How many samples.
        starts: How the samples begin (`sample_starts` of the model's tokenizer).
        progress: Show a progress bar while it samples.
    """
    return list(own_samples(original, cfg, seq_len, starts=starts, progress=progress)[:n].split(8))


def heal_splits(splits: TextSplits, original: nn.Module, cfg: DataConfig, *, starts: Starts, progress: bool = False):
    """The heal's data for ``cfg.heal`` (a `normlab.conversion.data.config.DataConfig`): ``splits`` itself for
    "text"; for "self", the original's samples (the last eighth, at most 8, validate; the rest is the stream),
    with the calibration and held-out parts of ``splits`` unchanged; for "self+text", a `MixedStream` of
    both, validated on both. The samples are cached under the original's `weights_fingerprint`.

    Args:
        splits: The conversion text's calibration, held-out and stream parts.
        original: The unconverted model, which samples.
        cfg: The data section, a `normlab.conversion.data.config.DataConfig`.
        starts: How the samples begin (`sample_starts` of the model's tokenizer).
        progress: Show a progress bar while it samples.
    """
    if not cfg.heals_on_samples:
        return splits
    samples = own_samples(original, cfg, splits.stream.seq_len, starts=starts, progress=progress)
    n_val = min(8, max(1, len(samples) // 8))
    own = TokenStream(samples[:-n_val], cfg.seed)
    own_val = list(samples[-n_val:].split(8))
    if cfg.heal == "self":
        return TextSplits(splits.calib, splits.held, own_val, own)
    return TextSplits(
        splits.calib, splits.held, [*splits.val, *own_val], MixedStream(own, splits.stream, cfg.self_fraction)
    )
