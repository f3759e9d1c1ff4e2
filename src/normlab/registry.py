"""One name-to-layer map. Models, experiments and the command line take a name.

```python
import normlab
normlab.list_norms()[:3]  # ['dyisru', 'dyt', 'dyt_hardtanh']
norm = normlab.create_norm("dyt", 64, alpha_init=1.0)
```
"""

from __future__ import annotations

import difflib
import functools
import inspect
from dataclasses import dataclass

from torch import nn

from normlab import elementwise as E
from normlab import modules as M

__all__ = ["NormSpec", "register", "create_norm", "list_norms", "norm_spec", "init_kwargs", "accepted_kwargs",
           "norm_layer"]  # fmt: skip


@dataclass(frozen=True)
class NormSpec:
    """What the registry knows about a layer besides its class.

    Attributes:
        name: the registry's lower-case name.
        cls: the module class.
        pointwise: the output channel i depends on x_i alone (a diagonal Jacobian).
        exact_grad: the backward is the derivative of the forward. False for the dissection variants that change
            the backward on purpose (rms_detached, rms_partial_coupling with lam != 1, rms_ema).
        fits: the parameter a conversion calibrates ("alpha", or "log_beta": beta stored as its log), None when
            there is nothing to fit.
        centred: the formula acts on x - mean(x) (ELN), so a calibration fits on centred tokens.
        also_fits: parameters a calibration fits as they are, from their init (Derf's shift).
    """

    name: str
    cls: type[nn.Module]
    pointwise: bool
    exact_grad: bool = True
    fits: str | None = None
    centred: bool = False
    also_fits: tuple[str, ...] = ()

    @property
    def init_kwargs(self) -> tuple[str, ...]:
        """The keyword arguments its class takes (`init_kwargs`)."""
        return _class_kwargs(self.cls)

    def create(self, dim: int, *, strict: bool = True, **kwargs: object) -> nn.Module:
        """The layer over ``dim`` channels: `create_norm` for a spec in hand.

        Args:
            dim: The channel count C.
            strict: Refuse a keyword the class does not take (False drops it).
            **kwargs: The layer's own keywords.
        """
        valid = self.init_kwargs
        unknown = sorted(set(kwargs) - set(valid))
        if unknown and strict:
            raise TypeError(f"norm {self.name!r} does not take {', '.join(unknown)}; it takes: {', '.join(valid)}")
        return self.cls(dim, **{k: v for k, v in kwargs.items() if k in valid})


_REGISTRY: dict[str, NormSpec] = {}


def register(
    name: str,
    *,
    pointwise: bool,
    exact_grad: bool = True,
    fits: str | None = None,
    centred: bool = False,
    also_fits: tuple[str, ...] = (),
):
    """Class decorator (or a call): add a layer to the registry under a lower-case ``name``.

    Args:
        name: The lower-case registry name, unique.
        pointwise: Output channel i depends on x_i alone.
        exact_grad: The backward is the forward's derivative.
        fits: The parameter a conversion calibrates, or None.
        centred: The formula acts on x - mean(x).
        also_fits: Parameters a calibration fits from their init.
    """

    def deco(cls: type[nn.Module]) -> type[nn.Module]:
        if name != name.lower() or name in _REGISTRY:
            raise ValueError(f"register: name {name!r} must be lower-case and unique")
        _REGISTRY[name] = NormSpec(name, cls, pointwise, exact_grad, fits, centred, tuple(also_fits))
        cls.registry_name = name
        return cls

    return deco


# The built-in table: every norm with its facts, in one place.
for _name, _cls, _facts in [
    ("layer_norm", M.LayerNorm, {"pointwise": False}),
    ("rms_norm", M.RMSNorm, {"pointwise": False}),
    ("l1_norm", M.L1Norm, {"pointwise": False}),
    ("lmax_norm", M.LMaxNorm, {"pointwise": False}),
    ("group_rms", M.GroupRMS, {"pointwise": False}),
    ("rms_detached", M.RMSDetached, {"pointwise": False, "exact_grad": False}),
    ("rms_partial_coupling", M.RMSPartialCoupling, {"pointwise": False, "exact_grad": False}),
    ("rms_ema", M.RMSEMA, {"pointwise": False, "exact_grad": False}),
    ("dyt", E.DyT, {"pointwise": True, "fits": "alpha"}),
    ("derf", E.Derf, {"pointwise": True, "fits": "alpha", "also_fits": ("shift",)}),
    ("dyt_hardtanh", E.DyTHardtanh, {"pointwise": True}),
    ("dyt_sigmoid", E.DyTSigmoid, {"pointwise": True}),
    ("dyt_rms_denominator", E.DyTRMSDenominator, {"pointwise": False}),
    ("scaled_dyt", E.ScaledDyT, {"pointwise": True, "fits": "alpha"}),
    ("tanh_fixed", E.TanhFixed, {"pointwise": True}),
    ("layer_scale", E.LayerScale, {"pointwise": True}),
    ("fixed_scale", E.FixedScale, {"pointwise": True, "fits": "alpha"}),
    ("sign_sqrt", E.SignSqrt, {"pointwise": True}),
    ("dyisru", E.DyISRU, {"pointwise": True, "fits": "log_beta"}),
    ("eln", E.ELN, {"pointwise": False, "fits": "log_beta", "centred": True}),
]:
    register(_name, **_facts)(_cls)


def list_norms() -> list[str]:
    """The registered names, sorted."""
    return sorted(_REGISTRY)


def calibratable_norms() -> list[str]:
    """The registered names whose spec has a parameter a conversion calibrates (``fits``), sorted."""
    return sorted(n for n, s in _REGISTRY.items() if s.fits)


def norm_spec(name: str) -> NormSpec:
    """The `NormSpec` of ``name``; an unknown name raises a ValueError listing the valid ones.

    Args:
        name: A registry name, as `list_norms` gives them ("dyt", "dyisru", ...).
    """
    if not isinstance(name, str) or name not in _REGISTRY:
        close = difflib.get_close_matches(str(name), _REGISTRY, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown norm {name!r}.{hint} Valid names: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def init_kwargs(name: str) -> list[str]:
    """The keyword arguments that ``create_norm(name, dim, ...)`` accepts.

    Args:
        name: A registry name, as `list_norms` gives them.
    """
    return list(norm_spec(name).init_kwargs)


@functools.cache
def _class_kwargs(cls: type[nn.Module]) -> tuple[str, ...]:
    """Keyword-only arguments of ``cls`` and of the base classes its ``**kwargs`` reach (read once per class)."""
    names = []
    for base in cls.__mro__:  # a base class's keywords count only if **kwargs reaches it
        if "__init__" not in base.__dict__ or base is nn.Module:
            continue
        params = inspect.signature(base.__init__).parameters.values()
        names += [p.name for p in params if p.kind == p.KEYWORD_ONLY]
        if not any(p.kind == p.VAR_KEYWORD for p in params):
            break
    return tuple(sorted(set(names) - {"weight"}))


def accepted_kwargs(name: str, kwargs: dict) -> dict:
    """The items of ``kwargs`` that ``create_norm(name, ...)`` accepts (one init shared by several norms).

    Args:
        name: A registry name, as `list_norms` gives them.
        kwargs: Keyword arguments meant for several norms.
    """
    valid = init_kwargs(name)
    return {k: v for k, v in kwargs.items() if k in valid}


def create_norm(name: str, dim: int, *, strict: bool = True, **kwargs: object) -> nn.Module:
    """Build the layer registered as ``name`` over ``dim`` channels.

    Args:
        name: a registered norm (`list_norms`); an unknown one raises an error that lists the valid names.
        dim: the channel count C.
        strict: refuse a keyword this norm does not take (the error lists the ones it takes); False drops it
            (e.g. ``alpha_init`` for RMSNorm), so that one set of keywords can build several norms.
        **kwargs: the layer's own keywords (``eps``, ``alpha_init``, ``beta_init``, ``bias``, ``kernel``, ...).

    Returns:
        The layer, an ``nn.Module`` mapping (..., C) to (..., C).
    """
    return norm_spec(name).create(dim, strict=strict, **kwargs)


def norm_layer(name: str, channels_first: bool = False, **kwargs: object):
    """A ``norm_layer=`` for model builders that call ``norm_layer(channels, eps=..., ...)`` (timm's
    ``create_model(..., norm_layer=normlab.norm_layer("dyt"))``, torchvision's): each call builds the registered norm
    ``name`` over ``channels`` with ``kwargs``; ``channels_first`` for (N, C, H, W) maps (timm's ``LayerNorm2d``
    sites). The builder's ``eps`` goes to a norm that has one; ``affine`` / ``elementwise_affine`` are refused when
    False (an element-wise norm always has its gamma).

    Args:
        name: A registered norm (`list_norms`).
        channels_first: Normalize axis 1 instead of the last.
        **kwargs: The layer's keywords (``alpha_init``...).
    """
    spec = norm_spec(name)
    if channels_first:
        kwargs = {**kwargs, "channel_dim": 1}

    def make(channels: int, eps: float | None = None, **builder: object) -> nn.Module:
        if builder.pop("affine", True) is False or builder.pop("elementwise_affine", True) is False:
            why = "the builder asked for a norm without parameters; an element-wise norm always has its gamma"
            raise ValueError(f"normlab.norm_layer({name!r}): {why}")
        extra = {"eps": eps} if eps is not None and "eps" in spec.init_kwargs else {}
        return create_norm(name, int(channels), **{**accepted_kwargs(name, builder), **extra, **kwargs})

    make.__name__ = f"{name}_norm_layer"
    return make
