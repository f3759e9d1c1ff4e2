"""Checks of a conversion's settings against what the run will do and what the machine holds, made before any
work: a knob that the setting makes idle, a sample count that would not fit in memory."""

from __future__ import annotations

from normlab.conversion.flags import flag
from normlab.errors import check_memory

__all__ = ["CALIBRATION_KNOBS", "check_limits", "check_idle_calibration", "check_sample_memory"]

# the calibrate section's fields that say how a calibration fits: idle without one (--no-calibrate)
CALIBRATION_KNOBS = ("massive_tokens", "target", "max_tokens", "massive", "fit_amplitude", "sequential", "solver")


def check_idle_calibration(c, plain) -> None:
    """Refuse a calibration knob set away from its default when calibration is off (``--massive-tokens route
    --no-calibrate`` was saved as if it did something).

    Args:
        c: The config's calibrate section (a `normlab.conversion.config.CalibrateConfig`).
        plain: The section's defaults.
    """
    if c.enabled:
        return
    idle = [k for k in CALIBRATION_KNOBS if getattr(c, k) != getattr(plain, k)]
    if idle:
        raise ValueError(
            f"{flag('calibrate.' + idle[0])} {getattr(c, idle[0])} does nothing with {flag('calibrate.enabled')}: it "
            "sets how calibration fits; drop one of them"
        )


UNREAD = 64  # a set over this many times what a conversion without a heal reads is refused (a study's 2,048 are
# drawn to be shared with its heals' cells)


def check_sample_memory(n: int, seq_len: int, read: int) -> None:
    """Refuse a sample count whose token ids alone (int64) would not fit in this machine's memory, before any
    sampling starts (``data.samples=100000000`` began drawing 3.2 billion tokens).

    Args:
        n: The original's samples the conversion draws.
        seq_len: Tokens per sample.
        read: How many a conversion without a heal reads (2 x sequences + 8), named in the fix.
    """
    check_memory(
        8 * n * seq_len,
        f"{flag('data.samples')} {n:,} samples of {seq_len} tokens",
        f"lower {flag('data.samples')} (without a heal, {read} are read)",
    )


def check_limits(cfg) -> None:
    """Both checks on a `normlab.conversion.config.ConvertConfig` (its ``validate`` calls this last).

    Args:
        cfg: The conversion's config.
    """
    check_idle_calibration(cfg.calibrate, type(cfg.calibrate)())
    if cfg.samples_original:
        n, read = cfg.sample_count(), 2 * cfg.sequences + 8
        check_sample_memory(n, cfg.seq_len, read)
        if not cfg.heal_on_samples and n > UNREAD * read:
            raise ValueError(
                f"{flag('data.samples')} {n:,}: without a heal on them the conversion reads {read} of the original's "
                f"samples, and drawing {n * cfg.seq_len:,} tokens (SmolLM2 draws about 75 a second on one core) is "
                f"time spent for nothing; lower {flag('data.samples')} to {read}, or heal on them"
            )
