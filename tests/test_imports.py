"""The package's imports run one way: no module imports, even lazily inside a function, one that imports it back.

The graph is read from the source with ``ast``: every ``import normlab...`` and ``from normlab... import``
anywhere in a file (top level or inside a function) is an edge.
"""

from __future__ import annotations

import ast
from pathlib import Path

import normlab

ROOT = Path(normlab.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative import
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base]).strip(".")
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for t in targets:
                if t in modules and t != name:
                    graph[name].add(t)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return stack[stack.index(m) :] + [m]
            if m not in state and (cycle := visit(m)):
                return cycle
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (cycle := visit(n)):
            return cycle
    return None


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    assert "normlab.registry" in graph and "normlab.modules" in graph["normlab.registry"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


# --------------------------------------------------------------------------
# floors: nothing imports, even lazily, a module on a floor above its own
# --------------------------------------------------------------------------
#: The package's floors, lowest first: a module may import its own floor and the floors below. Written here once;
#: docs/code-map.md draws them. A module is on the floor of the longest name listed that it is or is inside.
FLOORS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("normlab.version", "normlab.errors", "normlab.typed", "normlab.pairs", "normlab.owner", "normlab.table",
              "normlab.corpus", "normlab.reference", "normlab.profiles", "normlab.functional", "normlab.quantize")),
    ("kernels", ("normlab.kernels", "normlab.arguments")),
    ("layers", ("normlab.modules", "normlab.elementwise")),
    ("registry", ("normlab.registry",)),
    ("norm surgery", ("normlab.sites", "normlab.record", "normlab.recipes", "normlab.embed_scale", "normlab.swap")),
    ("wings", ("normlab.theory", "normlab.lab", "normlab.conversion", "normlab.integrations")),
    ("report", ("normlab.report",)),
    ("runners", ("normlab.experiment", "normlab.experiments", "normlab.sweep", "normlab.study", "normlab.features")),
    ("apps", ("normlab.reproduce", "normlab.demo")),
    ("cli", ("normlab.cli",)),
    ("package", ("normlab",)),
]  # fmt: skip
#: Inside the conversion wing, by stage, lowest first (the same rule).
CONVERSION_FLOORS: list[tuple[str, tuple[str, ...]]] = [
    ("settings", ("normlab.conversion.config", "normlab.conversion.sections", "normlab.conversion.flags",
                  "normlab.conversion.limits",
                  "normlab.conversion.stages", "normlab.conversion.batches", "normlab.conversion.data.config")),
    ("data", ("normlab.conversion.data",)),
    ("measure", ("normlab.conversion.measure",)),
    ("calibrate", ("normlab.conversion.calibrate",)),
    ("heal", ("normlab.conversion.heal",)),
    ("export", ("normlab.conversion.export",)),
    ("convert", ("normlab.conversion.convert", "normlab.conversion.frontier")),
    ("commands", ("normlab.conversion.checks", "normlab.conversion.workflow", "normlab.conversion.evaluate",
                  "normlab.conversion")),
]  # fmt: skip


def floor_of(module: str, floors: list[tuple[str, tuple[str, ...]]]) -> int | None:
    """The index of ``module``'s floor: the longest listed name it is, or is inside; None where none is."""
    best = max(
        ((len(name), i) for i, (_, names) in enumerate(floors) for name in names
         if module == name or module.startswith(name + ".")),
        default=None,
    )  # fmt: skip
    return None if best is None else best[1]


def upward(graph: dict[str, set[str]], floors: list[tuple[str, tuple[str, ...]]]) -> list[str]:
    """Every arrow from a module to one on a higher floor, as 'a (floor) -> b (floor)'."""
    found = []
    for a, deps in sorted(graph.items()):
        fa = floor_of(a, floors)
        for b in sorted(deps):
            fb = floor_of(b, floors)
            if fa is not None and fb is not None and fb > fa:
                found.append(f"{a} ({floors[fa][0]}) -> {b} ({floors[fb][0]})")
    return found


def test_every_module_is_on_a_floor_and_no_import_goes_up():
    """issue 98: 4 arrows pointed up from one lazy import (kernels.paths -> registry) and 5 inside conversion; the
    floors are written down and any import, lazy or not, from a floor to a higher one fails here."""
    graph = import_graph()
    assert not [m for m in graph if floor_of(m, FLOORS) is None]
    inside = {m for m in graph if m.startswith("normlab.conversion")}
    assert not [m for m in inside if floor_of(m, CONVERSION_FLOORS) is None]
    assert upward(graph, FLOORS) == []
    conversion = {a: {b for b in deps if b in inside} for a, deps in graph.items() if a in inside}
    assert upward(conversion, CONVERSION_FLOORS) == []


def test_the_floor_check_finds_an_upward_import():
    graph = {"normlab.registry": {"normlab.swap"}, "normlab.swap": {"normlab.registry"}}
    assert upward(graph, FLOORS) == ["normlab.registry (registry) -> normlab.swap (norm surgery)"]


def test_swapping_norms_loads_no_conversion_module():
    """issue 98: ``import normlab`` loaded 56 modules, 33 of them conversion modules; a training script that swaps
    its norms now loads none of them (the conversion names of ``normlab`` load on first use)."""
    import subprocess
    import sys

    code = ("import sys, normlab, normlab.swap; normlab.replace_norms; "
            "print(sorted(m for m in sys.modules if m.startswith('normlab.conversion')))")  # fmt: skip
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "[]", run.stdout + run.stderr[-2000:]
    code = "import normlab; print(normlab.convert_norms.__module__, normlab.fold.__module__)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.stdout.split() == ["normlab.conversion.convert", "normlab.conversion.export.fold"], run.stderr


def test_conversion_and_the_lab_do_not_import_each_other():
    """Conversion sits beside the training lab: both read normlab.corpus and normlab.pairs, neither reads the other."""
    graph = import_graph()
    for a, b in (("normlab.conversion", "normlab.lab"), ("normlab.lab", "normlab.conversion")):
        arrows = [(n, m) for n, deps in graph.items() if n.startswith(a) for m in deps if m.startswith(b)]
        assert not arrows, f"{a} imports {b}: {arrows}"


# --------------------------------------------------------------------------
# private names stay in their file
# --------------------------------------------------------------------------
def _private(name: str) -> bool:
    last = name.rsplit(".", 1)[-1]
    return last.startswith("_") and not (last.startswith("__") and last.endswith("__"))


def private_crossings(source: str) -> list[str]:
    """Where a file reaches into another file's private names: ``from normlab.x import _y``, a private module
    (``normlab._x``), or ``m._y`` on a normlab module it imported."""
    found, modules = [], set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("normlab"):
            if any(_private(part) for part in node.module.split(".")):
                found.append(f"line {node.lineno}: from {node.module} import ...")
            for a in node.names:
                if _private(a.name):
                    found.append(f"line {node.lineno}: from {node.module} import {a.name}")
                modules.add(a.asname or a.name)  # may be a module (from normlab.lab import train)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("normlab"):
                    if any(_private(part) for part in a.name.split(".")):
                        found.append(f"line {node.lineno}: import {a.name}")
                    modules.add(a.asname or a.name.split(".")[0])
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            base = node.value
            if isinstance(base, ast.Name) and base.id in modules:
                found.append(f"line {node.lineno}: {base.id}.{node.attr}")
    return found


def test_no_private_name_crosses_a_file():
    """What another module or a script needs is public, with a docstring; a private name is its file's own."""
    files = [*ROOT.rglob("*.py"), *(ROOT.parents[1] / "scripts").glob("*.py")]
    assert len(files) > 50
    crossings = {str(p.relative_to(ROOT.parents[1])): c for p in files if (c := private_crossings(p.read_text()))}
    assert not crossings, f"private names used across files: {crossings}"


def test_the_private_name_check_fails_on_a_crossing():
    assert private_crossings("from normlab.conversion.heal.distill import _check_budget\n")
    assert private_crossings("from normlab import _table\n")
    assert private_crossings("import normlab.kernels._common as c\n")
    assert private_crossings("from normlab.lab import train\ntrain._optimizer(1)\n")
    assert not private_crossings("from normlab.lab import train\ntrain.build_optimizer(1)\nx.__doc__\n")
    assert not private_crossings("from normlab.modules import __all__ as names\n")


# --------------------------------------------------------------------------
# sizes: a file a reader can hold, functions a reader can follow
# --------------------------------------------------------------------------
def long_functions(source: str, limit: int) -> list[str]:
    """Functions longer than ``limit`` lines, their docstrings not counted."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = node.end_lineno - node.lineno + 1
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                n -= first.end_lineno - first.lineno + 1
            if n > limit:
                found.append(f"{node.name} ({n} lines)")
    return found


def test_no_file_over_500_lines_and_no_function_over_80():
    files = list(ROOT.rglob("*.py"))
    long_files = {p.name: n for p in files if (n := len(p.read_text().splitlines())) > 500}
    assert not long_files, f"files over 500 lines: {long_files}"
    long = {str(p.relative_to(ROOT)): f for p in files if (f := long_functions(p.read_text(), 80))}
    assert not long, f"functions over 80 lines: {long}"
    assert long_functions("def f():\n" + "    x = 1\n" * 81, 80) == ["f (82 lines)"]


# Where more than six parameters are the rule, not a smell: the kernels (Triton's launch arguments, and the C++
# CPU ops' positional tensors on the inference path), nn.Module constructors (torch's shape/eps/bias/device/dtype
# convention), and convert_norms (issue 52's own signature, model, to, calibrate, *, config, **overrides, plus
# the three hooks a config cannot hold: an include predicate, the user's norm classes, a progress flag).
MANY_PARAMETERS_ALLOWED = (
    "kernels/*_triton.py:*",
    "kernels/cpu.py:*",
    "*:__init__",
    "conversion/convert.py:convert_norms",
    "swap.py:replace_norms",  # convert_norms' finding options (extra_classes, include) beside its own
)


def many_parameters(source: str, limit: int) -> list[str]:
    """Functions with more than ``limit`` parameters, ``self``/``cls``/``ctx`` and ``*args``/``**kwargs`` not
    counted."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            names = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs if p.arg not in ("self", "cls", "ctx")]
            if len(names) > limit:
                found.append(f"{node.name} ({len(names)} parameters)")
    return found


def test_no_function_over_6_parameters_outside_the_kernels_and_constructors():
    """Issue 52: a function taking more than six values takes a config section or a small dataclass instead."""
    import fnmatch

    over = {}
    for p in ROOT.rglob("*.py"):
        rel = str(p.relative_to(ROOT))
        for f in many_parameters(p.read_text(), 6):
            if not any(fnmatch.fnmatch(f"{rel}:{f.split(' ')[0]}", pat) for pat in MANY_PARAMETERS_ALLOWED):
                over.setdefault(rel, []).append(f)
    assert not over, f"functions over 6 parameters: {over}"
    assert many_parameters("def f(a, b, c, *, d, e, f, g, **kw):\n    pass\n", 6) == ["f (7 parameters)"]
    assert many_parameters("class A:\n    def m(self, a, b, c, d, e, f):\n        pass\n", 6) == []


def fmt_skips_on_plain_statements(source: str) -> list[int]:
    """The lines of ``source`` whose ``# fmt: skip`` sits on a plain statement (a call, a signature, a condition, a
    raise, a comprehension: code, however it is bracketed) rather than on a table: an assignment or a return of a
    literal, or a loop over one."""
    literal = (ast.Dict, ast.List, ast.Tuple, ast.Set)
    statements = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.stmt)]
    found = []
    for i, line in enumerate(source.splitlines(), 1):
        if "# fmt: skip" not in line:
            continue
        around = [n for n in statements if n.lineno <= i <= n.end_lineno]
        n = min(around, key=lambda n: n.end_lineno - n.lineno)
        table = (isinstance(n, (ast.Assign, ast.AnnAssign, ast.Return)) and isinstance(n.value, literal)) or (
            isinstance(n, ast.For) and isinstance(n.iter, literal)
        )
        if not table:
            found.append(i)
    return found


def test_no_fmt_skip_on_a_plain_statement():
    """issue 67: the size rules were met by pressing lines against them with ``# fmt: skip``; only tables and
    literals keep their hand layout."""
    found = {
        str(p.relative_to(ROOT)): f for p in ROOT.rglob("*.py") if (f := fmt_skips_on_plain_statements(p.read_text()))
    }
    assert not found, found
    assert fmt_skips_on_plain_statements("f(1,\n  2)  # fmt: skip\nx = {1: 2}  # fmt: skip\n") == [2]
    assert fmt_skips_on_plain_statements("x = [f(i)\n     for i in y]  # fmt: skip\n") == [2]  # issue 98
