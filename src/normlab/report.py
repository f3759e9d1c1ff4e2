"""``normlab report``: REPORT.md with tables and PNG figures from a sweep root.

For every experiment: a table with the seed's published number beside ours (the same
metric, at the scale we ran), every number linked to the run directory that produced it,
and a verdict on the seed's claim, stated plainly when ours disagrees. Losses at different
scales and vocabularies are not comparable in absolute terms (seed 003's attractor is 7.54
nats over GPT-2 tokens; ours is the byte-level unigram entropy, ~3.33), so each loss is also
placed on the scale from RMSNorm (0) to the attractor (1):

    frac = (loss - loss_RMSNorm) / (unigram_entropy - loss_RMSNorm)

and the paper's numbers are placed on the same scale with its own RMSNorm (3.21) and attractor (7.54).
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from normlab._table import format_table  # noqa: E402
from normlab.lab.runs import RunFolder, escape_step, read_summary  # noqa: E402

PAPER_RMS, PAPER_ATTRACTOR = 3.21, 7.54
__all__ = ["write_report"]


# --------------------------------------------------------------------------
# reading results
# --------------------------------------------------------------------------
def _metrics(run_dir: Path) -> list[dict]:
    return RunFolder(run_dir).metrics()


def _value(run_dir: Path, metric: str) -> float | None:
    s = read_summary(run_dir) or {}
    if s.get("status") != "completed":
        return None
    if metric in s and s[metric] is not None:
        return float(s[metric])
    rows = [r for r in _metrics(run_dir) if metric in r]
    return float(rows[-1][metric]) if rows else None


class Results:
    """Runs of one experiment grouped by name: status, values per seed, links."""

    def __init__(self, exp: dict, root: Path, profile: str = "") -> None:
        self.exp, self.root, self.profile = exp, root, profile
        self.groups: dict[str, list[dict]] = {}
        for r in exp["runs"]:
            self.groups.setdefault(r["name"], []).append(r)

    def run_dir(self, run: dict) -> Path:
        return self.root / "runs" / run["run_id"]

    def values(self, name: str, metric: str = "final_val_loss") -> list[float]:
        return [v for r in self.groups.get(name, []) if (v := _value(self.run_dir(r), metric)) is not None]

    def mean(self, name: str, metric: str = "final_val_loss") -> float | None:
        v = self.values(name, metric)
        return statistics.fmean(v) if v else None

    def spread(self, *names: str, metric: str = "final_val_loss") -> float:
        """The largest standard deviation over seeds among ``names`` (0 with one seed each)."""
        sds = [statistics.stdev(v) for n in names if len(v := self.values(n, metric)) > 1]
        return max(sds, default=0.0)

    def status(self, name: str) -> str:
        sts = [(read_summary(self.run_dir(r)) or {}).get("status", "missing") for r in self.groups[name]]
        return sts[0] if len(set(sts)) == 1 else ", ".join(sts)

    def baseline(self, metric: str = "final_val_loss") -> float | None:
        """The mean of the experiment's baseline run (its TOML's ``baseline``), the reference of *frac*."""
        name = self.exp.get("baseline")
        return self.mean(name, metric) if name in self.groups else None

    def label(self, name: str) -> str:
        return self.groups[name][0]["label"]

    def meta(self, name: str) -> dict:
        return self.groups[name][0]["meta"]

    def flagged(self, flag: str) -> list[str]:
        """The runs whose TOML entry sets ``flag`` (e.g. pointwise = true)."""
        return [n for n in self.groups if self.meta(n).get(flag)]

    def entropy(self) -> float | None:
        for runs in self.groups.values():
            for r in runs:
                s = read_summary(self.run_dir(r)) or {}
                if "unigram_entropy" in s:
                    return s["unigram_entropy"]
        return None

    def escape(self, name: str) -> str:
        """Each seed's escape step (the first evaluation 0.1 nats below the unigram entropy), or 'never'."""
        h, steps = self.entropy(), []
        for r in self.groups[name]:
            s = read_summary(self.run_dir(r)) or {}
            if s.get("status") != "completed":
                steps.append("-")
                continue
            step = s["escape_step"] if "escape_step" in s else escape_step(_metrics(self.run_dir(r)), h)
            steps.append("never" if step is None else str(step))
        return ", ".join(steps)

    def cell(self, name: str, metric: str = "final_val_loss", fmt: str = "{:.3f}") -> str:
        """'2.451 ± 0.012' linked to the run directories (one link per seed)."""
        runs = self.groups[name]
        vals = self.values(name, metric)
        status = self.status(name)
        links = [f"[s{r['seed']}](runs/{r['run_id']}/)" for r in runs]
        if not vals:
            return f"**{status}** ({', '.join(links)})"
        text = fmt.format(statistics.fmean(vals))
        if len(vals) > 1:
            text += " ± " + fmt.format(statistics.stdev(vals))
        if len(runs) == 1:
            return f"[{text}](runs/{runs[0]['run_id']}/)"
        return f"{text} ({', '.join(links)})"


def _frac(loss, rms, top):
    """Position of ``loss`` from RMSNorm (0) to the attractor (1); None when RMSNorm is not below the attractor."""
    if loss is None or rms is None or top is None or top - rms < 0.1:
        return None
    return (loss - rms) / (top - rms)


def _untrained(res: Results) -> str | None:
    """Why the claims cannot be judged, when the baseline itself has not learned past the attractor."""
    h, base = res.entropy(), res.baseline()
    if h is not None and base is not None and base > h - 0.1:
        return (f"RMSNorm's loss {base:.3f} is not below the unigram entropy {h:.3f}: at this scale nothing has "
                "trained past the attractor, so the claims cannot be judged (use the default or full profile)")
    return None


def _fmt(v, spec="{:.2f}"):
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else spec.format(v)


# --------------------------------------------------------------------------
# claims: each returns lines of plain verdicts
# --------------------------------------------------------------------------
def _verdict(ok: bool | None, text: str) -> str:
    return {True: "**agrees**", False: "**disagrees**", None: "**inconclusive**"}[ok] + f": {text}"


def _seeded(res: Results, ok: bool, diff: float, names, text: str, metric: str = "final_val_loss") -> str:
    """A verdict only when the difference it rests on exceeds the spread over seeds; else inconclusive."""
    spread = res.spread(*names, metric=metric)
    if spread > 0 and abs(diff) <= spread:
        return _verdict(None, f"{text}; the difference {abs(diff):.3g} is within the spread over seeds {spread:.3g}")
    return _verdict(ok, text)


def _check_band(res: Results, c: dict) -> list[str]:
    vals = [v for n in res.flagged(c["where"]) if (v := res.mean(n)) is not None]
    h = res.entropy()
    if not vals or h is None:
        return [_verdict(None, f"{c['what']}: runs missing")]
    spread, dist = max(vals) - min(vals), max(abs(v - h) for v in vals)
    return [_verdict(spread < c["spread"] and dist < c["near_entropy"], f"{c['what']} span {spread:.3f} nats and "
                     f"sit at most {dist:.3f} from the unigram entropy {h:.3f}")]  # fmt: skip


def _check_below(res: Results, c: dict) -> list[str]:
    vals = [v for n in res.flagged(c["where"]) if (v := res.mean(n)) is not None]
    base = res.baseline()
    if not vals or base is None:
        return [_verdict(None, f"{c['what']}: runs missing")]
    names = [res.exp["baseline"], *res.flagged(c["where"])]
    return [_seeded(res, base < min(vals) - c["margin"], min(vals) - base, names,
                    f"{res.label(res.exp['baseline'])} reaches {base:.3f}, {min(vals) - base:.2f} below {c['what']}")]


def _check_status(res: Results, c: dict) -> list[str]:
    got = res.status(c["run"])
    return [_verdict(got == c["status"], f"{res.label(c['run'])}: status {got} (the seed: {c['status']}), "
                     f"loss {_fmt(res.mean(c['run']), '{:.3f}')}")]  # fmt: skip


def _check_gap_shrinks(res: Results, c: dict) -> list[str]:
    (a1, b1), (a2, b2) = c["pairs"]
    g1, g2 = _diff(res.mean(a1), res.mean(b1)), _diff(res.mean(a2), res.mean(b2))
    if g1 is None or g2 is None:
        return [_verdict(None, f"{c['what']}: runs missing")]
    p1, p2 = (res.meta(a)["paper"] - res.meta(b)["paper"] for a, b in c["pairs"])
    n1, n2 = c["names"]
    return [_seeded(res, g2 < c["ratio"] * g1, g1 - g2, [a1, b1, a2, b2], f"{c['what']} is {g1:.3f} {n1} vs "
                    f"{g2:.3f} {n2} (seed 003: {p1:.2f} vs {p2:.2f})")]  # fmt: skip


def _check_fraction(res: Results, c: dict) -> list[str]:
    """Each run's place between the baseline (0) and the attractor (1): below ``works_below`` if it works in
    the seed, above ``fails_above`` if it fails there."""
    out, base, h = [], res.baseline(), res.entropy()
    for n in res.groups:
        f = _frac(res.mean(n), base, h)
        if n == res.exp["baseline"] or f is None:
            continue
        works = res.meta(n).get("works", False)
        ok = f < c["works_below"] if works else f > c["fails_above"]
        out.append(_seeded(res, ok, res.mean(n) - base, [n, res.exp["baseline"]], f"{res.label(n)}: "
                           f"{'works' if works else 'fails'} in the seed; here it is at {f:.2f} of the way from "
                           "RMSNorm to the attractor"))  # fmt: skip
    return out


def _check_monotone(res: Results, c: dict) -> list[str]:
    by = {res.meta(n)[c["by"]]: res.mean(n) for n in res.groups}
    if any(v is None for v in by.values()):
        return [_verdict(None, "runs missing")]
    path = [by[k] for k in c["order"]]
    ok = path[0] == min(by.values()) and all(a < b for a, b in zip(path, path[1:]))
    text = ", ".join(f"{c.get('symbol', c['by'])}={k:g}: {by[k]:.3f}" for k in sorted(by))
    step = min(abs(b - a) for a, b in zip(path, path[1:]))  # the smallest step the ordering rests on
    return [_seeded(res, ok, step, list(res.groups), f"{text}; the seed: {c['seed']}")]


def _check_greater(res: Results, c: dict) -> list[str]:
    m, a, b = c["metric"], res.mean(c["a"], c["metric"]), res.mean(c["b"], c["metric"])
    if a is None or b is None:
        return []
    pa, pb = res.meta(c["a"])["paper"][m], res.meta(c["b"])["paper"][m]
    return [_seeded(res, a > b, a - b, [c["a"], c["b"]], f"{m}: {res.label(c['a'])} {a:.1f} vs {res.label(c['b'])} "
                    f"{b:.1f} (seed 003 at width 1024: {pa:g} vs {pb:g})", metric=m)]  # fmt: skip


def _check_orthogonal(res: Results, c: dict) -> list[str]:
    """|a| below ``below`` and |b| more than ``factor`` times |a|: a gradient orthogonal to its input in a only."""
    m, a, b = c["metric"], res.mean(c["a"], c["metric"]), res.mean(c["b"], c["metric"])
    if a is None or b is None:
        return []
    pa, pb = res.meta(c["a"])["paper"][m], res.meta(c["b"])["paper"][m]
    return [_verdict(abs(a) < c["below"] and abs(b) > c["factor"] * abs(a), f"{c['what']}: {res.label(c['a'])} "
                     f"{a:.2e} vs {res.label(c['b'])} {b:.2e} (seed: {pa:.4f} vs {pb:.4f})")]  # fmt: skip


def _check_families(res: Results, c: dict) -> list[str]:
    """Findings with no published number: each family's best and worst init, and the best of two families."""
    fam = {}
    for n in res.groups:
        if (f := res.meta(n).get("family")) and res.mean(n) is not None:
            fam.setdefault(f, []).append((res.mean(n), res.label(n)))
    out = [f"{f}: best {min(rows)[0]:.3f} ({min(rows)[1]}), worst {max(rows)[0]:.3f} ({max(rows)[1]}); "
           f"init sensitivity (range over inits) {max(rows)[0] - min(rows)[0]:.3f} nats" for f, rows in fam.items()]
    a, b = c["compare"]
    if a in fam and b in fam:
        va, vb = min(fam[a])[0], min(fam[b])[0]
        out.append(f"best {c['names'][0]} vs best {c['names'][1]}: {va:.3f} vs {vb:.3f} "
                   f"({c['names'][0] if va < vb else c['names'][1]} ahead by {abs(va - vb):.3f}); "
                   f"RMSNorm {_fmt(res.baseline(), '{:.3f}')}")  # fmt: skip
    return ["finding (no published number to compare): " + line for line in out]


CHECKS = {"band": _check_band, "below": _check_below, "status": _check_status, "gap_shrinks": _check_gap_shrinks,
          "fraction": _check_fraction, "monotone": _check_monotone, "greater": _check_greater,
          "orthogonal": _check_orthogonal, "families": _check_families}  # fmt: skip


def _claims(res: Results) -> list[str]:
    """The verdicts of the experiment's TOML ``[[checks]]``, each applied by its kind."""
    if res.exp.get("guard", True) and (why := _untrained(res)):
        return [_verdict(None, why)]
    unknown = [c["kind"] for c in res.exp.get("checks", []) if c["kind"] not in CHECKS]
    if unknown:
        raise ValueError(f"experiment {res.exp['name']}: unknown check kind {unknown[0]!r}; known: {', '.join(CHECKS)}")
    return [line for c in res.exp.get("checks", []) for line in CHECKS[c["kind"]](res, c)]


def _diff(a, b):
    return None if a is None or b is None else a - b


# --------------------------------------------------------------------------
# tables and figures
# --------------------------------------------------------------------------
def _table(res: Results) -> str:
    exp, h = res.exp, res.entropy()
    rms = res.baseline()
    metrics = exp.get("metrics", ["final_val_loss"])
    if metrics != ["final_val_loss"]:
        headers = ["run"] + [h for m in metrics for h in (f"{m} (seed 003)", f"{m} (ours)")] + ["escape step",
                                                                                                  "status"]
        rows = []
        for n, runs in res.groups.items():
            paper = runs[0]["meta"].get("paper", {})
            cells = []
            for m in metrics:
                cells += [_fmt(paper.get(m), "{:g}"), res.cell(n, m, "{:.4g}")]
            rows.append([runs[0]["label"], *cells, res.escape(n), res.status(n)])
        return format_table(headers, rows, markdown=True)
    headers = ["run", "seed 003 loss", "seed 003 frac", "ours: val loss", "ours: frac", "escape step", "status"]
    rows = []
    for n, runs in res.groups.items():
        paper = runs[0]["meta"].get("paper")
        pf = _frac(paper, PAPER_RMS, PAPER_ATTRACTOR) if isinstance(paper, (int, float)) else None
        rows.append([runs[0]["label"], _fmt(paper, "{:g}") if not isinstance(paper, str) else paper, _fmt(pf),
                     res.cell(n), _fmt(_frac(res.mean(n), rms, h)), res.escape(n), res.status(n)])  # fmt: skip
    return format_table(headers, rows, markdown=True)


def _tokens_per_step(res: Results, run: dict) -> int:
    cfg = RunFolder(res.run_dir(run)).config() or {}
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
            rows = [r for r in _metrics(r2.run_dir(run)) if "val_loss" in r]
            if rows:
                per = _tokens_per_step(r2, run)
                label = runs[0]["label"] + (f" ({r2.profile})" if other is not None else "")
                ax.plot([r["step"] * per for r in rows], [r["val_loss"] for r in rows], style, marker="o", ms=2,
                        color=plt.cm.tab20(i % 20), label=label)  # fmt: skip
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
    if other is not None:  # twice the curves: the legend goes beside the plot
        ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
        ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def _dose_response(res: Results, path: Path) -> Path | None:
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
    ax2.plot(lam, [p[2] for p in pts], "s--", c="tab:red", label="seed 003")
    ax2.set_ylabel("seed 003: final loss", color="tab:red")
    h = res.entropy()
    if h is not None:
        ax1.axhline(h, c="tab:blue", ls=":", lw=1)
    ax1.set_title("Coupling dose-response (dotted: our unigram entropy)")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def _rank_bars(res: Results, path: Path) -> Path | None:
    names = ["rms_norm", "rms_detached"]
    ours = {m: [res.mean(n, m) for n in names] for m in ("erank_attn_proj", "erank_mlp_proj")}
    if any(v is None for vs in ours.values() for v in vs):
        return None
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.5))
    paper = {m: [res.meta(n)["paper"][m] for n in names] for m in ours}
    for ax, (m, vals) in zip(axes, ours.items()):
        ax.bar([0, 1], vals, color=["tab:blue", "tab:orange"])
        ax.set_xticks([0, 1], ["RMSNorm", "detached"])
        ax.set_title(f"{m}\n(seed 003 at width 1024: {paper[m][0]} vs {paper[m][1]})", fontsize=9)
        ax.set_ylabel("effective rank (ours)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _init_value(res: Results, run: dict) -> float | None:
    cfg = RunFolder(res.run_dir(run)).config()
    if cfg is None:
        return None
    kw = cfg["model"]["norm_kwargs"]
    return kw.get("alpha_init", kw.get("beta_init"))


def _init_sensitivity(res: Results, path: Path) -> Path | None:
    """Final loss against the initial value, one panel per family (DyT, Derf alpha0; DyISRU beta0), log x axis."""
    fams = {"dyt": "DyT: alpha0", "derf": "Derf: alpha0", "dyisru": "DyISRU: beta0"}
    pts = {f: [] for f in fams}
    for n, runs in res.groups.items():
        f = runs[0]["meta"].get("family")
        vals = res.values(n)
        if f in pts and vals and (x := _init_value(res, runs[0])) is not None:
            sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
            pts[f].append((x, statistics.fmean(vals), sd, runs[0]["label"]))
    if not any(pts.values()):
        return None
    fig, axes = plt.subplots(1, len(fams), figsize=(5 * len(fams), 3.8), sharey=True)
    for ax, (f, title) in zip(axes, fams.items()):
        rows = sorted(pts[f])
        if rows:
            ax.errorbar([r[0] for r in rows], [r[1] for r in rows], yerr=[r[2] for r in rows], marker="o", capsize=3)
            for r in rows:
                if "C *" in r[3]:
                    ax.annotate("C sigma0^2\n(RMSNorm's gain)", (r[0], r[1]), fontsize=7, xytext=(6, 0),
                                textcoords="offset points")  # fmt: skip
        ax.set_xscale("log")
        ax.set_xlabel(title)
        for n, c in (("rms_norm", "k"), ("eln_b4", "tab:green")):
            v = res.mean(n)
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


# --------------------------------------------------------------------------
# theory section
# --------------------------------------------------------------------------
def _pm(stats: dict, q: str, f: str = "{:.3g}") -> str:
    return f"{f.format(stats[q]['mean'])} ± {f.format(stats[q]['std'])}"


def _theory_section(root: Path) -> list[str]:
    p = root / "theory" / "theory.json"
    if not p.exists():
        return ["## Theory\n", "_Theory checks were not run for this root (`normlab reproduce` runs them)._\n"]
    t = json.loads(p.read_text())
    source = ("Every number in this section comes from [theory/theory.json](theory/theory.json) "
              "(`normlab.reproduce.run_theory`); `normlab simulate`, `normlab jacobian` and `normlab gain` "
              "recompute each on its own.\n")  # fmt: skip
    out = ["## Theory (seeds 000-003)\n", source]
    out.append("### Outlier simulation and fits (seed 000 Sec. 4, seed 001 Sec. 4)\n")
    rows = []
    for key, label in (("rms_norm", "RMSNorm data"), ("layer_norm", "LayerNorm data")):
        st = t["simulate"][key]["stats"]
        rows.append([label, _pm(st, "alpha", "{:.4f}"), _pm(st, "beta", "{:.1f}"), _pm(st, "dyt_mean_abs_residual"),
                     _pm(st, "dyisru_mean_abs_residual")])  # fmt: skip
    rows.append(["seed 000/001 (one sample)", "0.049", "301.1", "0.33", "< 0.01"])
    n = t["simulate"]["rms_norm"]["n_seeds"]
    out.append(format_table([f"data (mean ± std over {n} seeds)", "DyT alpha", "DyISRU beta", "DyT mean |res|",
                             "DyISRU mean |res|"], rows, markdown=True))  # fmt: skip
    ln_max = t["simulate"]["layer_norm"]["stats"]["dyisru_mean_abs_residual"]["max"]
    out.append("")
    out.append(_verdict(t["simulate"]["rms_norm"]["stats"]["dyisru_mean_abs_residual"]["max"] < 0.01,
                        "on RMSNorm data DyISRU is exact (Theorem 3), DyT is off by ~0.33"))  # fmt: skip
    out.append("")
    out.append(_verdict(ln_max < 0.01, f"on LayerNorm data DyISRU's mean |residual| stays < 0.01 on every seed "
                        f"(worst seed: {ln_max:.4f})"))  # fmt: skip
    out.append("\n![outlier fit](theory/outlier_fit_rms_norm.png)\n")
    out.append("![outlier fit, LayerNorm](theory/outlier_fit_layer_norm.png)\n")
    out.append("### Jacobian norms at init (seed 003, std 0.02, gamma = 1)\n")
    seed = {(1024, "rms_norm"): "1602 / 50 / 1601", (2048, "rms_norm"): "2259 / 50 / 2258",
            (1024, "dyt"): "32 / 0 / 32", (2048, "dyt"): "45 / 0 / 45"}  # fmt: skip
    rows = [[r["width"], r["norm"], f"{r['diag']:.1f} / {r['coupling']:.1f} / {r['total']:.1f}",
             seed.get((r["width"], r["norm"]), "-")] for r in t["jacobian"]]  # fmt: skip
    out.append(format_table(["width", "norm", "ours: diag / coupling / total", "seed 003"], rows, markdown=True))
    out.append("\n### Forward gain (seed 003 Theorems 1-2)\n\n![gain](theory/gain.png)\n")
    return out


# --------------------------------------------------------------------------
FIGURES = {"loss": _loss_curves, "dose": _dose_response, "rank": _rank_bars, "init": _init_sensitivity}


def _compare_index(compare: str | Path | None) -> dict:
    if compare is None:
        return {}
    path = Path(compare) / "index.json"
    if not path.exists():
        raise FileNotFoundError(f"--compare {compare}: no index.json there (run `normlab reproduce` for it first)")
    return json.loads(path.read_text())


def write_report(root: str | Path, *, elapsed_s: float | None = None, compare: str | Path | None = None) -> Path:
    """Write <root>/REPORT.md (and <root>/figures/*.png); returns the path.

    With ``compare`` (the root of the same experiments at another budget), each verdict also states the
    verdict there, and the loss curves of both budgets share one figure against tokens seen.
    """
    other_index = _compare_index(compare)
    others = {e["name"]: e for e in other_index.get("experiments", [])}
    import torch

    root = Path(root)
    index_path = root / "index.json"
    if not index_path.exists():
        hint = f"run `normlab sweep` or `normlab reproduce` with --root {root}"
        raise FileNotFoundError(f"{index_path} not found: {hint}")
    index = json.loads(index_path.read_text())
    figs = root / "figures"
    figs.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    lines = [
        "# normlab reproduction report\n",
        f"Profile `{index['profile']}`; machine: {platform.platform()}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPU cores, {device}; torch {torch.__version__}."
        + (f" Total time: {elapsed_s / 60:.1f} min." if elapsed_s else ""),
        "",
        "Every number links to its run directory (config.json, version.json, metrics.jsonl, summary.json). "
        "Seed 003 trained 360M-parameter GPTs on FineWeb-Edu (attractor 7.54 nats); ours are small byte-level "
        "models on Shakespeare (attractor = unigram entropy, ~3.33 nats). *frac* places a loss between "
        "RMSNorm (0) and the attractor (1), for the seed and for us, so the structure of the tables can be "
        "compared. *escape step* is the first evaluation at which a run's validation loss is 0.1 nats below "
        "the unigram entropy (it has left the attractor), or never. A disagreement at this scale is a finding, "
        "not a failure.\n",
    ]  # fmt: skip
    lines += _theory_section(root)
    for exp in index["experiments"]:
        res = Results(exp, root, index["profile"])
        other = Results(others[exp["name"]], Path(compare), other_index["profile"]) if exp["name"] in others else None
        lines.append(f"## {exp['title']}\n")
        lines.append(f"Source: {exp['source']}. Claim: *{exp['claim']}*.\n")
        lines.append(_table(res))
        lines.append("")
        claims = _claims(res)
        there = _claims(other) if other is not None else []
        if len(there) == len(claims):  # the same checks at the other budget, line by line
            claims = [f"{c} [at `{other.profile}`: {t.split(':')[0].strip('*')}]" if c.startswith("**") else c
                      for c, t in zip(claims, there)]  # fmt: skip
        lines += [f"- {c}" for c in claims]
        lines.append("")
        for fig_name in exp.get("figures", ["loss"]):  # the TOML names its figures
            fn = FIGURES[fig_name]
            p = fn(res, figs / f"{exp['name']}_{fig_name}.png", other) if fn is _loss_curves else \
                fn(res, figs / f"{exp['name']}_{fig_name}.png")  # fmt: skip
            if p:
                lines.append(f"![{exp['name']} {fig_name}](figures/{p.name})\n")
    out = root / "REPORT.md"
    out.write_text("\n".join(lines) + "\n")
    return out
