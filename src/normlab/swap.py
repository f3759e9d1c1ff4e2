"""Swap the norms of a model you will train for fresh element-wise layers, with a published init recipe per site.

    import normlab
    record = normlab.replace_norms(model, "dyt", init="dyt_paper")       # in place; returns what it did
    print(record.table())

This is the papers' drop-in: DyT (Zhu et al., "Transformers without Normalization", arXiv 2503.10622), Derf or
DyISRU in place of each LayerNorm / RMSNorm of any ``nn.Module``: a Hugging Face model built from a config, a
nanoGPT-style model, a ViT block. Each replacement is a new layer (gamma = 1, beta = 0, its parameter from the
recipe), on the original's device and dtype, in its train/eval mode. To carry a *trained* model's norms over
instead (its gamma copied, its parameter fitted to its activations), use `normlab.convert_norms`.

The norms are found by `normlab.sites`, as `normlab.convert_norms` finds them (``extra_classes=``, ``include=``);
the recipes are `normlab.recipes` (``init="default"``, ``"dyt_paper"``, ``"derf_paper"``, and ``"match_rms"``,
alone or after one of the others, with ``sample=``). The record is a `ConversionRecord`, so that
`normlab.save_converted` writes a folder that loads with or without normlab.

Everything is checked before the first module is swapped: an unknown target or recipe, a recipe that does not
apply to the target, a site whose role a recipe needs and cannot tell, a norm class normlab does not know, a model
with no norms. A refused call leaves the model as it was.
"""

from __future__ import annotations

import fnmatch
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from normlab.embed_scale import embedding_tables, scale_embeddings
from normlab.recipes import (
    LM_CHANGES,
    MATCH_RMS_CAVEAT,
    PAPERS,
    RECIPES,
    ROLES,
    RoleUnknown,
    match_rms_,
    paper_assumption,
    recipe_kwargs,
    site_role,
    token_sample,
)
from normlab.record import ConversionRecord, Site
from normlab.registry import norm_spec
from normlab.sites import (
    UNKNOWN,
    aliases,
    check_extra_classes,
    find_norms,
    fresh_like,
    guess_kind,
    no_norms_error,
    refuse_wrapped,
    source_dim,
    source_eps,
    swap,
)

__all__ = ["replace_norms", "SwapRecord"]


AUTO_FALLBACK = (
    "a fresh point-wise layer on a model initialised at small scale is far quieter than the norm it replaces and "
    "may barely learn: pass sample= (one batch of the model's forward), or init='dyt_paper' where its assumptions hold"
)


@dataclass
class SwapRecord(ConversionRecord):
    """What `replace_norms` did: a `ConversionRecord` (saved and loaded as one) with the recipes applied and each
    site's role. ``table()`` lists the sites: name, the class replaced, its role, the new layer and its init."""

    recipes: list[str] = field(default_factory=list)

    def table(self, markdown: bool = False) -> str:
        from normlab.table import format_table

        rows = [
            [
                s.name,
                s.source,
                s.notes[0].removeprefix("role ") if s.notes else "-",
                self.target,
                "; ".join(s.notes[1:]) or "default init",
            ]
            for s in self.sites
        ]
        return format_table(["site", "replaced", "role", "now", "init"], rows, markdown=markdown)

    def __len__(self) -> int:
        return len(self.sites)


def _recipes(init: str | Sequence[str]) -> list[str]:
    names = [init] if isinstance(init, str) else list(init) if isinstance(init, (list, tuple)) else []
    if not names or not all(isinstance(n, str) for n in names):
        raise TypeError(f"replace_norms: init must be a recipe's name or a list of them, got {init!r}")
    for n in names:
        if n not in RECIPES:
            raise ValueError(f"replace_norms: unknown init recipe {n!r}; the recipes are {', '.join(RECIPES)}")
    if "auto" in names and len(names) > 1:
        raise ValueError(
            f"replace_norms: init={names!r}: 'auto' is the layers' own init with its gain matched already; give it "
            "alone, or another recipe followed by 'match_rms'"
        )
    if "match_rms" in names[:-1] or len([n for n in names if n != "match_rms"]) > 1:
        raise ValueError(
            f"replace_norms: init={names!r}: give one of {', '.join(r for r in RECIPES if r != 'match_rms')}, "
            "optionally followed by 'match_rms' (which scales gamma after the swap)"
        )
    return names


def _call(model: nn.Module, sample: object) -> Callable[[], object]:
    """One forward of ``model`` on ``sample``: a tensor (``model(x)``), a dict (``model(**d)``) or a tuple."""
    if isinstance(sample, torch.Tensor):
        return lambda: model(sample)
    if isinstance(sample, dict):
        return lambda: model(**sample)
    if isinstance(sample, (tuple, list)):
        return lambda: model(*sample)
    raise TypeError(
        f"replace_norms: sample must be a tensor, a dict of keyword arguments or a tuple of arguments for one forward "
        f"of the model, got {type(sample).__name__}"
    )


def _check_kinds(roles, extra_classes, include) -> None:
    """The mapping and callable arguments, each of the kind its docstring names: a one-line error saying what to
    give, never a raw Python error from deep inside."""
    if roles is not None and not (isinstance(roles, dict) and all(isinstance(k, str) for k in roles)):
        raise TypeError(
            f"replace_norms: roles must be a dict {{fnmatch pattern of a site's name: role}}, e.g. "
            f"{{'*.ln_1': 'attn'}}; got {roles!r}"
        )
    for key, role in (roles or {}).items():
        if role not in ROLES:
            raise ValueError(f"replace_norms: roles[{key!r}] = {role!r}; a role is one of {', '.join(ROLES)}")
    check_extra_classes(extra_classes, "replace_norms")
    if include is not None and not callable(include):
        hint = f"include=lambda name, m: fnmatch.fnmatch(name, {include!r})" if isinstance(include, str) else ""
        raise TypeError(
            f"replace_norms: include must be a function include(name, module) -> bool, got {include!r}"
            + (f"; for a pattern: {hint}" if hint else "")
        )


def _check_arguments(model, to, init, sample, kwargs) -> tuple:
    """replace_norms' arguments, each checked before the model is looked at: (the target's spec, the recipes, the
    forward match_rms runs or None; for 'auto', `_auto_run`'s triple)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"replace_norms: expected an nn.Module, got {type(model).__name__}")
    refuse_wrapped(model, "replace_norms")
    spec = norm_spec(to)  # an unknown name lists the registered ones
    recipes = _recipes(init)
    run = None
    if recipes == ["auto"]:
        run = _auto_run(model, spec, sample)
    elif "match_rms" in recipes:
        if not spec.pointwise:
            raise ValueError(f"replace_norms: match_rms scales the gamma of a point-wise norm; {to!r} is not one")
        if sample is None:
            raise ValueError("replace_norms: init 'match_rms' needs sample=, one batch the model's forward takes")
        meta = next((n for n, p in model.named_parameters() if p.is_meta), None)
        if meta is not None:
            raise ValueError(
                f"replace_norms: init 'match_rms' measures a forward, and the model is on the meta device ({meta}): "
                "swap with a recipe without it, materialise the weights (to_empty, then your init or a checkpoint), "
                "then call normlab.recipes.match_rms_"
            )
        run = _call(model, sample)
    elif sample is not None:
        raise ValueError(
            f"replace_norms: sample= is read by init 'auto' and 'match_rms' only, and init is {init!r}: pass "
            f"init=[{recipes[0]!r}, 'match_rms'] to use it, or leave sample= out"
        )
    unknown_kw = sorted(set(kwargs) - set(spec.init_kwargs))
    if unknown_kw:
        raise TypeError(
            f"replace_norms: {to!r} does not take {', '.join(unknown_kw)}; it takes {', '.join(spec.init_kwargs)}"
        )

    return spec, recipes, run


def _auto_run(model: nn.Module, spec, sample: object) -> tuple[Callable[[], object] | None, bool, str]:
    """init 'auto': (the forward its gain matching runs, whether the swap drew its sample, why there is none)."""
    if not spec.pointwise:
        return None, False, f"{spec.name} is not point-wise, so there is no gain to match: its own init"
    if sample is not None:
        return _call(model, sample), False, ""
    ids, why = token_sample(model)
    if ids is None:
        return None, True, why
    return (lambda: model(ids)), True, ""


def _auto_match(model: nn.Module, originals: dict[str, nn.Module], auto: tuple) -> tuple[dict, str]:
    """init 'auto' after the swap: match_rms on its forward; a forward on drawn ids that fails leaves the layers at
    their own init (a user's sample= that fails is refused, as for match_rms). Returns (factors, why none)."""
    run, drawn, why = auto
    if run is None:
        return {}, why
    if not drawn:
        return _match_or_restore(model, originals, run), ""
    sites = {n: model.get_submodule(n) for n in originals}
    gains = {n: m.weight.detach().clone() for n, m in sites.items() if getattr(m, "weight", None) is not None}
    try:
        return match_rms_(model, sites, run), ""
    except Exception as e:  # noqa: BLE001  (whatever the model's forward raises on ids it does not take)
        with torch.no_grad():
            for n, w in gains.items():
                sites[n].weight.copy_(w)
        return {}, f"the model's forward refused the drawn token ids ({type(e).__name__}: {str(e)[:200]})"


def _paper_embedding(model: nn.Module, base: str, tables: list[str], originals: dict[str, nn.Module]) -> list[str]:
    """A paper recipe's embedding scale (`normlab.embed_scale`), put in place with the tables' modules added to
    ``originals`` (so that a refused match_rms restores them too), and its notes: what it did, or that the model has
    no embedding to scale, and a warning where the model's initialisation breaks the recipe's assumption."""
    if base not in PAPERS:
        return []
    if not tables:
        return [f"init {base!r}: no token embedding found, so the paper's embedding scale is not applied (its "
                "vision models have none)"]  # fmt: skip
    why = paper_assumption(model, base)
    for name in tables:
        originals.setdefault(name, model.get_submodule(name))
    value = scale_embeddings(model, tables)
    notes = [f"init {base!r}: {LM_CHANGES}: {', '.join(tables)} x {value:.4g} (learnable)"]
    if why:
        warnings.warn(f"replace_norms: {why}", RuntimeWarning, stacklevel=3)
        notes.append(why)
    return notes


def _match_gains(model: nn.Module, spec, recipes: list[str], run, originals: dict, sites: list[Site]) -> list[str]:
    """The gain matching of 'auto' or 'match_rms' after the swap: each site's factor in its notes; the record's
    notes returned (the caveat, or why 'auto' kept the own init, said once as a warning too)."""
    if recipes == ["auto"]:
        factors, why = _auto_match(model, originals, run)
        label = "auto"
    elif run is not None:
        factors, why, label = _match_or_restore(model, originals, run), "", "match_rms"
    else:
        return []
    for site in sites:
        if site.name in factors:
            site.notes.append(f"{label}: gamma x {factors[site.name]:.4g}")
    if not why:
        return [MATCH_RMS_CAVEAT]
    said = f"replace_norms: init 'auto' kept the layers' own init: {why}; {AUTO_FALLBACK}"
    if spec.pointwise:
        warnings.warn(said, RuntimeWarning, stacklevel=3)
    return [said]


def _check_roles_used(roles: dict | None, names: list[str]) -> None:
    """Every ``roles`` pattern names a site swapped here: one that matches none is a typo, not a no-op."""
    unused = [p for p in roles or {} if not any(fnmatch.fnmatchcase(n, p) for n in names)]
    if unused:
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        raise ValueError(
            f"replace_norms: roles pattern {unused[0]!r} matches no norm swapped here (a pattern matches the whole "
            f"name: '*ln_1', not 'ln_1'); the sites are {shown}"
        )


def _match_or_restore(model: nn.Module, originals: dict[str, nn.Module], run: Callable[[], object]) -> dict:
    """match_rms on the swapped sites; a forward that fails puts every original back before the error."""
    try:
        return match_rms_(model, {n: model.get_submodule(n) for n in originals}, run)
    except Exception as e:  # noqa: BLE001  (whatever the user's forward raises): the model goes back as it was
        for name, old in originals.items():
            swap(model, name, old)
        raise ValueError(
            f"replace_norms: init 'match_rms' runs the model on sample=, and the forward failed "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); the model is left as it was. "
            "Pass one batch the model's forward takes (a tensor, a dict of keyword arguments, a tuple)"
        ) from e


def replace_norms(
    model: nn.Module,
    to: str = "dyt",
    init: str | Sequence[str] = "auto",
    *,
    sample: object = None,
    roles: dict[str, str] | None = None,
    extra_classes: dict[type, str] | None = None,
    include: Callable[[str, nn.Module], bool] | None = None,
    **kwargs: object,
) -> SwapRecord:
    """Replace every norm of ``model`` with a fresh ``to`` layer, in place, initialised by ``init``; return the record.

    Args:
        model: Any ``nn.Module``; changed in place.
        to: A registered norm (`normlab.list_norms`): "dyt", "derf", "dyisru", "eln", ...
        init: "auto" (each layer's own init, then gamma matched as "match_rms" does, on ``sample`` or on random
            token ids drawn for the model's input embedding; where none can be drawn, the own init and a warning),
            "default" (each layer's own init), "dyt_paper" (the DyT paper's alpha0 by width and site; beta0 =
            1 / alpha0^2 for DyISRU and ELN), "derf_paper" (Derf's alpha0 = 0.5, shift0 = 0), or either followed
            by "match_rms", e.g. ``["dyt_paper", "match_rms"]``, or "match_rms" alone (gamma scaled so that each
            site's output RMS is 1 on ``sample``: a short-budget win, `normlab.recipes.MATCH_RMS_CAVEAT`).
        sample: One batch the model's forward takes (a tensor, a dict of keyword arguments, a tuple): needed by
            "match_rms", read by "auto" (which otherwise draws token ids).
        roles: {fnmatch pattern of a site's name: "attn", "mlp" or "final"}, for the sites whose names do not say
            where they sit (`normlab.recipes.ROLE_NAMES` lists the names known).
        extra_classes: {a norm class of yours: "layer_norm", "rms_norm" or "rms_norm_offset"}, for norm classes
            normlab does not know.
        include: ``include(name, module)`` says whether a found norm is replaced (False leaves it as it is).
        **kwargs: Keywords of every new layer, e.g. ``per_channel_alpha=True``; one a recipe sets is refused.
    """
    _check_kinds(roles, extra_classes, include)
    spec, recipes, run = _check_arguments(model, to, init, sample, kwargs)
    base = next((r for r in recipes if r != "match_rms"), "default")
    found, skipped = find_norms(model, dict(extra_classes or {}), include)
    strangers = [
        s
        for s in skipped
        if s["reason"] == UNKNOWN and (include is None or include(s["name"], model.get_submodule(s["name"])))
    ]
    if strangers:
        s = strangers[0]
        raise ValueError(
            f"replace_norms: {s['name']} is a {s['class']}, a norm class normlab does not know ({len(strangers)} "
            f"such). Register it with extra_classes={{{s['class']}: '{guess_kind(s['class'])}'}} (or how else it "
            f"normalizes), or leave it with include=lambda name, m: not isinstance(m, {s['class']})"
        )
    if not found:
        raise no_norms_error(model, "replace_norms", skipped)

    _check_roles_used(roles, [n for n, _, _ in found])
    tables = embedding_tables(model) if base in PAPERS else []
    built = []  # every layer built before the first swap: a refused call leaves the model untouched
    for name, old, kind in found:
        dim, eps = source_dim(old), source_eps(old)
        role = site_role(name, roles)
        try:
            kw, note = recipe_kwargs(base, spec, role, dim, lm=bool(tables))
        except RoleUnknown:
            raise ValueError(
                f"replace_norms: init 'dyt_paper' sets alpha0 by where a norm sits, and the name {name!r} does not "
                f"say: pass roles={{'*{name.rsplit('.', 1)[-1]}': 'attn'}} ('attn': before attention, 'mlp': before "
                "the MLP, 'final': before the head)"
            ) from None
        except ValueError as e:
            raise ValueError(f"replace_norms: {e}") from None
        clash = sorted(set(kw) & set(kwargs))
        if clash:
            raise ValueError(f"replace_norms: {clash[0]} is set by init {base!r} and by a keyword: give it once")
        try:
            new, kw = fresh_like(name, old, spec, {**kw, **kwargs}, catch=(TypeError, ValueError), model=model)
        except ValueError as e:
            raise ValueError(f"replace_norms: {e}") from None
        said = ([] if base in ("default", "auto") else [note]) + [f"{k}={v!r}" for k, v in kwargs.items()]
        also = aliases(model, name)
        notes = [f"role {role or '-'}"] + ["; ".join(said)] * bool(said) + [f"also at {a}" for a in also]
        built.append((name, new, Site(name, type(old).__name__, kind, dim, eps, kw, notes=notes)))

    originals = {name: swap(model, name, new) for name, new, _ in built}
    sites = [site for _, _, site in built]
    notes = [f"replace_norms: {len(sites)} fresh {to} layers, init {'+'.join(recipes)}"]
    notes += _paper_embedding(model, base, tables, originals)
    notes += _match_gains(model, spec, recipes, run, originals, sites)
    return SwapRecord(to, "global", sites, skipped, notes, embed_scale=tables, recipes=recipes)
