"""Swap the norms of any PyTorch or Hugging Face model for a registered norm, fitted to the model's own activations.

    import normlab
    record = normlab.convert_norms(model, to="dyisru", calibrate=batches)   # in place; returns what it did
    print(record.table())
    report = normlab.fidelity(original, model, held_out)                     # how close the converted model is

The norms are found, built and swapped by `normlab.sites` (``KNOWN_NORMS``, ``extra_classes=``), as
`normlab.replace_norms` finds them; restrict the sites with ``include=lambda name, module: ...``.

Calibration (``calibrate=`` sample inputs or a dataloader) fits each replacement, site by site in the order the
model runs them, on the activations of the model as converted so far, so that its output after the affine
matches the original norm's; massive tokens can get their own replacement (`normlab.conversion.calibrate.massive`).
Every target is fitted with the same two degrees of freedom, its parameter (DyISRU/ELN beta, DyT alpha) and an
amplitude folded into the copied weight. ``per="channel"`` fits one of each per channel.

Conversion is all-or-nothing: every replacement is built before the first module is swapped, and a calibration
that fails part-way puts every original norm back.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Callable, Iterable

import torch
from torch import nn

from normlab.conversion.calibrate.sites import calibrate_sites, per_channel_kwargs
from normlab.conversion.config import CalibrateConfig, ConvertConfig
from normlab.conversion.export.saving import apply_record, load_converted, save_converted
from normlab.conversion.measure.fidelity import fidelity
from normlab.record import ConversionRecord, Site
from normlab.registry import NormSpec, calibratable_norms, norm_spec
from normlab.sites import (
    EXCLUDED,
    check_extra_classes,
    find_norms,
    fresh_like,
    no_norms_error,
    refuse_wrapped,
    source_dim,
    source_eps,
    swap,
)
from normlab.typed import check_types

__all__ = ["ConversionRecord", "convert_norms", "apply_record", "fidelity", "save_converted", "load_converted",
           "CALIBRATABLE", "resolve_options"]  # fmt: skip

CALIBRATABLE = tuple(calibratable_norms())  # the registry says what a fit sets


# --------------------------------------------------------------------------
# finding and building
# --------------------------------------------------------------------------
def _site_kwargs(name: str, init: dict, site_init: dict) -> dict:
    kw = dict(init)
    for pattern, extra in site_init.items():
        if fnmatch.fnmatch(name, pattern):
            kw.update(extra)
    return kw


def _build(
    model: nn.Module, name: str, m: nn.Module, kind: str, spec: NormSpec, kwargs: dict
) -> tuple[nn.Module, Site]:
    new, kwargs = fresh_like(name, m, spec, kwargs, model=model)
    site = Site(name, type(m).__name__, kind, source_dim(m), source_eps(m), kwargs)
    w = getattr(m, "weight", None)
    b = getattr(m, "bias", None)
    with torch.no_grad():
        if getattr(new, "weight", None) is not None:
            if w is not None and new.weight.shape != w.shape:
                raise ValueError(
                    f"convert: {name}: the replacement's gamma is {tuple(new.weight.shape)} (scalar_gain=True?) and "
                    f"cannot hold the model's {tuple(w.shape)} gamma; a conversion keeps the per-channel gamma: "
                    "leave scalar_gain out"
                )
            if w is not None:
                new.weight.copy_(w.detach() + 1.0 if kind == "rms_norm_offset" else w.detach())
                site.copied.append("weight (1 + weight)" if kind == "rms_norm_offset" else "weight")
        elif w is not None:
            site.notes.append("weight dropped: the target has none")
        if isinstance(b, torch.Tensor):
            if getattr(new, "bias", None) is not None:
                new.bias.copy_(b.detach())
                site.copied.append("bias")
            else:
                site.notes.append("bias dropped: the target has none")
    if getattr(new, "initialized", None) is not None and "running_ms" in dict(new.named_buffers()):  # rms_ema
        site.notes.append(
            "its running mean square is the placeholder 1.0 until primed: normlab.modules.prime_running_stats(model, "
            "batch), or a forward in training mode"
        )
    return new, site


# --------------------------------------------------------------------------
SITE_FIELDS = ("per", "init", "site_init")  # ConvertConfig's fields that shape every site, beside its calibrate section


def _keyword(key: str) -> str:
    """How the Python API names a field: its keyword (``calibrate.massive_tokens`` -> ``massive_tokens``)."""
    return key.rsplit(".", 1)[-1]


def resolve_options(
    to: str | None, config: ConvertConfig | CalibrateConfig | None, overrides: dict, calibrating: bool
) -> tuple[NormSpec, ConvertConfig]:
    """convert_norms's target (its `NormSpec`, resolved here once and passed down) and its settings as one
    `ConvertConfig`: ``config`` (a `ConvertConfig`, a `CalibrateConfig` or None: the defaults), then ``overrides``
    (any field of `CalibrateConfig`, or per / init / site_init), validated by the config's own checks, so that the
    Python API and ``normlab convert`` cannot disagree on a default or a rule.

    Args:
        to: The target norm's registry name; None takes the config's.
        config: A `ConvertConfig`, a `CalibrateConfig` or None (the defaults).
        overrides: Fields set on top of ``config``.
        calibrating: Whether a calibration will run (a fitted parameter is needed).
    """
    if config is None or isinstance(config, CalibrateConfig):
        base = ConvertConfig(calibrate=config or CalibrateConfig())
    elif isinstance(config, ConvertConfig):
        base = config
    else:
        raise TypeError(
            f"convert_norms: config must be a CalibrateConfig or a ConvertConfig, got {type(config).__name__}"
        )
    cal_fields = {f.name for f in dataclasses.fields(CalibrateConfig)}
    unknown = sorted(set(overrides) - cal_fields - set(SITE_FIELDS))
    if unknown:
        raise TypeError(
            f"convert_norms: unknown option {unknown[0]!r}; the options are {', '.join(SITE_FIELDS)} and "
            f"CalibrateConfig's {', '.join(sorted(cal_fields))}"
        )
    if to is not None and isinstance(config, ConvertConfig) and to != config.to:
        raise ValueError(f"convert_norms: to={to!r} and config.to={config.to!r} disagree: give the target once")
    if config is not None:
        _check_agree(base, overrides, cal_fields)
    cfg = dataclasses.replace(
        base,
        to=base.to if to is None else to,
        calibrate=dataclasses.replace(base.calibrate, **{k: v for k, v in overrides.items() if k in cal_fields}),
        **{k: {} if v is None and k != "per" else v for k, v in overrides.items() if k in SITE_FIELDS},
    )
    if not isinstance(cfg.to, str):
        raise TypeError(f"convert_norms: to must be a registered norm's name, got {cfg.to!r}")
    spec = norm_spec(cfg.to)  # the target, resolved here once (an unknown name lists the valid ones)
    check_types(cfg, "", _keyword)
    cfg.calibrate.validate(spec if calibrating else None, _keyword)
    return spec, cfg


def _excluding(patterns: list[str], include: Callable | None) -> Callable:
    """``include`` (None: every norm) without the norms whose names match one of ``patterns`` (fnmatch)."""

    def keep(name: str, module: nn.Module) -> bool:
        return not any(fnmatch.fnmatch(name, p) for p in patterns) and (include is None or include(name, module))

    return keep


def _check_agree(base: ConvertConfig, overrides: dict, cal_fields: set) -> None:
    """A keyword may set a field the given config leaves at its default; one that contradicts a value the config
    sets is refused, naming both (it won silently before, issue 65). A config's heal and budget sections are run by
    `normlab.conversion.workflow.convert_model` (``normlab convert``), not here: refused rather than dropped."""
    plain, plain_cal = ConvertConfig(), CalibrateConfig()
    for key, value in overrides.items():
        section, plain_section = (base.calibrate, plain_cal) if key in cal_fields else (base, plain)
        have = getattr(section, key)
        if have != getattr(plain_section, key) and have != value:
            raise ValueError(f"convert_norms: {key}={value!r} and the config's {key}={have!r} disagree: give it once")
    if base.heal.budgeted or base.budget.nats is not None:
        part = "heal (heal.minutes / heal.tokens)" if base.heal.budgeted else "budget walk (budget.nats)"
        raise ValueError(
            f"convert_norms: the config asks for a {part}, which convert_norms does not run: pass the config to "
            "normlab.conversion.workflow.convert_model (what normlab convert runs), or drop that section"
        )


def _check_options(model, to, calibrate, extra_classes) -> None:
    """Every argument of convert_norms checked before the model is touched; a bad one is a clear error."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert_norms: expected an nn.Module, got {type(model).__name__}")
    refuse_wrapped(model, "convert_norms")
    if calibrate is not None and to not in CALIBRATABLE:
        raise ValueError(
            f"calibration fits the parameter of {', '.join(CALIBRATABLE)}; {to!r} has none to fit "
            "(convert without calibrate=)"
        )
    check_extra_classes(extra_classes, "convert_norms")


def convert_norms(
    model: nn.Module,
    to: str | None = None,
    calibrate: torch.Tensor | dict | Iterable | None = None,
    *,
    config: CalibrateConfig | ConvertConfig | None = None,
    extra_classes: dict[type, str] | None = None,
    include: Callable[[str, nn.Module], bool] | None = None,
    progress: bool | None = None,
    **overrides: object,
) -> ConversionRecord:
    """Replace the model's norms with ``to`` in place; return the record of what was done.

    Its settings are the fields of `normlab.conversion.config.ConvertConfig` that ``normlab convert`` uses, with
    the same defaults and checks: ``config`` gives a `CalibrateConfig` (or a whole `ConvertConfig`), and a keyword
    overrides one field (``per="channel"``, ``massive_tokens="shared"``, ``solver="lbfgs"``, ...).

    Args:
        model: the model, converted in place.
        to: a registered norm (default: the config's, "dyisru").
        calibrate: sample inputs (tensor, dict of kwargs, list, or dataloader) to fit the new parameters on, site by
            site in the order the model runs them (`normlab.conversion.calibrate.sites`); None keeps the default init.
        config: a `CalibrateConfig` or a `ConvertConfig` (its ``to``, ``per``, ``init``, ``site_init`` and
            ``calibrate`` section); None: the defaults.
        extra_classes: {a norm class of yours: "layer_norm", "rms_norm" or "rms_norm_offset"}.
        include: ``include(name, module)`` says whether a found norm is converted.
        progress: a progress bar over the sites (None: only on a terminal).
        **overrides: fields of the config, by name: ``per`` ("global" or "channel": one fitted parameter per
            channel), ``init`` (kwargs of every replacement), ``site_init`` ({fnmatch pattern: kwargs}, e.g. DyT's
            LLaMA recipe ``{"*input_layernorm": {"alpha_init": 0.8}}``), and any `CalibrateConfig` field
            (``massive_tokens``, ``target``, ``max_tokens``, ``massive``, ``fit_amplitude``, ``sequential``,
            ``solver``), whose docstrings say what each does.
    """
    spec, cfg = resolve_options(to, config, overrides, calibrate is not None)
    to = spec.name
    if not cfg.calibrate.enabled:
        calibrate = None
    _check_options(model, to, calibrate, extra_classes)
    extra = dict(extra_classes or {})
    if cfg.exclude:  # the config's exclude, as normlab convert applies it, beside any include= of the caller's
        include = _excluding(cfg.exclude, include)
    found, skipped = find_norms(model, extra, include)
    excluded = [s["name"] for s in skipped if s["reason"] == EXCLUDED]
    if not found and excluded:
        raise ValueError(
            f"convert_norms: every one of the {len(excluded)} norms of {type(model).__name__} is excluded "
            f"(include= / --exclude; e.g. {excluded[0]}): nothing is left to convert; exclude fewer"
        )
    if not found:
        raise no_norms_error(model, "convert_norms", skipped)
    init, site_init = cfg.init, cfg.site_init
    # a pattern names a norm of the model (a typo is an error), not one of this call's sites: a site excluded here,
    # or converted by an earlier call (a walk's refit of one site; the next walk of heal.steps), is not a typo
    from normlab.modules import NormModule

    norms = [n for n, _, _ in found] + excluded + [n for n, m in model.named_modules() if isinstance(m, NormModule)]
    unused = [pat for pat in site_init if not any(fnmatch.fnmatch(name, pat) for name in norms)]
    if unused:
        names = ", ".join(norms[:4]) + (", ..." if len(norms) > 4 else "")
        raise ValueError(f"site_init: pattern {unused[0]!r} matches no norm of the model; its norms are {names}")

    per_kw = per_channel_kwargs(spec) if cfg.per == "channel" else {}
    replacements, sites = {}, []
    for name, m, kind in found:  # build everything first: an error here leaves the model untouched
        new, site = _build(model, name, m, kind, spec, {**per_kw, **_site_kwargs(name, init, site_init)})
        replacements[name] = new
        sites.append(site)
    notes, path = [], {}
    if calibrate is not None:  # fits and swaps site by site; puts every original back if anything fails
        pairs = [(site, replacements[site.name]) for site in sites]
        decision, path, kept = calibrate_sites(model, pairs, calibrate, cfg, spec=spec, progress=progress)
        notes.append(decision)
        if kept:
            notes.append(f"{len(kept)} sites before the massive activation forms keep their original norm")
            skipped += [{"name": s.name, "class": s.source, "reason": kept[s.name]} for s in sites if s.name in kept]
            sites = [s for s in sites if s.name not in kept]
    else:
        for name, new in replacements.items():  # the swap itself
            swap(model, name, new)
    return ConversionRecord(to, cfg.per, sites, skipped, notes, path)
