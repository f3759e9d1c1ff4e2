"""The phase experiment's part of the report: each run's predicted signal scale at init (from its config,
``normlab.lab.phase.predict``) against its final loss, the checks that read it, and the telemetry figure."""

from __future__ import annotations

import functools
import json
import math
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402

from normlab.lab.config import TrainConfig  # noqa: E402
from normlab.lab.phase import ESCAPE_THRESHOLD, predict  # noqa: E402
from normlab.lab.runs import ESCAPE_MARGIN  # noqa: E402
from normlab.report.checks import Verdict, register_check, seeded, verdict  # noqa: E402
from normlab.report.figures import register_figure  # noqa: E402
from normlab.report.results import Results  # noqa: E402

__all__ = ["phase_points", "sorted_fraction", "best_split"]

_MARKERS = {"dyt": "o", "derf": "s", "scaled_dyt": "^", "dyisru": "D", "dyt_hardtanh": "v", "rms_norm": "*"}


@functools.lru_cache(maxsize=4096)
def _predict(config_json: str) -> dict:
    cfg = TrainConfig.from_dict(json.loads(config_json))
    return predict(cfg.model, seed=cfg.seed)


def phase_points(res: Results) -> list[dict]:
    """One point per completed run: name, norm, seed, its prediction at init, final loss minus the attractor,
    and whether it escaped (ended ESCAPE_MARGIN below the unigram entropy)."""
    h, pts = res.entropy(), []
    for name, runs in res.groups.items():
        for r in runs:
            s, cfg = res.summary(r), res.config(r)
            if s.get("status") != "completed" or s.get("final_val_loss") is None or cfg is None or h is None:
                continue
            pred = _predict(json.dumps(cfg, sort_keys=True))
            gap = s["final_val_loss"] - h
            pts.append(
                {
                    "name": name,
                    "label": r["label"],
                    "norm": cfg["model"]["norm"],
                    "seed": r["seed"],
                    "gap": gap,
                    "escaped": gap <= -ESCAPE_MARGIN,
                    **pred,
                }
            )
    return pts


def sorted_fraction(pts: list[dict], key: str = "logit_gain", threshold: float = ESCAPE_THRESHOLD) -> float:
    """The fraction of runs on the predicted side: escaped iff ``key`` >= ``threshold``."""
    pts = [p for p in pts if not math.isnan(p[key])]
    return sum((p[key] >= threshold) == p["escaped"] for p in pts) / len(pts) if pts else math.nan


def best_split(pts: list[dict], key: str) -> tuple[float, float]:
    """The threshold on ``key`` that sorts the most runs, chosen after seeing them (an upper bound on what any
    boundary on that one quantity can do), and its fraction."""
    xs = sorted({p[key] for p in pts if not math.isnan(p[key])})
    cuts = [xs[0] - 1] + [(a + b) / 2 for a, b in zip(xs, xs[1:])] + [xs[-1] + 1] if xs else []
    best = max(((sorted_fraction(pts, key, c), c) for c in cuts), default=(math.nan, math.nan))
    return best[1], best[0]


# --------------------------------------------------------------------------
# checks
# --------------------------------------------------------------------------
@register_check("escapes")
def _check_escapes(res: Results, c: dict) -> list[Verdict]:
    """Each flagged run leaves the attractor on every seed; its gap to the baseline at the same budget."""
    h, base, out = res.entropy(), res.baseline(), []
    for n in res.flagged(c["where"]):
        vals = res.values(n)
        if not vals or h is None or base is None:
            out.append(verdict(None, f"{res.label(n)}: runs missing"))
            continue
        escaped = all(v <= h - ESCAPE_MARGIN for v in vals)
        text = (
            f"{c['what']}, {res.label(n)}: {statistics.fmean(vals):.3f} "
            f"({'escapes on every seed' if escaped else 'does not escape on every seed'}; escape step "
            f"{res.escape(n)}), {statistics.fmean(vals) - base:+.3f} from RMSNorm's {base:.3f}"
        )
        mean = statistics.fmean(vals)
        out.append(Verdict(escaped, text, {"loss": mean, "gap_to_baseline": mean - base}))
    return out


@register_check("same_fate")
def _check_same_fate(res: Results, c: dict) -> list[Verdict]:
    """The flagged runs share one fate (all escape or none does) and end within ``spread`` of each other."""
    h = res.entropy()
    means = {n: res.mean(n) for n in res.flagged(c["where"])}
    if h is None or not means or any(v is None for v in means.values()):
        return [verdict(None, f"{c['what']}: runs missing")]
    fates = {n: v <= h - ESCAPE_MARGIN for n, v in means.items()}
    span = max(means.values()) - min(means.values())
    text = (
        f"{c['what']}: "
        + ", ".join(f"{res.label(n)} {v:.3f}" for n, v in means.items())
        + f"; {'all escape' if all(fates.values()) else 'none escapes' if not any(fates.values()) else 'fates differ'}"
        f", span {span:.3f} nats"
    )
    ok = len(set(fates.values())) == 1 and span < c["spread"]
    return [Verdict(ok, text, {"span": span})]


@register_check("lower")
def _check_lower(res: Results, c: dict) -> list[Verdict]:
    """Run ``a`` ends more than ``margin`` below run ``b`` (beyond the spread over seeds)."""
    a, b = res.mean(c["a"]), res.mean(c["b"])
    if a is None or b is None:
        return [verdict(None, f"{c['what']}: runs missing")]
    text = f"{c['what']}: {res.label(c['a'])} {a:.3f} vs {res.label(c['b'])} {b:.3f}"
    return [seeded(res, a < b - c["margin"], b - a, [c["a"], c["b"]], text)]


@register_check("phase_sorts")
def _check_phase_sorts(res: Results, c: dict) -> list[Verdict]:
    """The predicted boundary (logit_gain >= ESCAPE_THRESHOLD) puts at least ``goal`` of the runs on the side
    they ended on; the dissection's alpha * RMS is reported beside it, at its best possible threshold."""
    pts = phase_points(res)
    if not pts:
        return [verdict(None, "phase map: no completed runs")]
    frac = sorted_fraction(pts)
    cut, best = best_split(pts, "alpha_rms")
    wrong = sorted({p["label"] for p in pts if (p["logit_gain"] >= ESCAPE_THRESHOLD) != p["escaped"]})
    text = (
        f"the predicted boundary (logits at init at least {ESCAPE_THRESHOLD:g} of RMSNorm's scale) puts "
        f"{frac:.0%} of {len(pts)} runs on the side they ended on (goal {c['goal']:.0%})"
        + (f"; on the wrong side: {', '.join(wrong)}" if wrong else "")
        + ". The dissection's alpha0 * RMS(block 0 input), even at its best threshold "
        + f"({cut:.3g}, chosen after the "
        f"fact), sorts {best:.0%}"
    )
    return [Verdict(frac >= c["goal"], text, {"fraction": frac, "alpha_rms_best": best, "runs": len(pts)})]


# --------------------------------------------------------------------------
# figures
# --------------------------------------------------------------------------
@register_figure("phase")
def _phase_map(res: Results, path: Path, other: Results | None = None) -> Path | None:
    """Two panels, one marker per run: final loss minus the attractor against the dissection's alpha * RMS, and
    against the logits' scale at init; the predicted boundary on the second."""
    pts = phase_points(res)
    if not pts:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6), sharey=True)
    panels = (
        ("alpha_rms", "alpha0 x RMS(block 0 input) at init (the dissection's quantity)", None),
        ("logit_gain", "logit std at init / RMSNorm's at GPT-2 init (predicted)", ESCAPE_THRESHOLD),
    )
    for ax, (key, xlabel, boundary) in zip(axes, panels):
        for norm in sorted({p["norm"] for p in pts}):
            sub = [p for p in pts if p["norm"] == norm and not math.isnan(p[key])]
            ax.scatter(
                [p[key] for p in sub],
                [p["gap"] for p in sub],
                marker=_MARKERS.get(norm, "x"),
                s=36,
                alpha=0.75,
                label=norm,
                edgecolors="k",
                linewidths=0.4,
            )
        ax.axhline(-ESCAPE_MARGIN, c="gray", ls=":", lw=1, label=f"escaped: {ESCAPE_MARGIN} below the attractor")
        ax.axhline(0, c="k", lw=0.8)
        if boundary is not None:
            ax.axvline(boundary, c="tab:red", ls="--", lw=1.2, label=f"predicted boundary ({boundary:g})")
            frac = sorted_fraction(pts)
            ax.set_title(f"by the logits' scale: the predicted line sorts {frac:.0%} of {len(pts)} runs", fontsize=10)
        else:
            cut, best = best_split(pts, key)
            ax.set_title(f"by the input's scale: the best line, drawn after the fact, sorts {best:.0%}", fontsize=10)
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("final val loss - unigram entropy (nats; below 0: it learned)")
    axes[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle(f"When does a point-wise norm train? One marker per run and seed ({res.profile or 'default'} budget)")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


@register_figure("mechanism")
def _mechanism(res: Results, path: Path, other: Results | None = None) -> Path | None:
    """The mechanism's telemetry against steps for the TOML's ``mechanism`` runs (seed 0): validation loss,
    alpha * RMS and the saturated fraction at block 0's attention norm, and block 0's attention entropy."""
    names = [n for n in res.exp.get("mechanism", []) if n in res.groups]
    site = "blocks.0.norm_attn"
    panels = (("val_loss", "validation loss"), (f"rms_out/{site}", "RMS of the norm's output, block 0"),
              (f"alpha_rms/{site}", "alpha x RMS(input), block 0"),
              ("attn_entropy/0", "attention entropy / uniform, block 0"))  # fmt: skip
    rows = {n: res.rows(res.groups[n][0]) for n in names}
    if not any(rows.values()):
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(16, 3.6))
    for ax, (key, title) in zip(axes, panels):
        for n in names:
            pts = [(r["step"], r[key]) for r in rows[n] if r.get(key) is not None]
            if pts:
                ax.plot(*zip(*pts), "o-", ms=3, label=res.label(n))
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    h = res.entropy()
    if h is not None:
        axes[0].axhline(h, c="k", ls="--", lw=1, label="unigram entropy")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
