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


def test_conversion_and_the_lab_do_not_import_each_other():
    """Conversion sits beside the training lab: both read normlab.corpus and normlab.pairs, neither reads the other."""
    graph = import_graph()
    for a, b in (("normlab.conversion", "normlab.lab"), ("normlab.lab", "normlab.conversion")):
        arrows = [(n, m) for n, deps in graph.items() if n.startswith(a) for m in deps if m.startswith(b)]
        assert not arrows, f"{a} imports {b}: {arrows}"
