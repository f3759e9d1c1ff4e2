"""One name-to-layer map. Models, experiments and the command line take a name.

>>> import normlab
>>> normlab.list_norms()[:3]
['dyisru', 'dyt', 'dyt_hardtanh']
>>> norm = normlab.create_norm("dyt", 64, alpha_init=1.0)
"""

from __future__ import annotations

import difflib
import inspect
from dataclasses import dataclass

from torch import nn

__all__ = ["NormSpec", "register", "create_norm", "list_norms", "norm_spec"]


@dataclass(frozen=True)
class NormSpec:
    """What the registry knows about a layer besides its class.

    pointwise:  the output channel i depends on x_i alone (a diagonal Jacobian).
    exact_grad: the backward is the derivative of the forward. False for the
                dissection variants that change the backward on purpose
                (rms_detached, rms_partial_coupling with lam != 1, rms_ema).
    """

    name: str
    cls: type[nn.Module]
    pointwise: bool
    exact_grad: bool = True


_REGISTRY: dict[str, NormSpec] = {}


def register(name: str, *, pointwise: bool, exact_grad: bool = True):
    """Class decorator: add a layer to the registry under a lower-case ``name``."""

    def deco(cls: type[nn.Module]) -> type[nn.Module]:
        if name != name.lower() or name in _REGISTRY:
            raise ValueError(f"register: name {name!r} must be lower-case and unique")
        _REGISTRY[name] = NormSpec(name, cls, pointwise, exact_grad)
        cls.registry_name = name
        return cls

    return deco


def _ensure_loaded() -> None:
    from normlab import modules  # noqa: F401  (registers the built-in layers)


def list_norms() -> list[str]:
    """The registered names, sorted."""
    _ensure_loaded()
    return sorted(_REGISTRY)


def norm_spec(name: str) -> NormSpec:
    """The :class:`NormSpec` of ``name``; an unknown name raises a ValueError listing the valid ones."""
    _ensure_loaded()
    if not isinstance(name, str) or name not in _REGISTRY:
        close = difflib.get_close_matches(str(name), _REGISTRY, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown norm {name!r}.{hint} Valid names: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def init_kwargs(name: str) -> list[str]:
    """The keyword arguments that ``create_norm(name, dim, ...)`` accepts."""
    sig = inspect.signature(norm_spec(name).cls.__init__)
    names = [p for p, v in sig.parameters.items() if v.kind == v.KEYWORD_ONLY]
    for base in norm_spec(name).cls.__mro__[1:]:  # **kwargs forwarded to a base class
        if "__init__" in base.__dict__ and base is not nn.Module:
            names += [p for p, v in inspect.signature(base.__init__).parameters.items() if v.kind == v.KEYWORD_ONLY]
    return sorted(set(names) - {"weight"})


def create_norm(name: str, dim: int, **kwargs) -> nn.Module:
    """Build the layer registered as ``name`` over ``dim`` channels.

    ``kwargs`` go to the layer (``eps``, ``alpha_init``, ``beta_init``, ...). An
    unknown name or keyword raises an error that lists the valid ones.
    """
    spec = norm_spec(name)
    valid = init_kwargs(name)
    unknown = sorted(set(kwargs) - set(valid))
    if unknown:
        raise TypeError(f"norm {name!r} does not take {', '.join(unknown)}; it takes: {', '.join(valid)}")
    return spec.cls(dim, **kwargs)
