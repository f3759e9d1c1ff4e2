"""What each registered norm supports, read from the code that supports it: the feature matrix of the docs.

    python -m normlab.features            # print the table (Markdown)
    python -m normlab.features --write    # put it into docs/norms.md, between its markers

Every cell is a fact of the code, not a list kept beside it: the registry's `NormSpec` (element-wise, what a
conversion fits), `normlab.functional` (the reference formula), the dispatcher of `normlab.kernels` named after the
norm (whether it has a C++ CPU path and a Triton path), a module built by `create_norm` (a weight that
`normlab.fold` can fold into the next linear layer), and `normlab.conversion.portable.site_spec` (whether the
modeling file of a converted folder rebuilds it without normlab). A test checks that docs/norms.md holds this table.
"""

from __future__ import annotations

import ast
import inspect
import sys
from pathlib import Path

import normlab.functional as FN
import normlab.kernels as K
from normlab.registry import create_norm, list_norms, norm_spec

__all__ = ["COLUMNS", "norm_features", "markdown", "BEGIN", "END"]

BEGIN, END = "<!-- features: begin (python -m normlab.features --write) -->", "<!-- features: end -->"
COLUMNS = {
    "pointwise": "element-wise",
    "reference": "reference math",
    "cpu": "fused CPU (C++)",
    "triton": "Triton (CUDA)",
    "calibrates": "conversion fits",
    "folds": "`normlab.fold`",
    "portable": "runs without normlab",
}


def _paths(name: str) -> set[str]:
    """The fused paths ``normlab.kernels.<name>`` can take: the modules (``cpu``, ``fused``) its body calls into."""
    fn = getattr(K, name, None)
    if fn is None or not inspect.isfunction(fn):
        return set()
    calls = {
        node.value.id
        for node in ast.walk(ast.parse(inspect.getsource(fn)))
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
    }
    return {path for module, path in (("cpu", "cpu"), ("fused", "triton")) if module in calls}


def norm_features() -> dict[str, dict[str, bool | str]]:
    """Each registered norm's row: COLUMNS' keys to True/False (``calibrates``: the parameter a fit sets, or False)."""
    from normlab.conversion.portable import PortableError, site_spec

    rows = {}
    for name in list_norms():
        spec, module = norm_spec(name), create_norm(name, 8)
        try:
            site_spec(module, name)
            portable = True
        except PortableError:
            portable = False
        paths = _paths(name)
        rows[name] = {
            "pointwise": spec.pointwise,
            "reference": callable(getattr(FN, name, None)),
            "cpu": "cpu" in paths,
            "triton": "triton" in paths,
            "calibrates": spec.fits or False,
            "folds": getattr(module, "weight", None) is not None,
            "portable": portable,
        }
    return rows


def markdown() -> str:
    """The matrix as a Markdown table, between the markers the docs page keeps it in."""
    shown = {True: "yes", False: ""}
    lines = [BEGIN, "| norm | " + " | ".join(COLUMNS.values()) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for name, row in norm_features().items():
        cells = [shown.get(v, f"`{v}`") if isinstance(v, bool) else f"`{v}`" for v in row.values()]
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    return "\n".join([*lines, END])


def write(page: Path) -> None:
    """Replace the table between the markers of ``page`` with the current one."""
    text = page.read_text()
    if BEGIN not in text or END not in text:
        raise ValueError(f"{page}: no feature-matrix markers ({BEGIN} ... {END})")
    head, rest = text.split(BEGIN, 1)
    page.write_text(head + markdown() + rest.split(END, 1)[1])


if __name__ == "__main__":
    if "--write" in sys.argv[1:]:
        target = Path(__file__).resolve().parents[2] / "docs" / "norms.md"
        write(target)
        print(f"wrote the feature matrix into {target}")
    else:
        print(markdown())
