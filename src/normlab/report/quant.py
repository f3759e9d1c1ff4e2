"""The quantization study's verdicts and figure: each norm at its best learning rate, its outlier statistics and its
held-out loss gap under fake quantization (`normlab.lab.quant`), set against RMSNorm's in the same cell.

A run of the study's TOML names its ``cell`` (width, tokens, block, optimizer) and its ``series`` (the norm); the
series ``rms`` is the reference of its cell. Every number is the mean over seeds at the rate of the grid with the
lowest validation loss (`normlab.report.results.Results.best`), so a norm is never judged at a rate that is not its
best; a difference is ``same`` when it is within the larger spread over seeds of the two.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from normlab.report.checks import Verdict, register_check, verdict  # noqa: E402
from normlab.report.figures import register_figure  # noqa: E402
from normlab.report.results import Results  # noqa: E402

__all__ = ["QUANT_METRICS", "cells", "compare"]

#: what the study states per norm, and how each is written
QUANT_METRICS = {"final_val_loss": "{:.3f}", "kurt_resid": "{:+.2f}", "kurt_readers": "{:+.2f}",
                 "maxmed_readers": "{:.1f}", "qgap_w8": "{:+.1e}", "qgap_w4": "{:+.1e}",
                 "qgap_w8a8": "{:+.1e}"}  # fmt: skip


def cells(res: Results) -> dict[str, dict[str, str]]:
    """Cell -> series -> the swept run's name, in the TOML's order."""
    out: dict[str, dict[str, str]] = {}
    for name in res.sweeps:
        meta = res.meta(name)
        out.setdefault(meta.get("cell", ""), {})[meta.get("series", name)] = name
    return out


def _stat(res: Results, name: str, metric: str) -> tuple[float, float] | None:
    vals = res.values(name, metric)
    if not vals:
        return None
    return statistics.fmean(vals), statistics.stdev(vals) if len(vals) > 1 else 0.0


def compare(res: Results, a: str, b: str, metric: str) -> dict | None:
    """``a`` minus ``b`` on ``metric``, each at its best rate, and the word for it (``same`` within the larger spread
    over seeds)."""
    sa, sb = _stat(res, a, metric), _stat(res, b, metric)
    if sa is None or sb is None:
        return None
    d, spread = sa[0] - sb[0], max(sa[1], sb[1])
    return {"diff": d, "spread": spread, "word": "same" if abs(d) <= spread else ("lower" if d < 0 else "higher")}


@register_check("quant")
def _check_quant(res: Results, c: dict) -> list[Verdict]:
    """Per cell and series: the numbers of `QUANT_METRICS`; then, for each metric in ``c["compare"]``, each norm
    against RMSNorm as lower / same / higher."""
    out = []
    for cell, series in cells(res).items():
        for name in series.values():
            parts = [
                f"{m} {fmt.format(v[0])}" + (f" ± {v[1]:.2g}" if v[1] else "")
                for m, fmt in QUANT_METRICS.items()
                if (v := _stat(res, name, m)) is not None
            ]
            if not parts:
                out.append(verdict(None, f"{res.label(name)}: no finished run"))
                continue
            edge = "; best rate at the grid's edge" if res.at_edge(name) else ""
            out.append(Verdict(None, f"{res.label(name)}: {', '.join(parts)}{edge}", finding=not edge))
        ref = series.get("rms")
        for metric in c.get("compare", []):
            words = []
            for s, name in series.items():
                d = None if ref is None or s == "rms" else compare(res, name, ref, metric)
                if d is not None:
                    words.append(f"{s} {d['word']} ({d['diff']:+.2g}, spread over seeds {d['spread']:.2g})")
            if words:
                out.append(Verdict(None, f"{cell}, {metric} against RMSNorm: {'; '.join(words)}", finding=True))
    return out


@register_figure("quant")
def _quant_figure(res: Results, path: Path, other: Results | None = None) -> Path | None:
    """One panel per metric (kurtosis of the readers' inputs and of the residual stream, the W8A8 and W4 loss gaps),
    one group of bars per cell, one bar per norm at its best rate, mean ± std over seeds."""
    panels = ["kurt_readers", "kurt_resid", "qgap_w8a8", "qgap_w4"]
    by_cell = cells(res)
    if not by_cell:
        return None
    series = list(dict.fromkeys(s for sr in by_cell.values() for s in sr))
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.8))
    width = 0.8 / len(series)
    for ax, metric in zip(axes, panels):
        for j, s in enumerate(series):
            xs, ys, es = [], [], []
            for i, sr in enumerate(by_cell.values()):
                v = _stat(res, sr[s], metric) if s in sr else None
                if v is not None:
                    xs.append(i + (j - (len(series) - 1) / 2) * width)
                    ys.append(v[0])
                    es.append(v[1])
            ax.bar(xs, ys, width, yerr=es, capsize=2, label=s, color=f"C{j}")
        ax.set_xticks(range(len(by_cell)), [c.replace(" ", "\n", 2) for c in by_cell], fontsize=7)
        ax.set_title(metric, fontsize=9)
        ax.axhline(0, color="black", lw=0.6)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
