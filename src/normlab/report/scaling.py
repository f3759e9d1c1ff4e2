"""Learning-rate sweeps and the scaling study's verdicts: each norm at its best rate, and its gap to RMSNorm.

A run of an experiment's TOML with ``lrs = [...]`` stands for one run per rate (``normlab.sweep.lr_variants``);
``Results`` resolves its name to the variant with the lowest mean validation loss over seeds. The checks here
say which rate won and whether it sits at the edge of its grid (then the grid should be widened: the best may
lie outside it), and state a gap between two runs, each at its best rate, as lower / same / higher with the
spread over seeds. The figures draw loss against the rate per cell, and the gap against tokens and width with
a fitted trend.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from normlab.report.checks import Verdict, register_check, verdict  # noqa: E402
from normlab.report.figures import register_figure  # noqa: E402
from normlab.report.results import Results  # noqa: E402

__all__ = ["gap", "sweep_line", "trend", "gap_points"]


def sweep_line(res: Results, name: str) -> Verdict:
    """The best rate of one sweep, its loss over seeds, and whether it is at the grid's edge."""
    best = res.best(name)
    if best is None:
        return verdict(None, f"{name}: no rate of its grid has finished on every seed")
    meta, vals = res.meta(best), res.values(best)
    grid = [res.meta(v)["lr"] for v in res.sweeps[name]]
    sd = f" ± {statistics.stdev(vals):.3f}" if len(vals) > 1 else ""
    text = (
        f"{res.label(name)}: best {meta['lr_field']} {meta['lr']:g} of {', '.join(f'{g:g}' for g in grid)}, "
        f"val loss {statistics.fmean(vals):.3f}{sd} ({len(vals)} seeds)"
    )
    if res.at_edge(name):
        return Verdict(None, text + "; **at the edge of the grid**: widen it there", {"lr": meta["lr"], "edge": True})
    return Verdict(None, text, {"lr": meta["lr"], "edge": False}, finding=True)


def gap(res: Results, a: str, b: str) -> dict | None:
    """Run ``a`` minus run ``b``, each at its best rate: the gap, the larger std over seeds of the two, and the
    word (``lower`` / ``same`` / ``higher``; ``same`` when the gap is within that spread)."""
    ma, mb = res.mean(a), res.mean(b)
    if ma is None or mb is None:
        return None
    g, spread = ma - mb, res.spread(a, b)
    word = "same" if abs(g) <= spread else ("lower" if g < 0 else "higher")
    edge = [n for n in (a, b) if n in res.sweeps and res.at_edge(n)]
    return {"gap": g, "spread": spread, "word": word, "a": ma, "b": mb, "edge": edge}


@register_check("lr_sweeps")
def _check_lr_sweeps(res: Results, c: dict) -> list[Verdict]:
    """One line per swept run: its best rate, and a flag when that rate is at the edge of its grid."""
    return [sweep_line(res, name) for name in res.sweeps]


@register_check("gap")
def _check_gap(res: Results, c: dict) -> list[Verdict]:
    """For each pair [a, b] (named by ``names``): a minus b at their best rates, as lower / same / higher."""
    out = []
    for (a, b), where in zip(c["pairs"], c["names"], strict=True):
        d = gap(res, a, b)
        if d is None:
            out.append(verdict(None, f"{c['what']} at {where}: runs missing"))
            continue
        text = (
            f"{c['what']} at {where}: {d['gap']:+.3f} (spread over seeds {d['spread']:.3f}): **{d['word']}** "
            f"({res.label(a)} {d['a']:.3f} vs {res.label(b)} {d['b']:.3f})"
        )
        if d["edge"]:
            text += f"; best rate at the grid's edge for {', '.join(d['edge'])}"
        out.append(Verdict(None, text, d, finding=not d["edge"]))
    return out


@register_check("verdicts_agree")
def _check_verdicts_agree(res: Results, c: dict) -> list[Verdict]:
    """Whether two settings give the same verdict: each of ``compare`` is [[a, b], [a', b'], name, name'], the gap
    a - b in one setting (the LLaMA block, Muon) against a' - b' in the reference one (GPT-2, AdamW)."""
    out = []
    for p1, p2, n1, n2 in c["compare"]:
        d1, d2 = gap(res, *p1), gap(res, *p2)
        if d1 is None or d2 is None:
            out.append(verdict(None, f"{c['what']}, {n1} against {n2}: runs missing"))
            continue
        same = d1["word"] == d2["word"]
        text = (
            f"{c['what']}, {n1} against {n2}: {d1['word']} ({d1['gap']:+.3f}) against {d2['word']} "
            f"({d2['gap']:+.3f}): the verdict is {'the same' if same else 'different'}"
        )
        if d1["edge"] or d2["edge"]:
            out.append(Verdict(None, text + "; a best rate sits at its grid's edge", {"same": same}))
        else:
            out.append(Verdict(None, text, {"same": same, "gaps": (d1["gap"], d2["gap"])}, finding=True))
    return out


def trend(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares line y = a + b log2(x): (a, b)."""
    lx = [math.log2(x) for x in xs]
    mx, my = statistics.fmean(lx), statistics.fmean(ys)
    var = sum((v - mx) ** 2 for v in lx)
    b = sum((u - mx) * (v - my) for u, v in zip(lx, ys)) / var if var > 0 else 0.0
    return my - b * mx, b


@register_figure("lr")
def _lr_curves(res: Results, path: Path, other: Results | None = None) -> Path | None:
    """Validation loss against the learning rate, one panel per cell (the runs' ``cell``), one line per sweep,
    mean and std over seeds, the best rate circled; every panel on one y scale, so that cells compare by eye."""
    cells: dict[str, list[str]] = {}
    for name in res.sweeps:
        cells.setdefault(str(res.meta(res.sweeps[name][0]).get("cell", "")), []).append(name)
    cells = {k: v for k, v in cells.items() if any(res.values(x) for n in v for x in res.sweeps[n])}
    if not cells:
        return None
    cols = min(3, len(cells))
    rows = math.ceil(len(cells) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.4 * rows), squeeze=False, sharey=True)  # one scale
    top_of = (res.entropy() or 3.33) + 0.4  # above the attractor: a diverged or stuck rate, drawn at the top
    low = top_of
    for ax, (cell, names) in zip(axes.flat, cells.items()):
        grid = set()
        for name in names:
            pts = [(res.meta(v)["lr"], vals) for v in res.sweeps[name] if (vals := res.values(v))]
            if not pts:
                continue
            lrs = [p[0] for p in pts]
            grid.update(lrs)
            means = [statistics.fmean(p[1]) for p in pts]
            sds = [statistics.stdev(p[1]) if len(p[1]) > 1 else 0.0 for p in pts]
            shown = [min(m, top_of) for m in means]
            low = min(low, *shown)
            label = res.label(name).split(" (")[0].split(", ", 1)[-1]  # the norm, without the cell
            line = ax.errorbar(
                lrs, shown, yerr=[min(sd, top_of) for sd in sds], marker="o", ms=3, capsize=2, label=label
            )
            color = line[0].get_color()
            off = [(lr, top_of) for lr, m in zip(lrs, means) if m > top_of]
            if off:
                ax.plot(*zip(*off), "^", ms=7, color=color)
            best = res.best(name)
            if best is not None:
                ax.plot([res.meta(best)["lr"]], [res.mean(best)], "o", ms=9, mfc="none", color=color)
        ax.set_xscale("log")
        ax.set_xticks(sorted(grid), [f"{g:g}" for g in sorted(grid)], fontsize=7)
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())

        ax.set_title(cell, fontsize=9)
        ax.set_xlabel(
            res.meta(res.sweeps[names[0]][0])["lr_field"] + " (circled: best; triangle: above the attractor)",
            fontsize=7,
        )
        ax.set_ylabel("val loss, mean ± std over seeds", fontsize=7)
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(cells) :]:
        ax.axis("off")
    axes[0, 0].set_ylim(low - 0.1, top_of + 0.05)  # shared: every panel's range (the means', error bars cut)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def gap_points(res: Results, a: str = "dyt_m", b: str = "rms") -> list[dict]:
    """Per cell of the study (runs sharing ``cell`` in their TOML entry), the gap of series ``a`` to series ``b``
    at their best rates, with the cell's width, budget, block and optimizer."""
    by_cell: dict[str, dict[str, str]] = {}
    for name in res.sweeps:
        m = res.meta(res.sweeps[name][0])
        if "cell" in m and "series" in m:
            by_cell.setdefault(m["cell"], {})[m["series"]] = name
    pts = []
    for cell, series in by_cell.items():
        if a in series and b in series and (d := gap(res, series[a], series[b])) is not None:
            m = res.meta(res.sweeps[series[a]][0])
            shape = {k: m.get(k) for k in ("width", "block", "opt", "depth")}
            pts.append({"cell": cell, "budget": m.get("budget", 1), **shape, **d})
    return pts


# GPT-2 124M (12 x 768): the published gaps to LayerNorm, and where they come from (a prediction is set beside them)
ANCHORS = [
    ("DyISRU paper's repository, GPT-2 125M, OpenWebText, 5B tokens", "DyT - LayerNorm", 3.335 - 3.209),
    ("DyISRU paper's repository, GPT-2 125M, OpenWebText, 20B tokens", "DyT - LayerNorm", 3.108 - 3.078),
    ("Derf paper (arXiv 2512.10938), GPT-2 124M", "DyT - LayerNorm", 2.97 - 2.94),
]


def _trend_series(res: Results) -> tuple[list[tuple[float, dict]], list[tuple[float, dict]]]:
    """The gpt2 / AdamW / depth-4 gaps against tokens (width 64) and against width (1x tokens)."""
    pts = [p for p in gap_points(res) if p["block"] == "gpt2" and p["opt"] == "adamw" and p.get("depth", 4) == 4]
    return (
        sorted(((p["budget"], p) for p in pts if p["width"] == 64), key=lambda t: t[0]),
        sorted(((p["width"], p) for p in pts if p["budget"] == 1), key=lambda t: t[0]),
    )


@register_check("gap_trend")
def _check_gap_trend(res: Results, c: dict) -> list[Verdict]:
    """The fitted trend of matched DyT's gap to RMSNorm in log2 tokens and log2 width, and where the width trend
    points at GPT-2 small's 768: a prediction, set beside the published anchors (their settings differ)."""
    by_tokens, by_width = _trend_series(res)
    out = []
    for what, series, at in (("tokens (width 64)", by_tokens, None), ("width (1x tokens)", by_width, 768)):
        if len(series) < 2:
            out.append(verdict(None, f"gap against {what}: fewer than two cells measured"))
            continue
        a, b = trend([x for x, _ in series], [p["gap"] for _, p in series])
        pts = ", ".join(f"{x:g}: {p['gap']:+.3f}" for x, p in series)
        text = f"matched DyT minus RMSNorm against {what}: {pts}; fitted {b:+.3f} nats per doubling"
        numbers = {"slope": b, "points": len(series)}
        if at is not None:
            pred = a + b * math.log2(at)
            numbers["prediction"] = pred
            text += (
                f"; extended to width {at}, a prediction of {pred:+.3f} at these tokens (published DyT minus "
                "LayerNorm at GPT-2 small: " + "; ".join(f"{v:+.3f}, {src}" for src, _, v in ANCHORS) + ")"
            )
        out.append(Verdict(None, text, numbers, finding=True))
    return out


@register_figure("gap_trend")
def _gap_trend(res: Results, path: Path, other: Results | None = None) -> Path | None:
    """Matched DyT's gap to RMSNorm against tokens (width 64) and against width (1x tokens), GPT-2 block with
    AdamW, each with a fitted line in log2; the width line is extended to 768 (GPT-2 small) as a prediction."""
    by_tokens, by_width = _trend_series(res)
    if len(by_tokens) + len(by_width) == 0:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, series, xlabel, extend in (
        (axes[0], by_tokens, "tokens (x the small preset's 256k)", None),
        (axes[1], by_width, "width (depth 4, 1x tokens)", 768),
    ):
        if not series:
            ax.axis("off")
            continue
        xs, ys = [x for x, _ in series], [p["gap"] for _, p in series]
        ax.errorbar(xs, ys, yerr=[p["spread"] for _, p in series], marker="o", capsize=3, label="measured")
        if len(xs) >= 2:
            a, b = trend(xs, ys)
            top = extend or max(xs)
            grid = [min(xs) * (top / min(xs)) ** (i / 40) for i in range(41)]
            ax.plot(grid, [a + b * math.log2(g) for g in grid], "--", color="gray", label=f"fit: {b:+.3f} per doubling")
            if extend:
                ax.plot([extend], [a + b * math.log2(extend)], "s", color="gray", label=f"prediction at {extend}")
                ax.plot(
                    [extend] * len(ANCHORS),
                    [v for *_, v in ANCHORS],
                    "x",
                    color="C3",
                    ms=8,
                    label="published DyT - LayerNorm, GPT-2 small (5-20B tokens)",
                )
        ax.axhline(0, color="black", lw=0.6)
        ax.set_xscale("log", base=2)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("DyT (match_rms) - RMSNorm, nats")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
