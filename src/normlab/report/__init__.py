"""``normlab report``: REPORT.md with tables and PNG figures from a sweep root.

For every experiment: a table with the dissection's published number beside ours (the same metric, at the scale
we ran), every number linked to the run directory that produced it, and the verdicts of its TOML's checks,
stated plainly when ours disagrees. The parts: ``results`` (reading runs), ``checks`` (verdicts as values),
``figures``, ``theory`` (the theory section), ``phase`` (the phase map of when a point-wise norm trains).
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

from normlab.errors import NormlabError
from normlab.owner import path_segment_error
from normlab.report import phase, quant, scaling  # noqa: F401  (register their checks and figures)
from normlab.report.checks import CHECKS, Verdict, claims
from normlab.report.figures import FIGURES, table
from normlab.report.results import Results
from normlab.report.theory import theory_section

__all__ = ["write_report", "Results", "Verdict", "claims", "CHECKS", "FIGURES"]


def read_index(path: Path) -> dict:
    """A sweep root's index.json, or a clear error naming the file."""
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise NormlabError(
            f"{path} is unreadable or not JSON ({type(e).__name__}: {e}); write it again with "
            "`normlab sweep` (finished runs are skipped)"
        ) from None
    if not isinstance(index, dict) or not isinstance(index.get("experiments"), list) or "profile" not in index:
        raise NormlabError(
            f"{path} is not a normlab index (no profile and list of experiments); write it again with `normlab sweep`"
        )
    for exp in index["experiments"]:
        name = exp.get("name") if isinstance(exp, dict) else None
        if (why := path_segment_error(name)) is not None:  # figures are written as <root>/figures/<name>_*.png
            raise NormlabError(
                f"{path}: experiment name {name!r} {why.split(', got')[0]}; fix it in the "
                "experiment's TOML and run `normlab sweep` again"
            )
    return index


def _compare_index(compare: str | Path | None) -> dict:
    if compare is None:
        return {}
    path = Path(compare) / "index.json"
    if not path.exists():
        raise FileNotFoundError(f"--compare {compare}: no index.json there (run `normlab reproduce` for it first)")
    return read_index(path)


def write_report(root: str | Path, *, elapsed_s: float | None = None, compare: str | Path | None = None) -> Path:
    """Write <root>/REPORT.md (and <root>/figures/*.png); returns the path.

    With ``compare`` (the root of the same experiments at another budget), each verdict also states the
    verdict there, and the loss curves of both budgets share one figure against tokens seen.

    Args:
        root: The folder of the experiments' runs (`normlab reproduce`'s ``--root``).
        elapsed_s: The runs' wall time, stated in the report.
        compare: The root of the same experiments at another budget.
    """
    other_index = _compare_index(compare)
    others = {e["name"]: e for e in other_index.get("experiments", [])}
    import torch

    root = Path(root)
    index_path = root / "index.json"
    if not index_path.exists():
        hint = f"run `normlab sweep` or `normlab reproduce` with --root {root}"
        raise FileNotFoundError(f"{index_path} not found: {hint}")
    index = read_index(index_path)
    if other_index and not {e["name"] for e in index["experiments"]} & set(others):
        raise ValueError(
            f"--compare {compare}: it holds none of this root's experiments "
            f"({', '.join(sorted(others)) or 'none'} there, "
            f"{', '.join(e['name'] for e in index['experiments'])} here)"
        )
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
        "The dissection trained 360M-parameter GPTs on FineWeb-Edu (attractor 7.54 nats); ours are small byte-level "
        "models on Shakespeare (attractor = unigram entropy, ~3.33 nats). *frac* places a loss between "
        "RMSNorm (0) and the attractor (1), for the dissection and for us, so the structure of the tables can be "
        "compared. *escape step* is the first evaluation at which a run's validation loss is 0.1 nats below "
        "the unigram entropy (it has left the attractor), or never. A disagreement at this scale is a finding, "
        "not a failure.\n",
    ]  # fmt: skip
    lines += theory_section(root)
    for exp in index["experiments"]:
        res = Results(exp, root, index["profile"])
        other = Results(others[exp["name"]], Path(compare), other_index["profile"]) if exp["name"] in others else None
        lines.append(f"## {exp['title']}\n")
        lines.append(f"Source: {exp['source']}. Claim: *{exp['claim']}*.\n")
        lines.append(table(res))
        lines.append("")
        here = claims(res)
        there = claims(other) if other is not None else []
        for i, v in enumerate(here):  # the same checks at the other budget, line by line
            both = len(there) == len(here) and not v.finding
            lines.append(f"- {v}" + (f" [at `{other.profile}`: {there[i].word}]" if both else ""))
        lines.append("")
        for fig_name in exp.get("figures", ["loss"]):  # the TOML names its figures
            fn = FIGURES[fig_name]
            p = fn(res, figs / f"{exp['name']}_{fig_name}.png", other=other)
            if p:
                lines.append(f"![{exp['name']} {fig_name}](figures/{p.name})\n")
    out = root / "REPORT.md"
    out.write_text("\n".join(lines) + "\n")
    return out
