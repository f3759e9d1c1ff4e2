"""The figures an experiment's TOML names (``figures = [...]``), each drawn from its runs."""

from __future__ import annotations

import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from normlab.report.results import PAPER_ATTRACTOR, PAPER_RMS, Results, fmt, frac  # noqa: E402
from normlab.table import format_table  # noqa: E402

__all__ = ["FIGURES", "table", "register_figure"]


def table(res: Results) -> str:
    exp, h = res.exp, res.entropy()
    rms = res.baseline()
    metrics = exp.get("metrics", ["final_val_loss"])
    papered = any("paper" in runs[0]["meta"] for runs in res.groups.values())
    if metrics != ["final_val_loss"]:  # a column of the dissection's beside each of ours, where a run has its number
        names = [(f"{m} (the dissection)", f"{m} (ours)") if papered else (m,) for m in metrics]
        headers = ["run"] + [h for pair in names for h in pair] + ["escape step", "status"]
        rows = []
        for n, runs in res.groups.items():
            paper = runs[0]["meta"].get("paper", {})
            cells = []
            for m in metrics:
                ours = res.cell(n, m, "{:.4g}")
                cells += [fmt(paper.get(m), "{:g}"), ours] if papered else [ours]
            rows.append([runs[0]["label"], *cells, res.escape(n), res.status(n)])
        return format_table(headers, rows, markdown=True)
    if not papered:  # normlab's own question: no paper column
        rows = [[runs[0]["label"], res.cell(n), res.escape(n), res.status(n)] for n, runs in res.groups.items()]
        return format_table(["run", "val loss", "escape step", "status"], rows, markdown=True)
    headers = ["run", "the dissection: loss", "the dissection: frac", "ours: val loss", "ours: frac", "escape step",
               "status"]  # fmt: skip
    rows = []
    for n, runs in res.groups.items():
        paper = runs[0]["meta"].get("paper")
        pf = frac(paper, PAPER_RMS, PAPER_ATTRACTOR) if isinstance(paper, (int, float)) else None
        rows.append(
            [
                runs[0]["label"],
                fmt(paper, "{:g}") if not isinstance(paper, str) else paper,
                fmt(pf),
                res.cell(n),
                fmt(frac(res.mean(n), rms, h)),
                res.escape(n),
                res.status(n),
            ]
        )
    return format_table(headers, rows, markdown=True)


def _tokens_per_step(res: Results, run: dict) -> int:
    cfg = res.config(run) or {}
    return cfg.get("batch_size", 1) * cfg.get("model", {}).get("context", 1)


def _loss_curves(res: Results, path: Path, other: Results | None = None) -> Path | None:
    """Validation loss against tokens seen, seed 0 of each run; with ``other`` (another budget), its curves
    dashed in the same colours."""
    fig, ax = plt.subplots(figsize=(7, 4.2))
    drawn = False
    for i, (name, runs) in enumerate(res.groups.items()):
        for r2, style in ((res, "-"), (other, "--")):
            if r2 is None or name not in r2.groups:
                continue
            run = r2.groups[name][0]
            rows = [r for r in r2.rows(run) if "val_loss" in r]
            if rows:
                per = _tokens_per_step(r2, run)
                label = runs[0]["label"] + (f" ({r2.profile})" if other is not None else "")
                ax.plot(
                    [r["step"] * per for r in rows],
                    [r["val_loss"] for r in rows],
                    style,
                    marker="o",
                    ms=2,
                    color=plt.cm.tab20(i % 20),
                    label=label,
                )
                drawn = True
    if not drawn:
        plt.close(fig)
        return None
    h = res.entropy()
    if h is not None:
        ax.axhline(h, c="k", ls="--", lw=1, label=f"unigram entropy {h:.2f} (attractor)")
    ax.set_xscale("log" if other is not None else "linear")
    ax.set_xlabel("tokens seen")
    ax.set_ylabel("validation loss (nats/byte)")
    ax.set_title(res.exp["title"] + " (seed 0)")
    if other is not None or len(ax.get_legend_handles_labels()[0]) > 6:  # many curves: the legend beside the plot,
        ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # where it hides none of them
    else:
        ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def _dose_response(res: Results, path: Path, other: Results | None = None) -> Path | None:
    pts = sorted((r[0]["meta"]["lam"], res.mean(n), r[0]["meta"].get("paper")) for n, r in res.groups.items())
    if any(p[1] is None for p in pts):
        return None
    fig, ax1 = plt.subplots(figsize=(6.5, 4))
    lam = [p[0] for p in pts]
    ax1.plot(lam, [p[1] for p in pts], "o-", c="tab:blue", label="ours")
    ax1.set_xscale("symlog", linthresh=0.01)
    ax1.set_xlabel("coupling strength lambda")
    ax1.set_ylabel("ours: validation loss", color="tab:blue")
    ax2 = ax1.twinx()
    ax2.plot(lam, [p[2] for p in pts], "s--", c="tab:red", label="the dissection")
    ax2.set_ylabel("the dissection: final loss", color="tab:red")
    h = res.entropy()
    if h is not None:
        ax1.axhline(h, c="tab:blue", ls=":", lw=1)
    ax1.set_title("Coupling dose-response (dotted: our unigram entropy)")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def _rank_bars(res: Results, path: Path, other: Results | None = None) -> Path | None:
    greater = [c for c in res.exp.get("checks", []) if c["kind"] == "greater"]  # the TOML names the pair
    if not greater:
        return None
    names = [greater[0]["a"], greater[0]["b"]]
    ours = {c["metric"]: [res.mean(n, c["metric"]) for n in names] for c in greater}
    if any(v is None for vs in ours.values() for v in vs):
        return None
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.5))
    paper = {m: [res.meta(n)["paper"][m] for n in names] for m in ours}
    for ax, (m, vals) in zip(axes, ours.items()):
        ax.bar([0, 1], vals, color=["tab:blue", "tab:orange"])
        ax.set_xticks([0, 1], [res.label(n) for n in names])
        ax.set_title(f"{m}\n(the dissection at width 1024: {paper[m][0]} vs {paper[m][1]})", fontsize=9)
        ax.set_ylabel("effective rank (ours)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _init_value(res: Results, run: dict) -> float | None:
    cfg = res.config(run)
    if cfg is None:
        return None
    kw = cfg["model"]["norm_kwargs"]
    return kw.get("alpha_init", kw.get("beta_init"))


def _init_sensitivity(res: Results, path: Path, other: Results | None = None) -> Path | None:
    """Final loss against the initial value, one panel per family (DyT, Derf alpha0; DyISRU beta0), log x axis."""
    fams = {"dyt": "DyT: alpha0", "derf": "Derf: alpha0", "dyisru": "DyISRU: beta0"}
    pts = {f: [] for f in fams}
    for n, runs in res.groups.items():
        f = runs[0]["meta"].get("family")
        vals = res.values(n)
        if f in pts and vals and (x := _init_value(res, runs[0])) is not None:
            sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
            pts[f].append((x, statistics.fmean(vals), sd, bool(runs[0]["meta"].get("beta_rms_gain"))))
    if not any(pts.values()):
        return None
    fig, axes = plt.subplots(1, len(fams), figsize=(5 * len(fams), 3.8), sharey=True)
    for ax, (f, title) in zip(axes, fams.items()):
        rows = sorted(pts[f])
        if rows:
            ax.errorbar([r[0] for r in rows], [r[1] for r in rows], yerr=[r[2] for r in rows], marker="o", capsize=3)
            for r in rows:
                if r[3]:  # the run whose beta0 gives RMSNorm's gain (its TOML sets beta_rms_gain)
                    ax.annotate(
                        "C sigma0^2\n(RMSNorm's gain)",
                        (r[0], r[1]),
                        fontsize=7,
                        xytext=(6, 0),
                        textcoords="offset points",
                    )
        ax.set_xscale("log")
        ax.set_xlabel(title)
        refs = [res.exp.get("baseline"), *res.flagged("reference")]  # the TOML's baseline and reference runs
        for n, c in zip(refs, ("k", "tab:green", "tab:purple")):
            v = res.mean(n) if n in res.groups else None
            if v is not None:
                ax.axhline(v, c=c, ls="--", lw=1, label=f"{n}: {v:.3f}")
        h = res.entropy()
        if h is not None:
            ax.axhline(h, c="gray", ls=":", lw=1, label=f"unigram entropy {h:.2f}")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("validation loss (mean ± std over seeds)")
    axes[-1].legend(fontsize=7)
    fig.suptitle("Init sensitivity")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


FIGURES = {"loss": _loss_curves, "dose": _dose_response, "rank": _rank_bars, "init": _init_sensitivity}


def register_figure(name: str):
    """Decorator: a figure that experiments' TOMLs may name (``figures = [...]``)."""

    def deco(fn):
        FIGURES[name] = fn
        return fn

    return deco
