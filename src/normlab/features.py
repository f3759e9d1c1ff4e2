"""What each registered norm supports, read from the code that supports it: the feature matrix of the docs.

    python -m normlab.features            # print the table (Markdown)
    python -m normlab.features --write    # put it into docs/norms.md, between its markers

Every cell is a fact of the code, not a list kept beside it: the registry's `NormSpec` (element-wise, what a
conversion fits), `normlab.functional` (the reference formula), the dispatcher of `normlab.kernels` named after the
norm (whether it has a C++ CPU path and a Triton path), a module built by `create_norm` (a weight that
`normlab.fold` can fold into the next linear layer), and `normlab.conversion.export.portable.site_spec` (whether the
modeling file of a converted folder rebuilds it without normlab). A test checks that docs/norms.md holds this table.
"""

from __future__ import annotations

import ast
import inspect
import sys
from collections import Counter
from pathlib import Path

import torch
from torch import nn

import normlab.functional as FN
import normlab.kernels as K
from normlab.kernels.paths import OWN_OPS, ops_run
from normlab.registry import create_norm, list_norms, norm_spec

__all__ = ["COLUMNS", "norm_features", "markdown", "BEGIN", "END", "FAMILIES", "family_features", "family_markdown",
           "FAMILY_BEGIN", "FAMILY_END", "tiny_causal_lm", "kernel_paths", "PATH_NAMES", "TRAIN_ROWS"]  # fmt: skip

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
    from normlab.conversion.export.portable import PortableError, site_spec

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


FAMILY_BEGIN = "<!-- families: begin (python -m normlab.features --write) -->"
FAMILY_END = "<!-- families: end -->"
FAMILIES = ("Llama", "Mistral", "Qwen2", "Qwen3", "Gemma", "Gemma3")  # the transformers causal LMs the tests build


def tiny_causal_lm(family: str = "Llama", layers: int = 2, **config: object) -> nn.Module:
    """A tiny random Hugging Face causal LM of ``family`` (one of `FAMILIES`) in eval mode: vocabulary 100, width
    32, 4 heads (2 key-value heads; head_dim 8 for Qwen3 and Gemma), ``layers`` blocks; ``config`` overrides any
    field of the family's config. Its weights come from torch's global generator (seed it first).

    Args:
        family: A transformers family of `FAMILIES`.
        layers: How many blocks.
        **config: Fields of the family's config.
    """
    import transformers

    kw = dict(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        **({"head_dim": 8} if family.startswith("Gemma") or family == "Qwen3" else {}),
    )
    cfg = getattr(transformers, "Gemma3TextConfig" if family == "Gemma3" else f"{family}Config")(**{**kw, **config})
    return getattr(transformers, f"{family}ForCausalLM")(cfg).eval()


def family_features() -> dict[str, dict[str, str]]:
    """Each model family's row, read from what the code does with a tiny random model of it: the norms conversion
    finds (per block, and outside the blocks), whether calibration and the budget walk run on cached block inputs
    (`find_blocks`), whether it heals (the heal needs the block list), the Auto class a saved folder loads through
    without normlab, and whether `export_onnx` takes it (else its reason, shortened)."""
    from normlab.conversion.calibrate.stream import find_blocks
    from normlab.conversion.convert import convert_norms
    from normlab.conversion.export.onnx_export import export_refusal
    from normlab.conversion.export.portable import auto_classes

    rows = {}
    for family in FAMILIES:
        model = tiny_causal_lm(family, 2)
        refusal, autos = export_refusal(model), auto_classes(model)
        two = [s.name for s in convert_norms(model, "dyt", progress=False).sites]
        counts = [len(convert_norms(tiny_causal_lm(family, 1), "dyt", progress=False).sites), len(two)]
        blocks = find_blocks(model, two)
        rows[family] = {
            "sites": f"{counts[1] - counts[0]} per block + {2 * counts[0] - counts[1]}",
            "calibration": "cached block inputs" if blocks else "whole passes",
            "heal": "yes" if blocks else "no block list",
            "portable": "AutoModelForCausalLM" if "AutoModelForCausalLM" in autos else "",
            "onnx": "yes" if refusal is None else "refused: " + refusal.split(" (")[0].split("; ")[0],
        }
    return rows


CHECKPOINTS = {"smollm2": ("Llama", "SmolLM2-135M-Instruct"), "qwen-coder": ("Qwen2", "Qwen2.5-Coder-0.5B-Instruct")}
USABLE = Path(__file__).resolve().parents[2] / "bench" / "usable.csv"  # in a checkout; absent from a wheel
#: The `usable` study's rows (`normlab study usable --bench bench`); USABLE holds those of the script it replaced.
STUDY_USABLE = USABLE.with_name("study_usable.csv")


def measured(tables: Path | tuple[Path, ...] = (USABLE, STUDY_USABLE)) -> dict[str, str]:
    """Family -> its real checkpoint's best conversion judged as used, from bench/usable.csv and the `usable` study's
    rows after them (of each job's newest row, the one with the highest same top-1 on held-out text, the newer on a
    tie): the checkpoint, the sites converted, same top-1, the worst sequence, the job and its minutes. A family
    with no row, or a checkout without the tables, has none.

    Args:
        tables: The tables read, oldest first.
    """
    import csv

    newest: dict[str, dict] = {}  # a job's later row replaces its earlier one (the tables are appended to)
    for table in [tables] if isinstance(tables, Path) else tables:
        for row in csv.DictReader(table.open()) if table.is_file() else []:
            model = row.get("model") or row["command"].split("--model ")[1].split()[0]
            command, job = row.get("command") or "", row.get("job") or row["cell"]
            to = row.get("to") or ("dyisru" if "--to " not in command else command.split("--to ")[1].split()[0])
            if model in CHECKPOINTS and row.get("held_same_top1") and to == "dyisru":  # the matrix reads DyISRU's
                newest.pop(job, None)
                newest[job] = row | {"model": model, "job": job}
    best: dict[str, dict] = {}
    for row in newest.values():
        family = CHECKPOINTS[row["model"]][0]
        if family not in best or float(row["held_same_top1"]) >= float(best[family]["held_same_top1"]):
            best[family] = row
    return {
        f: f"{CHECKPOINTS[r['model']][1]}: {r['sites']} sites converted, {float(r['held_same_top1']):.0%} same "
        f"top-1, worst sequence +{float(r['held_gap_worst']):.2f} (`{r['job']}`, {float(r['minutes']):.1f} min)"
        for f, r in best.items()
    }


def family_markdown() -> str:
    """The family matrix as a Markdown table, between its markers; its last column is read from bench/ (`measured`)."""
    head = ["family", "norms converted", "calibration", "heals", "loads without normlab", "ONNX export",
            "measured on a real checkpoint"]  # fmt: skip
    lines = [FAMILY_BEGIN, "| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    real = measured()
    for family, row in family_features().items():
        lines.append(f"| {family} | " + " | ".join([*row.values(), real.get(family, "")]) + " |")
    return "\n".join([*lines, FAMILY_END])


def write(page: Path, table: str, begin: str = BEGIN, end: str = END) -> None:
    """Replace the table between the markers ``begin`` and ``end`` of ``page`` with ``table``."""
    text = page.read_text()
    if begin not in text or end not in text:
        raise ValueError(f"{page}: no table markers ({begin} ... {end})")
    head, rest = text.split(begin, 1)
    page.write_text(head + table + rest.split(end, 1)[1])


# --------------------------------------------------------------------------
# the path each fused norm takes here, observed (normlab build-kernels --check)
# --------------------------------------------------------------------------
# the path a norm took, by the ops seen; LayerNorm's fused path is PyTorch's own op
PATH_NAMES = {"fused": "fused C++ (normlab_cpu)", "aten": "PyTorch's fused op", "reference": "reference math"}
TRAIN_ROWS = 256  # 256 x 512 = 131,072 elements: past kernels.cpu.MIN_FUSED, so that "auto" fuses a training call


def _path_taken(ops: Counter, name: str) -> str:
    if any(k.startswith(OWN_OPS) for k in ops):
        return "fused"
    if name == "layer_norm" and any(k in ops for k in ("aten::native_layer_norm", "aten::layer_norm")):
        return "aten"
    return "reference"


def kernel_paths(dim: int = 512, dtype: torch.dtype = torch.float32) -> list[dict]:
    """Each fused norm of the registry, run here on a CPU tensor: the path its inference call (no autograd) and its
    training call (forward and backward, `TRAIN_ROWS` x ``dim``) took, as `PATH_NAMES` keys.

    Args:
        dim: The channel count.
        dtype: The input's dtype (float32, bfloat16 or float16).
    """
    rows = []
    for name in list_norms():
        if "kernel" not in norm_spec(name).init_kwargs:
            continue  # a norm with no fused path: always the reference
        norm = create_norm(name, dim).to(dtype)
        x = torch.randn(TRAIN_ROWS, dim, dtype=dtype)
        with torch.no_grad():
            norm(x)  # a first call: a library still loading takes the reference once
            infer = ops_run(lambda n=norm, x=x: n(x))
        xg = x.clone().requires_grad_(True)
        train = ops_run(lambda n=norm, x=xg: n(x).float().sum().backward())
        rows.append({"norm": name, "inference": _path_taken(infer, name), "training": _path_taken(train, name)})
    return rows


if __name__ == "__main__":
    docs = Path(__file__).resolve().parents[2] / "docs"
    if "--write" in sys.argv[1:]:
        write(docs / "norms.md", markdown())
        write(docs / "models.md", family_markdown(), FAMILY_BEGIN, FAMILY_END)
        print(f"wrote the feature matrix into {docs / 'norms.md'} and the family matrix into {docs / 'models.md'}")
    else:
        print(markdown() + "\n\n" + family_markdown())
