"""A converted Hugging Face model that loads without normlab: a modeling file written into its folder and an
``auto_map`` in its ``config.json``, transformers' convention for custom architectures, so that

    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)

builds the converted model with torch and transformers alone.

The file is generated, not kept by hand: its formulas are the text of `normlab.functional` (each norm the
conversion used, with the helpers it calls), and its massive-token wrapper is the text of
`normlab.conversion.massive.MassiveTokens`. What is new in it is the glue: a module that holds a site's
parameters under their normlab names (so the saved weights load by name) and calls the formula, and a subclass
of the model's own class that puts these modules at the recorded sites. ``config.json`` carries the sites
(``normlab_sites``: the formula, the parameter shapes, the settings of each).
"""

from __future__ import annotations

import ast
import inspect
import json
from pathlib import Path

from torch import nn

import normlab.functional as FN
from normlab.conversion.massive import MassiveTokens

__all__ = ["MODELING_FILE", "PortableError", "auto_classes", "site_spec", "modeling_source", "write_portable"]

MODELING_FILE = "modeling_normlab.py"


class PortableError(ValueError):
    """The model or one of its sites cannot be written as a folder that loads without normlab (the message says
    which and why)."""


def site_spec(module: nn.Module, name: str = "") -> dict:
    """What the modeling file needs to rebuild a replacement: its formula, its parameters' shapes (by their
    normlab names), its settings and its channel axis; a massive-token pair as
    ``{"massive_tokens": {"main": ..., "massive": ..., "channels": [...], "threshold": t}}``.

    Args:
        module: A site's replacement (or its massive-token pair).
        name: The site's name, for errors.
    """
    if isinstance(module, MassiveTokens):
        return {"massive_tokens": {"main": site_spec(module.main, name), "massive": site_spec(module.massive, name),
                                   "channels": module.channels, "threshold": module.threshold}}  # fmt: skip
    formula = getattr(module, "registry_name", None)
    fn = getattr(FN, formula, None) if isinstance(formula, str) else None
    if fn is None or list(module.buffers(recurse=False)) or list(module.children()):
        raise PortableError(
            f"the site {name or '?'} holds a {type(module).__name__}, which the modeling file cannot rebuild (it "
            "writes the element-wise norms of normlab.functional, plain or with a massive-token copy)"
        )
    params = {k: list(p.shape) for k, p in module.named_parameters(recurse=False)}
    settings = {}
    for arg in list(inspect.signature(fn).parameters)[1:]:
        if arg in params or f"log_{arg}" in params:
            continue
        value = getattr(module, arg, None)
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            settings[arg] = value
    return {"formula": formula, "parameters": params, "settings": settings, "channel_dim": module.channel_dim}


def _formulas(spec: dict) -> set[str]:
    if "massive_tokens" in spec:
        return _formulas(spec["massive_tokens"]["main"]) | _formulas(spec["massive_tokens"]["massive"])
    return {spec["formula"]}


def _functional_text(names: set[str]) -> str:
    """The imports of `normlab.functional`'s modules, then each top-level definition that ``names`` need (the
    formulas, their decorator, the helpers and constants they read), in the modules' own order and text (the
    shared helpers first)."""
    folder = Path(FN.__file__).parent
    files = ["common.py", *sorted(p.name for p in folder.glob("*.py") if p.name not in ("__init__.py", "common.py"))]
    defs: dict[str, tuple[ast.stmt, str]] = {}
    imports: list[str] = []
    for file in files:  # the shared helpers first: the formulas' decorator must be defined before them
        source = (folder / file).read_text()
        for node in ast.parse(source).body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                package = (node.module or "").split(".")[0] if isinstance(node, ast.ImportFrom) else ""
                own = package in ("__future__", "normlab")
                text = ast.get_source_segment(source, node)
                if not own and text not in imports:
                    imports.append(text)
            elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                defs[node.name] = (node, source)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    if isinstance(t, ast.Name):
                        defs[t.id] = (node, source)
    wanted, todo = set(), list(names)
    while todo:
        n = todo.pop()
        if n in wanted or n not in defs:
            continue
        wanted.add(n)
        todo += [x.id for x in ast.walk(defs[n][0]) if isinstance(x, ast.Name)]
    body, seen = [], set()
    for node, source in defs.values():  # the files' order, then each file's
        if id(node) in seen or not any(defs[n][0] is node for n in wanted):
            continue
        seen.add(id(node))
        start = node.decorator_list[0].lineno if getattr(node, "decorator_list", None) else node.lineno
        body.append("\n".join(source.splitlines()[start - 1 : node.end_lineno]))
    imports += ["from torch import nn", "import transformers"]  # for the glue
    return "\n".join(imports) + "\n\n\n" + "\n\n\n".join(body)


_GLUE = '''

FORMULAS = {FORMULAS}


class ElementwiseNorm(nn.Module):
    """One replacement: its parameters under normlab's names, the formula called with them (a ``log_`` parameter
    is passed as its exp), its settings, over the channel axis ``channel_dim``."""

    def __init__(self, spec):
        super().__init__()
        self.formula = FORMULAS[spec["formula"]]
        self.settings = dict(spec["settings"])
        self.channel_dim = spec["channel_dim"]
        for name, shape in spec["parameters"].items():
            self.register_parameter(name, nn.Parameter(torch.empty(shape)))

    def forward(self, x):
        kwargs = dict(self.settings)
        for name, p in self._parameters.items():
            if p is not None:
                kwargs[name[4:] if name.startswith("log_") else name] = p.exp() if name.startswith("log_") else p
        if self.channel_dim == -1 or self.channel_dim == x.dim() - 1:
            return self.formula(x, **kwargs)
        return self.formula(x.movedim(self.channel_dim, -1), **kwargs).movedim(-1, self.channel_dim)


def build_site(spec):
    if "massive_tokens" in spec:
        pair = spec["massive_tokens"]
        return MassiveTokens(build_site(pair["main"]), build_site(pair["massive"]), pair["channels"], pair["threshold"])
    return ElementwiseNorm(spec)


class {CLASS}(transformers.{BASE}):
    """transformers' {BASE} with the element-wise norms of a normlab conversion at the sites its config names."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        for name, spec in config.normlab_sites.items():
            self.set_submodule(name, build_site(spec))
'''


def modeling_source(base: str, specs: dict[str, dict], version: str) -> str:
    """The text of the modeling file for a model of transformers class ``base`` with the sites ``specs``.

    Args:
        base: The transformers class, e.g. ``LlamaForCausalLM``.
        specs: Site name -> `site_spec`.
        version: normlab's version, written into the file's header.
    """
    formulas = sorted(set().union(*(_formulas(s) for s in specs.values())))
    header = (
        f'"""A model converted by normlab {version}: transformers\' {base} with element-wise norms at '
        f"{len(specs)} sites.\n\nGenerated: the formulas are normlab.functional's, the massive-token wrapper is "
        "normlab.conversion.massive's.\nIt needs torch and transformers, not normlab. Load the folder with\n"
        f"    transformers.AutoModel...from_pretrained(folder, trust_remote_code=True)\n"
        '"""\n\nfrom __future__ import annotations\n\n'
    )
    glue = (
        _GLUE.replace("{FORMULAS}", "{" + ", ".join(f'"{f}": {f}' for f in formulas) + "}")
        .replace("{CLASS}", portable_class(base))
        .replace("{BASE}", base)
    )
    first = inspect.getsource(MassiveTokens)
    return f"{header}{_functional_text(set(formulas))}\n\n\n{first}{glue}"


def portable_class(base: str) -> str:
    return f"Normlab{base}"


def auto_classes(model: nn.Module) -> list[str]:
    """The transformers Auto classes that build ``model``'s class from its config (``AutoModelForCausalLM`` for
    ``LlamaForCausalLM``); empty for a model that is not a transformers model or that no Auto class builds.

    Args:
        model: A model.
    """
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if not isinstance(model_type, str) or not type(model).__module__.startswith("transformers."):
        return []
    from transformers.models.auto import modeling_auto

    found = []
    for name in sorted(dir(modeling_auto)):
        mapping = getattr(getattr(modeling_auto, name), "_model_mapping", None)
        if not name.startswith("AutoModel") or not hasattr(mapping, "_model_mapping"):
            continue
        value = mapping._model_mapping.get(model_type)
        if type(model).__name__ in (value if isinstance(value, (list, tuple)) else [value]):
            found.append(name)
    return found


def write_portable(model: nn.Module, path: Path, sites: list[str], version: str) -> list[str]:
    """Write the modeling file into ``path`` (a folder ``save_pretrained`` wrote) and point its ``config.json`` at
    it; returns the Auto classes that now load it. Raises `PortableError`, naming the model's class or the
    site, where the folder cannot be made to load without normlab.

    Args:
        model: The converted model.
        path: The folder ``save_pretrained`` wrote.
        sites: The converted sites' names.
        version: normlab's version, written into the file's header.
    """
    autos = auto_classes(model)
    base = type(model).__name__
    if not autos:
        raise PortableError(
            f"{base} is not built by any transformers Auto class (AutoModel, AutoModelForCausalLM, ...), so a "
            "folder of it cannot name its modeling file; it loads with normlab.load_converted"
        )
    specs = {name: site_spec(model.get_submodule(name), name) for name in sites}
    (path / MODELING_FILE).write_text(modeling_source(base, specs, version))
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    config["auto_map"] = {a: f"{MODELING_FILE[:-3]}.{portable_class(base)}" for a in autos}
    config["normlab_sites"] = specs
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return autos
