"""Norm surgery, the floor under both doors: finding a model's norms, building a fresh layer in the place of one, and
putting it there. `normlab.replace_norms` (a model you will train) and `normlab.convert_norms` (a trained model's
norms carried over) both stand on it, and neither imports the other.

What it finds (`KNOWN_NORMS`): ``nn.LayerNorm``, ``nn.RMSNorm``, normlab's own LayerNorm/RMSNorm, the RMSNorm
classes of Hugging Face models (Gemma's scale is 1 + weight), and timm's, channels-first ones included. A class of
the caller's is added with ``extra_classes={MyNorm: "rms_norm"}``; any other module whose class name contains "Norm"
is reported as skipped with its reason (`UNKNOWN`, ...), never silently.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from normlab.registry import NormSpec

__all__ = ["SOURCE_KINDS", "KNOWN_NORMS", "CHANNELS_FIRST", "UNKNOWN", "EXCLUDED", "find_norms", "source_dim",
           "source_eps", "site_tensor", "fresh_like", "swap", "aliases", "refuse_wrapped", "check_extra_classes",
           "class_entries",
           "no_norms_error", "guess_kind", "FIXED_EPS"]  # fmt: skip

# class name -> how it normalizes ("layer_norm", "rms_norm", or "rms_norm_offset": scale is 1 + weight)
#: How a norm class of the caller's normalizes (``extra_classes=``'s values).
SOURCE_KINDS = ("layer_norm", "rms_norm", "rms_norm_offset")

KNOWN_NORMS: dict[str, str] = {
    "LayerNorm": "layer_norm",  # torch.nn.LayerNorm (GPT-2, BERT, ...) and normlab's
    "RMSNorm": "rms_norm",  # torch.nn.RMSNorm and normlab's
    "LlamaRMSNorm": "rms_norm",
    "Qwen2RMSNorm": "rms_norm",
    "Qwen3RMSNorm": "rms_norm",
    "MistralRMSNorm": "rms_norm",
    "MixtralRMSNorm": "rms_norm",
    "Phi3RMSNorm": "rms_norm",
    "T5LayerNorm": "rms_norm",
    "ConvNextLayerNorm": "layer_norm",  # channels_last or channels_first (data_format): the replacement follows
    "GemmaRMSNorm": "rms_norm_offset",
    "Gemma2RMSNorm": "rms_norm_offset",
    "Gemma3RMSNorm": "rms_norm_offset",
    "OlmoLayerNorm": "layer_norm",  # no parameters; its eps is fixed in its forward (FIXED_EPS)
    "CohereLayerNorm": "layer_norm",  # subtracts the mean; a weight, no bias
    "Llama4TextWeightlessRMSNorm": "rms_norm",  # Llama 4's q/k norm: no weight, so no width; both doors skip it
    "RmsNorm": "rms_norm",  # timm's
    "LayerNorm2d": "layer_norm",  # timm's channels-first norms (ConvNeXt, EfficientFormer...): (N, C, H, W)
    "RmsNorm2d": "rms_norm",
}
#: The eps of known classes that write it into their forward instead of keeping it as an attribute.
FIXED_EPS = {"OlmoLayerNorm": 1e-5}
#: Known norm classes that normalize over axis 1 of an (N, C, H, W) map: their replacement gets ``channel_dim=1``.
CHANNELS_FIRST = ("LayerNorm2d", "RmsNorm2d")


#: Why `find_norms` leaves a module that looks like a norm: a class it does not know, or one ``include=`` refused.
UNKNOWN = "not a known per-token norm (add it with extra_classes=)"
EXCLUDED = "excluded by include="


def _kind(module: nn.Module, extra: dict) -> str | None:
    for cls, kind in extra.items():
        if isinstance(module, cls):
            return kind
    name = type(module).__name__
    if name in KNOWN_NORMS:
        return KNOWN_NORMS[name]
    if name.endswith("RMSNorm") and hasattr(module, "weight"):  # an RMSNorm of a model not in the table
        return "rms_norm_offset" if name.startswith("Gemma") else "rms_norm"
    return None


def source_eps(module: nn.Module) -> float:
    """A norm's eps (``eps`` or ``variance_epsilon``), else its weight dtype's machine epsilon (nn.RMSNorm(eps=None)).

    Args:
        module: The norm.
    """
    for attr in ("eps", "variance_epsilon"):
        v = getattr(module, attr, None)
        if isinstance(v, (int, float)):
            return float(v)
    if type(module).__name__ in FIXED_EPS:
        return FIXED_EPS[type(module).__name__]
    w = getattr(module, "weight", None)
    return float(torch.finfo(w.dtype if w is not None else torch.float32).eps)  # nn.RMSNorm(eps=None)


def source_dim(module: nn.Module) -> int | None:
    """A norm's channel count (its one-dimensional ``normalized_shape``, else its 1-d weight's size), else None.

    Args:
        module: The norm.
    """
    shape = getattr(module, "normalized_shape", None)
    if shape is not None:
        return int(shape[0]) if len(shape) == 1 else None
    w = getattr(module, "weight", None)
    return int(w.shape[-1]) if w is not None and w.dim() == 1 else None


def find_norms(
    model: nn.Module, extra: dict, include: Callable[[str, nn.Module], bool] | None
) -> tuple[list[tuple[str, nn.Module, str]], list[dict]]:
    """The norms of ``model`` a conversion replaces, as (name, module, kind), and the ones it leaves, each with why.

    Args:
        model: The model.
        extra: {a norm class of the caller's: its kind}.
        include: ``include(name, module)`` says whether a found norm is taken (None: every one).
    """
    found, skipped = [], []
    for name, m in model.named_modules():
        if not name:
            continue
        kind = _kind(m, extra)
        if kind is None:
            inside = any(_kind(c, extra) for _, c in m.named_modules() if c is not m)  # a head holding a norm
            if "Norm" in type(m).__name__ and not inside and not any(name.startswith(f[0] + ".") for f in found):
                skipped.append({"name": name, "class": type(m).__name__, "reason": UNKNOWN})
            continue
        if include is not None and not include(name, m):
            skipped.append({"name": name, "class": type(m).__name__, "reason": EXCLUDED})
            continue
        if source_dim(m) is None:
            shape = getattr(m, "normalized_shape", None)
            why = (
                "normalizes over more than one dimension"
                if shape is not None
                else "its channel count is unknown: no normalized_shape and no 1-d weight"
            )
            if type(m) in extra:  # the user asked for this class: say so, do not skip it quietly
                raise ValueError(f"extra_classes[{type(m).__name__}]: cannot convert {name}: {why}")
            skipped.append({"name": name, "class": type(m).__name__, "reason": why})
            continue
        found.append((name, m, kind))
    return found, skipped


def site_tensor(model: nn.Module | None, name: str, m: nn.Module) -> torch.Tensor | None:
    """The tensor whose device and dtype a replacement of the norm ``m`` (at ``name`` in ``model``) takes: its weight,
    else any parameter of its own, else, for a norm without parameters (``elementwise_affine=False``), the first
    floating parameter of its nearest enclosing module that has one (its block's, so that a bf16 or meta block gets a
    bf16 or meta replacement, and FSDP2 finds one dtype in it); None where there is none.

    Args:
        model: The model that holds ``m`` (None: ``m``'s own parameters only).
        name: Its name in ``model``.
        m: The norm.
    """
    w = getattr(m, "weight", None)
    if isinstance(w, torch.Tensor):
        return w
    own = next(iter(m.parameters()), None)
    if own is not None or model is None:
        return own
    parts = name.split(".")
    for cut in range(len(parts) - 1, -1, -1):  # the parent, its parent, ..., the model
        outer = model.get_submodule(".".join(parts[:cut])) if cut else model
        ref = next((p for p in outer.parameters() if p.is_floating_point()), None)
        if ref is not None:
            return ref
    return None


def fresh_like(
    name: str,
    m: nn.Module,
    spec: NormSpec,
    kwargs: dict,
    catch: tuple[type, ...] = (TypeError,),
    model: nn.Module | None = None,
) -> tuple[nn.Module, dict]:
    """A new ``spec`` layer in the place of the norm ``m``: its channels, its channel axis (ConvNeXt's channels_first),
    its eps where the target has one, its device and dtype (`site_tensor`: a meta model gets a meta layer, which
    ``to_empty`` plus ``reset_parameters`` fill), its train/eval mode, and frozen where every parameter of ``m`` was.
    Returns the layer and the keywords it was built with; an error of a kind in ``catch`` from building it is a
    ValueError naming the site.

    Args:
        name: The site's name, for errors.
        m: The norm replaced.
        spec: The target's registry entry.
        kwargs: The target's keywords.
        catch: The errors of building it that become a ValueError naming the site.
        model: The model that holds ``m``, where a norm without parameters takes its device and dtype from.
    """
    if getattr(m, "data_format", None) == "channels_first" or type(m).__name__ in CHANNELS_FIRST:  # (N, C, H, W)
        kwargs = {**kwargs, "channel_dim": 1}
    if "eps" in spec.init_kwargs and "eps" not in kwargs:
        kwargs = {**kwargs, "eps": source_eps(m)}  # keep the source's eps where the target has one
    ref = site_tensor(model, name, m)
    where = {} if ref is None else {"device": ref.device, "dtype": ref.dtype}
    direct = {"device", "dtype"} <= set(spec.init_kwargs)  # built there (on meta: no memory), else moved there
    try:
        new = spec.create(source_dim(m), **kwargs, **(where if direct else {}))
    except catch as e:  # an init argument the target does not take: say which site asked for it
        raise ValueError(f"site {name}: {e}") from None
    if where and not direct:
        new = new.to(**where)
    own = list(m.parameters())
    if own and not any(p.requires_grad for p in own):
        new.requires_grad_(False)  # a frozen norm stays frozen
    new.train(m.training)
    return new, kwargs


def swap(model: nn.Module, name: str, new: nn.Module) -> nn.Module:
    """Put ``new`` at the submodule ``name`` of ``model``, and wherever else the model holds that same module (a norm
    registered under two names, ``m.b = m.a``, stays one module); returns the module it replaces.

    Args:
        model: The model.
        name: The submodule's dotted name.
        new: The module put in its place.
    """
    old = model.get_submodule(name)
    holders = [
        (parent, child)
        for _, parent in model.named_modules(remove_duplicate=False)
        for child, m in parent._modules.items()
        if m is old
    ]
    for parent, child in holders:
        setattr(parent, child, new)
    return old


def aliases(model: nn.Module, name: str) -> list[str]:
    """The other names under which ``model`` holds the submodule ``name`` (a shared norm), in module order.

    Args:
        model: The model.
        name: The submodule's dotted name.
    """
    m = model.get_submodule(name)
    return [n for n, x in model.named_modules(remove_duplicate=False) if x is m and n != name]


def refuse_wrapped(model: nn.Module, who: str) -> None:
    """A model already wrapped for data or model parallelism (DDP, DataParallel, FSDP, FSDP2's ``fully_shard``, a
    DTensor parameter of tensor parallelism) is refused, with the fix: swap the norms first, then wrap. A wrapper
    holds its own view of the parameters (DDP's buckets and replicas, FSDP's shards), so a module swapped inside it
    trains on one rank only and the replicas drift.

    Args:
        model: The model.
        who: The function named in the error.
    """
    wrapper = None
    if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
        wrapper = type(model).__name__
    elif torch.distributed.is_available():
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
        from torch.distributed.tensor import DTensor

        for name, m in model.named_modules():
            if isinstance(m, (FSDPModule, FullyShardedDataParallel)):
                wrapper = f"FSDP ({name or 'the model'} is sharded by {type(m).__name__.split('.')[-1]})"
                break
        else:
            shard = next((n for n, p in model.named_parameters() if isinstance(p, DTensor)), None)
            if shard is not None:
                wrapper = f"tensor or sequence parallelism ({shard} is a DTensor)"
    if wrapper is not None:
        raise ValueError(
            f"{who}: the model is already wrapped by {wrapper}; swap its norms first, then wrap it: "
            f"{who}(model, ...) before DistributedDataParallel(model), fully_shard(...) or parallelize_module(...) "
            "(a wrapper keeps its own view of the parameters, so a module swapped inside it would train on one rank)"
        )


def class_entries(entries: list[str], flag: str = "--extra-class") -> dict[type, str]:
    """``extra_classes`` from the command line's entries ``module:Class=kind`` (``kind`` one of `SOURCE_KINDS`),
    each class imported; a malformed entry, a module or class that is not there, or another kind is one error
    naming the entry and the flag.

    Args:
        entries: ``"package.module:Class=layer_norm"`` strings.
        flag: How errors name the option.
    """
    import importlib

    out = {}
    for entry in entries:
        where, _, kind = str(entry).partition("=")
        module, _, name = where.partition(":")
        if not (module and name and kind):
            raise ValueError(f"{flag} {entry!r}: give module:Class=kind, e.g. my_pkg.norms:MyNorm=layer_norm")
        if kind not in SOURCE_KINDS:
            raise ValueError(f"{flag} {entry!r}: the kind must be one of {', '.join(SOURCE_KINDS)}, got {kind!r}")
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as e:
            raise ValueError(
                f"{flag} {entry!r}: cannot import {name} from {module} ({type(e).__name__}: {e})"
            ) from None
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise ValueError(f"{flag} {entry!r}: {module}.{name} is not a torch.nn.Module class")
        out[cls] = kind
    return out


def check_extra_classes(extra_classes: object, who: str) -> None:
    """``extra_classes`` is {a norm class: one of `SOURCE_KINDS`}; anything else is an error saying the form.

    Args:
        extra_classes: The caller's {class: kind}, or None.
        who: The function named in the error.
    """
    if extra_classes is not None and not isinstance(extra_classes, dict):
        raise TypeError(f"{who}: extra_classes must be a dict {{norm class: kind}}, got {extra_classes!r}")
    for cls, kind in (extra_classes or {}).items():
        if not isinstance(cls, type):
            raise TypeError(
                f"{who}: extra_classes is keyed by the norm class itself, not by {cls!r}: "
                f"extra_classes={{MyNorm: {kind!r}}}"
            )
        if kind not in SOURCE_KINDS:
            kinds = ", ".join(SOURCE_KINDS)
            raise ValueError(f"{who}: extra_classes[{cls.__name__}] = {kind!r}; how it normalizes is one of {kinds}")


def guess_kind(class_name: str) -> str:
    """How a norm class normlab does not know most likely normalizes, by its name: "layer_norm" where the name says
    LayerNorm (it subtracts the mean: OLMo's, Cohere's), else "rms_norm" (the common kind of today's models).

    Args:
        class_name: The class's name.
    """
    name = class_name.lower()
    return "layer_norm" if "layernorm" in name.replace("_", "") and "rms" not in name else "rms_norm"


def no_norms_error(model: nn.Module, who: str, skipped: list[dict] | None = None) -> ValueError:
    """The error for a model in which `find_norms` found nothing to replace: one that holds normlab norms already
    (swapped or converted before) is told to start from the original; one whose norms are of a class normlab does not
    know is told how to register it (from Python, or ``--extra-class`` on the command line).

    Args:
        model: The model.
        who: The function named in the error.
        skipped: `find_norms`' skipped modules, whose unknown classes the error names.
    """
    from normlab.modules import NormModule

    ours = [n for n, m in model.named_modules() if isinstance(m, NormModule)]
    if ours:
        return ValueError(
            f"{who}: {type(model).__name__} is already converted or swapped ({len(ours)} normlab norms, e.g. "
            f"{ours[0]}) and holds no other norm to replace; start from the original model"
        )
    strangers = sorted({s["class"] for s in skipped or [] if s["reason"] == UNKNOWN})
    add = "add yours with extra_classes="
    if strangers:
        entry = f"{{{strangers[0]}: '{guess_kind(strangers[0])}'}}"
        add = f"its {', '.join(strangers)} is not one: from Python, pass extra_classes={entry}; on the command "
        add += f"line, --extra-class MODULE:{strangers[0]}={guess_kind(strangers[0])}"
    return ValueError(
        f"{who}: {type(model).__name__} has no norm to replace (found no normalization module of a known class: "
        f"{', '.join(sorted(KNOWN_NORMS))}; {add})"
    )
