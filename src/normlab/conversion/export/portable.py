"""A converted Hugging Face model that loads without normlab: a modeling file written into its folder and an
``auto_map`` in its ``config.json``, transformers' convention for custom architectures, so that

    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)

builds the converted model with torch and transformers alone.

The file is generated, not kept by hand: its formulas are the text of `normlab.functional` (each norm the
conversion used, with the helpers it calls), and its massive-token wrapper is the text of
`normlab.conversion.calibrate.massive.MassiveTokens`. What is new in it is the glue: a module that holds a site's
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
from normlab.conversion.calibrate.massive import MassiveTokens
from normlab.embed_scale import ScaledEmbedding

__all__ = [
    "MODELING_FILE",
    "PortableError",
    "auto_classes",
    "auto_map",
    "site_spec",
    "modeling_source",
    "write_portable",
]

MODELING_FILE = "modeling_normlab.py"


class PortableError(ValueError):
    """The model or one of its sites cannot be written as a folder that loads without normlab (the message says
    which and why)."""


def site_spec(module: nn.Module, name: str = "") -> dict:
    """What the modeling file needs to rebuild a replacement: its formula, its parameters' shapes (by their
    normlab names), its settings and its channel axis; a massive-token pair as
    ``{"massive_tokens": {"main": ..., "massive": ..., "channels": [...], "threshold": t, "reference": r}}``.

    Args:
        module: A site's replacement (or its massive-token pair).
        name: The site's name, for errors.
    """
    if isinstance(module, MassiveTokens):
        return {"massive_tokens": {"main": site_spec(module.main, name), "massive": site_spec(module.massive, name),
                                   "channels": module.channels, "threshold": module.threshold,
                                   "reference": module.reference}}  # fmt: skip
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
FILE = "modeling_normlab.py"  # this file, named in its errors
RECONVERT = "convert the original again (normlab convert), or restore the folder as the conversion wrote it"


class ElementwiseNorm(nn.Module):
    """One replacement: its parameters under normlab's names, the formula called with them (a ``log_`` parameter
    is passed as its exp), its settings, over the channel axis ``channel_dim``."""

    def __init__(self, spec, name):
        super().__init__()
        if spec.get("formula") not in FORMULAS:
            raise ValueError(
                f"config.json normlab_sites[{name!r}] names the formula {spec.get('formula')!r}, which {FILE} does "
                f"not define ({', '.join(FORMULAS)}): the config and {FILE} come from two conversions; {RECONVERT}"
            )
        kinds = {"settings": dict, "channel_dim": int, "parameters": dict}
        wrong = [k for k, kind in kinds.items() if not isinstance(spec.get(k), kind) or isinstance(spec.get(k), bool)]
        for pname, shape in (spec.get("parameters") if isinstance(spec.get("parameters"), dict) else {}).items():
            if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
                wrong.append(f"parameters.{pname}")
        if wrong:
            raise ValueError(
                f"config.json normlab_sites[{name!r}]: {', '.join(wrong)} is missing or of the wrong kind (settings an "
                f"object, channel_dim an int, parameters an object of shapes): the folder was edited; {RECONVERT}"
            )
        self.formula = FORMULAS[spec["formula"]]
        self.settings = dict(spec["settings"])
        self.channel_dim = spec["channel_dim"]
        for pname, shape in spec["parameters"].items():
            self.register_parameter(pname, nn.Parameter(torch.full(shape, float("nan"))))  # NaN until loaded

    def forward(self, x):
        kwargs = dict(self.settings)
        for name, p in self._parameters.items():
            if p is not None:
                kwargs[name[4:] if name.startswith("log_") else name] = p.exp() if name.startswith("log_") else p
        if self.channel_dim == -1 or self.channel_dim == x.dim() - 1:
            return self.formula(x, **kwargs)
        return self.formula(x.movedim(self.channel_dim, -1), **kwargs).movedim(-1, self.channel_dim)


def build_site(spec, name):
    if "massive_tokens" in spec:
        pair = spec["massive_tokens"]
        return MassiveTokens(
            build_site(pair["main"], name),
            build_site(pair["massive"], name),
            pair["channels"],
            pair["threshold"],
            pair.get("reference"),
        )
    return ElementwiseNorm(spec, name)


def place_sites(model, config):
    """Put each site of ``config.normlab_sites`` (named in the converted model's class) where it sits in
    ``model``, whichever head class it is: the base model alone finds it without the base model's prefix; a site
    in a head this class does not have (a masked LM's head norm, read as the base model) is left out."""
    sites = getattr(config, "normlab_sites", None)
    if not isinstance(sites, dict) or not sites:
        raise ValueError(f"config.json has no normlab_sites, which {FILE} reads: {RECONVERT}")
    for name, spec in sites.items():
        short, target = _target(model, config, name)
        width = getattr(getattr(model.get_submodule(target), "weight", None), "shape", [None])[-1] if target else None
        routed = spec.get("massive_tokens") if isinstance(spec, dict) else None
        outside = [c for c in (routed or {}).get("channels", []) if width and not 0 <= c < width]
        if outside:
            raise ValueError(
                f"config.json normlab_sites[{name!r}]: its massive-token channels {outside} lie outside the norm's "
                f"{width} channels: the folder was edited; {RECONVERT}"
            )
        if target is not None:
            model.set_submodule(target, build_site(spec, name))
        elif short is not None:
            raise ValueError(
                f"config.json normlab_sites names {name!r}, which {type(model).__name__} does not have: {RECONVERT}"
            )
    for name in getattr(config, "normlab_embed_scale", None) or []:  # the papers' learnable embedding scalar
        _, target = _target(model, config, name)
        if target is not None:
            model.set_submodule(target, ScaledEmbedding.around(model.get_submodule(target), float("nan")))


def _target(model, config, name):
    """Where a site named in the converted class sits in ``model``: (its name without the base model's prefix, or
    None; the module's name in ``model``, or None). A head whose base model has another attribute (Llama's QA head:
    transformer, not model) finds it under its own."""
    own = model.base_model_prefix
    converted = getattr(transformers, (getattr(config, "architectures", None) or [""])[0], None)
    saved = getattr(converted, "base_model_prefix", None) or own
    short = name[len(saved) + 1:] if name.startswith(saved + ".") else None
    moved = f"{own}.{short}" if short is not None and own != saved else None
    return short, next((t for t in (name, moved, short) if t and _has(model, t)), None)


def _has(model, name):
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True


def check_loaded(model, info, folder):
    """After the weights have loaded: every site's parameters came from the folder, and the weights hold no norm
    parameters that no site took (a site dropped from config.json)."""
    sites = [n for n, m in model.named_modules() if isinstance(m, (ElementwiseNorm, MassiveTokens, ScaledEmbedding))]
    unloaded = [k for k in info.get("missing_keys", []) if any(k.startswith(n + ".") for n in sites)]
    unloaded += [f"{n}.{k}" for n, m in model.named_modules() if isinstance(m, (ElementwiseNorm, ScaledEmbedding))
                 for k, p in m.named_parameters(recurse=False) if bool(p.isnan().all())]
    if unloaded:
        raise ValueError(
            f"{folder}: the weights file has no value for {unloaded[0]}, which config.json's normlab_sites "
            f"declares: the weights and the config come from two conversions; {RECONVERT}"
        )
    norms = {n for n, m in model.named_modules() if "Norm" in type(m).__name__}
    keys = [*info.get("unexpected_keys", []), *info.get("missing_keys", [])]
    stray = [k for k in keys if any(k[:i] in norms for i in range(len(k)) if k[i] == ".")]
    if stray:
        raise ValueError(
            f"{folder}: the weights and config.json disagree at a norm ({stray[0]} is "
            f"{'unexpected' if stray[0] in info.get('unexpected_keys', []) else 'missing'}): a site was removed from "
            f"or added to its normlab_sites, so a norm would stand there with weights of another kind: {RECONVERT}"
        )
    bad = [k for k in info.get("mismatched_keys", []) if any(str(k).startswith(n + ".") for n in sites)]
    if bad:
        raise ValueError(f"{folder}: the weights of {bad[0]} have another shape than config.json declares: {RECONVERT}")


def with_sites(base):
    """transformers' class ``base`` with the element-wise norms of the conversion at the sites its config names,
    loaded and checked."""

    def __init__(self, config, *args, **kwargs):
        if not isinstance(config, base.config_class):  # config.json replaced by another family's
            raise ValueError(
                f"config.json is a {type(config).__name__}, but this folder's {FILE} builds {base.__name__} from a "
                f"{base.config_class.__name__}: the config is another model's; {RECONVERT}"
            )
        base.__init__(self, config, *args, **kwargs)
        place_sites(self, config)

    @classmethod
    def from_pretrained(cls, folder, *args, **kwargs):
        asked = kwargs.pop("output_loading_info", False)
        saved = saved_prefix(folder)
        if saved and base.base_model_prefix and saved != base.base_model_prefix and "key_mapping" not in kwargs:
            kwargs["key_mapping"] = {f"^{saved}[.]": f"{base.base_model_prefix}."}  # Llama's QA head: transformer.
        model, info = super(made, cls).from_pretrained(folder, *args, output_loading_info=True, **kwargs)
        check_loaded(model, info, folder)
        return (model, info) if asked else model

    name = f"Normlab{base.__name__}"
    made = type(name, (base,), {"__init__": __init__, "from_pretrained": from_pretrained, "__module__": __name__,
                                "__qualname__": name, "__doc__": with_sites.__doc__})
    share_weight_names(base, name)
    return made


def saved_prefix(folder):
    """The base model's attribute in the class the folder was converted from (config.json's architectures):
    its weights are saved under it ("model" for LlamaForCausalLM), whatever head loads them."""
    import json
    import os

    try:
        with open(os.path.join(str(folder), "config.json")) as f:
            saved = getattr(transformers, (json.load(f).get("architectures") or [""])[0], None)
    except (OSError, ValueError, TypeError):  # a hub name, not a folder: transformers resolves it
        return None
    return getattr(saved, "base_model_prefix", None)


def share_weight_names(base, name):
    """transformers 5 renames a checkpoint's weights by class or model type as it loads them (GPT-NeoX's saved
    embed_out is its lm_head), but never for a class from a modeling file unless renames are registered under its
    name: the base class's renames, registered for this class too."""
    try:
        from transformers import conversion_mapping as cm
    except ImportError:  # transformers 4: no renames
        return
    renames = cm.get_checkpoint_conversion_mapping(base.__name__)
    if renames is None:
        renames = cm.get_checkpoint_conversion_mapping(getattr(base.config_class, "model_type", None))
    if renames:
        cm.register_checkpoint_conversion_mapping(name, renames, overwrite=True)
'''


def modeling_source(classes: list[str], specs: dict[str, dict], version: str) -> str:
    """The text of the modeling file for a model converted from the transformers class ``classes[0]``, built by
    each of ``classes`` (its other head classes and its base model) with the sites ``specs``.

    Args:
        classes: transformers classes, the converted model's first (e.g. ``LlamaForCausalLM``, ``LlamaModel``).
        specs: Site name -> `site_spec`.
        version: normlab's version, written into the file's header.
    """
    formulas = sorted(set().union(*(_formulas(s) for s in specs.values())))
    header = (
        f'"""A model converted by normlab {version}: transformers\' {classes[0]} with element-wise norms at '
        f"{len(specs)} sites.\n\nGenerated: the formulas are normlab.functional's, the massive-token wrapper is "
        "normlab.conversion.calibrate.massive's.\nIt needs torch and transformers, not normlab. Load the folder with\n"
        f"    transformers.AutoModel...from_pretrained(folder, trust_remote_code=True)\n"
        '"""\n\nfrom __future__ import annotations\n\n'
    )
    glue = _GLUE.replace("{FORMULAS}", "{" + ", ".join(f'"{f}": {f}' for f in formulas) + "}")
    made = "\n".join(f"{portable_class(c)} = with_sites(transformers.{c})" for c in classes)
    first = inspect.getsource(MassiveTokens) + "\n\n" + inspect.getsource(ScaledEmbedding)
    return f"{header}{_functional_text(set(formulas))}\n\n\n{first}{glue}{made}\n"


def portable_class(base: str) -> str:
    return f"Normlab{base}"


def auto_map(model: nn.Module) -> dict[str, str]:
    """Every transformers Auto class that knows ``model``'s model type, with the class it builds for it
    (``{"AutoModelForCausalLM": "LlamaForCausalLM", "AutoModel": "LlamaModel", ...}``); empty for a model that is
    not a transformers model.

    Args:
        model: A model.
    """
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if not isinstance(model_type, str) or not type(model).__module__.startswith("transformers."):
        return {}
    import transformers
    from transformers.models.auto import modeling_auto

    found = {}
    for name in sorted(dir(modeling_auto)):
        mapping = getattr(getattr(modeling_auto, name), "_model_mapping", None)
        if not name.startswith("AutoModel") or not hasattr(mapping, "_model_mapping"):
            continue
        value = mapping._model_mapping.get(model_type)
        for cls in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(cls, str) and hasattr(transformers, cls):
                found[name] = cls
                break
    return found


def auto_classes(model: nn.Module) -> list[str]:
    """The transformers Auto classes that build ``model``'s own class from its config (``AutoModelForCausalLM``
    for ``LlamaForCausalLM``); empty for a model that is not a transformers model or that no Auto class builds.

    Args:
        model: A model.
    """
    return [a for a, cls in auto_map(model).items() if cls == type(model).__name__]


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
    autos, every = auto_classes(model), auto_map(model)
    base = type(model).__name__
    if not autos:
        raise PortableError(
            f"{base} is not built by any transformers Auto class (AutoModel, AutoModelForCausalLM, ...), so a "
            "folder of it cannot name its modeling file; it loads with normlab.load_converted"
        )
    specs = {name: site_spec(model.get_submodule(name), name) for name in sites}
    classes = [base, *sorted(set(every.values()) - {base})]  # every head class and the base model load it too
    (path / MODELING_FILE).write_text(modeling_source(classes, specs, version))
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    config["auto_map"] = {a: f"{MODELING_FILE[:-3]}.{portable_class(c)}" for a, c in every.items()}
    config["normlab_sites"] = specs
    scaled = [n for n, m in model.named_modules() if isinstance(m, ScaledEmbedding)]
    if scaled:  # the papers' embedding scalar (normlab.embed_scale), put back by the modeling file
        config["normlab_embed_scale"] = scaled
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return [*autos, *(a for a in every if a not in autos)]
