"""The report's theory section, read from <root>/theory/theory.json (``normlab.reproduce.run_theory``)."""

from __future__ import annotations

import json
from pathlib import Path

from normlab.report.checks import verdict
from normlab.table import format_table

__all__ = ["theory_section"]


def _pm(stats: dict, q: str, f: str = "{:.3g}") -> str:
    return f"{f.format(stats[q]['mean'])} ± {f.format(stats[q]['std'])}"


def theory_section(root: Path) -> list[str]:
    p = root / "theory" / "theory.json"
    if not p.exists():
        return ["## Theory\n", "_Theory checks were not run for this root (`normlab reproduce` runs them)._\n"]
    t = json.loads(p.read_text())
    source = (
        "Every number in this section comes from [theory/theory.json](theory/theory.json) "
        "(`normlab.reproduce.run_theory`); `normlab simulate`, `normlab jacobian` and `normlab gain` "
        "recompute each on its own.\n"
    )
    out = ["## Theory (the DyISRU paper-003)\n", source]
    out.append("### Outlier simulation and fits (the DyISRU paper Sec. 4; Sec. 4 of its LayerNorm version)\n")
    rows = []
    for key, label in (("rms_norm", "RMSNorm data"), ("layer_norm", "LayerNorm data")):
        st = t["simulate"][key]["stats"]
        rows.append(
            [
                label,
                _pm(st, "alpha", "{:.4f}"),
                _pm(st, "beta", "{:.1f}"),
                _pm(st, "dyt_mean_abs_residual"),
                _pm(st, "dyisru_mean_abs_residual"),
            ]
        )
    rows.append(["the DyISRU paper (both versions) (one sample)", "0.049", "301.1", "0.33", "< 0.01"])
    n = t["simulate"]["rms_norm"]["n_seeds"]
    out.append(
        format_table(
            [f"data (mean ± std over {n} seeds)", "DyT alpha", "DyISRU beta", "DyT mean |res|", "DyISRU mean |res|"],
            rows,
            markdown=True,
        )
    )
    ln_max = t["simulate"]["layer_norm"]["stats"]["dyisru_mean_abs_residual"]["max"]
    out.append("")
    out.append(
        str(
            verdict(
                t["simulate"]["rms_norm"]["stats"]["dyisru_mean_abs_residual"]["max"] < 0.01,
                "on RMSNorm data DyISRU is exact (Theorem 3), DyT is off by ~0.33",
            )
        )
    )
    out.append("")
    out.append(
        str(
            verdict(
                ln_max < 0.01,
                f"on LayerNorm data DyISRU's mean |residual| stays < 0.01 on every seed (worst seed: {ln_max:.4f})",
            )
        )
    )
    out.append("\n![outlier fit](theory/outlier_fit_rms_norm.png)\n")
    out.append("![outlier fit, LayerNorm](theory/outlier_fit_layer_norm.png)\n")
    out.append("### Jacobian norms at init (the dissection, std 0.02, gamma = 1)\n")
    seed = {(1024, "rms_norm"): "1602 / 50 / 1601", (2048, "rms_norm"): "2259 / 50 / 2258",
            (1024, "dyt"): "32 / 0 / 32", (2048, "dyt"): "45 / 0 / 45"}  # fmt: skip
    rows = [
        [
            r["width"],
            r["norm"],
            f"{r['diag']:.1f} / {r['coupling']:.1f} / {r['total']:.1f}",
            seed.get((r["width"], r["norm"]), "-"),
        ]
        for r in t["jacobian"]
    ]
    out.append(format_table(["width", "norm", "ours: diag / coupling / total", "the dissection"], rows, markdown=True))
    out.append("\n### Forward gain (the dissection Theorems 1-2)\n\n![gain](theory/gain.png)\n")
    return out
