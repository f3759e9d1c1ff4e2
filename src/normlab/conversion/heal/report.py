"""What a heal leaves for a person to read: one summary line (`heal_summary`) and its validation curve as a CSV
table and a plot (`write_curve`), written beside the converted model by ``normlab convert``."""

from __future__ import annotations

from pathlib import Path

from normlab.conversion.heal.loop import HealReport

__all__ = ["heal_summary", "write_curve"]


def heal_summary(rep: HealReport) -> str:
    """One line on a heal: tokens, minutes, how much of the stream, and the validation curve's start and kept point.

    Args:
        rep: The heal's `HealReport`.
    """
    line = (
        f"healed ({rep.train}): {rep.tokens:,} tokens in {rep.seconds / 60:.1f} min "
        f"({rep.tokens / max(rep.seconds, 1e-9):.0f} tokens/s), {rep.sequences:,} stream sequences "
        f"({rep.stream_passes:.2f} passes)"
    )
    if rep.curve and rep.best is not None:
        line += (
            f"; validation CE {rep.curve[0]['val_ce']:.3f} at the start, best {rep.best['val_ce']:.3f} at "
            f"{rep.best['tokens']:,} tokens (kept), last {rep.curve[-1]['val_ce']:.3f}"
        )
    if rep.frozen_blocks:
        line += f"; blocks 0-{rep.frozen_blocks - 1} left the original's (before the first converted site)"
    if rep.rollbacks:
        line += f"; rolled back to the best state {rep.rollbacks} time(s), each halving the rate"
    if rep.teacher_computed:
        line += (
            f"; teacher cache: the original ran on {rep.teacher_computed:,} sequences, "
            f"{rep.teacher_reused:,} were read back"
        )
    return line


def write_curve(rep: HealReport, folder: Path) -> None:
    """The heal's validation curve as heal_curve.csv and heal_curve.png in ``folder``.

    Args:
        rep: The heal's `HealReport`.
        folder: Where the two files go.
    """
    import csv

    curve = rep.curve
    if not curve:
        return
    keys = list(dict.fromkeys(k for p in curve for k in p))
    with open(folder / "heal_curve.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(curve)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([p["tokens"] for p in curve], [p["val_ce"] for p in curve], marker=".", color="C0", label="validation CE")
    if rep.best is not None:
        ax.axvline(rep.best["tokens"], color="green", ls=":", label="kept")
    back = [p for p in curve if p.get("rollback")]
    if back:
        ax.scatter(
            [p["tokens"] for p in back],
            [p["val_ce"] for p in back],
            color="red",
            marker="x",
            zorder=3,
            label="rolled back to the best, rate halved",
        )
    handles = ax.get_legend_handles_labels()
    tl = [(p["tokens"], p["train_loss"]) for p in curve if p["train_loss"] == p["train_loss"]]
    if tl:
        ax2 = ax.twinx()
        ax2.plot(*zip(*tl), color="grey", lw=0.8, label="train loss (KL)")
        ax2.set_ylabel("train loss (KL)")
        handles = [a + b for a, b in zip(handles, ax2.get_legend_handles_labels())]
    ax.set_xlabel("tokens trained")
    ax.set_ylabel("validation CE (nats/token)")
    ax.set_title(f"heal: {rep.train}; {rep.tokens / max(rep.seconds, 1e-9):.0f} tokens/s")
    ax.legend(*handles, fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(folder / "heal_curve.png", dpi=110)
    plt.close(fig)
