"""normlab's element-wise norms as a torchtitan component: DyT, DyISRU and Derf in place of a model's RMSNorm or
LayerNorm, through torchtitan's own extension points, so that its trainer, parallelisms (FSDP2, tensor and sequence
parallel, activation checkpointing, torch.compile) and distributed checkpoints carry them as they carry its own norm.

Two ways in, the same layers:

- **An override**, activated from the command line with no code of yours (torchtitan's ``@override``)::

      torchrun ... -m torchtitan.train --module llama3 --config llama3_debugmodel \\
          --override.imports normlab.integrations.torchtitan.dyt

  ``dyt``, ``dyisru`` and ``derf`` each replace every ``RMSNorm.Config`` of the config tree (torchtitan's LLMs' norm),
  with the layer's own init (DyT's alpha0 = 0.5) or the keywords given as ``'...dyt={"alpha_init": 0.8}'``. An override
  sees one config at a time, never where it sits, so a recipe that depends on the site (the DyT paper's alpha0 by
  role) goes through the converter.
- **A model converter** (``ModelConfigConverter``, as torchtitan's Float8 converter), in a config registry of yours::

      model_registry("8B", converters=[NormConverter.Config(to="dyt", init="dyt_paper")])

  It walks the model's config tree, names each norm site by its FQN, and applies `normlab.recipes` per site, as
  `normlab.replace_norms` does for a model already built (the same recipe table, the same roles: torchtitan's
  ``attention_norm``, ``ffn_norm`` and ``norm``).

Each layer is a torchtitan ``Module`` (``normlab.DyT`` and torchtitan's ``Module`` in one class, as torchtitan's own
``RMSNorm`` is ``nn.RMSNorm`` and ``Module``), built on the meta device and initialised by ``reset_parameters`` through
torchtitan's ``init_states``. Its sharding is the replaced norm's: every parameter (``alpha``, ``shift``, ``log_beta``,
``bias``) is placed as the norm's ``weight`` (replicated under tensor parallelism; sharded by FSDP), and the
activations keep the norm's placements (sequence-sharded under sequence parallelism, where the norm is point-wise and
computes on its shard). Its state dict holds the normlab layer's names (``alpha``, ``weight``, ``bias``), so a
checkpoint loads where the same norm is configured.

This module imports torchtitan (``pip install torchtitan``, which needs torch 2.14 or newer); normlab itself does not.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from torch import nn
from torchtitan.config import override
from torchtitan.models.common.nn_modules import LayerNorm, RMSNorm
from torchtitan.protocols.model import ModelConfigConverter
from torchtitan.protocols.module import Module

from normlab.elementwise import Derf, DyISRU, DyT
from normlab.recipes import MEASURED, RECIPES, recipe_kwargs, site_role
from normlab.registry import norm_spec

__all__ = ["TitanDyT", "TitanDyISRU", "TitanDerf", "TITAN_NORMS", "NormConverter", "titan_config", "dyt", "dyisru",
           "derf"]  # fmt: skip

#: The configs of the norms a swap replaces: torchtitan's RMSNorm and LayerNorm (and their subclasses).
SOURCES = (RMSNorm.Config, LayerNorm.Config)


def _with_sharding_of_weight(module: nn.Module, sharding):
    """``sharding`` (the replaced norm's, which declares ``weight`` only) with every other parameter of ``module``
    placed as the weight is."""
    if sharding is None or "weight" not in (sharding.state_shardings or {}):
        return sharding
    states = dict(sharding.state_shardings)
    for name, _ in module.named_parameters(recurse=False):
        states.setdefault(name, states["weight"])
    return dataclasses.replace(sharding, state_shardings=states)


def _titan_class(base: type[nn.Module], name: str) -> type:
    """A torchtitan ``Module`` that is the normlab layer ``base``, built from a Config."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        normalized_shape: int
        """The channel count C."""
        eps: float = 1e-5
        """The replaced norm's eps, kept for a reader of the config; a point-wise norm has none."""
        elementwise_affine: bool = True
        """The replaced norm's; the element-wise layer always has its gamma (and beta where ``bias``)."""
        init: dict = field(default_factory=dict)
        """The layer's keywords (``alpha_init``, ``bias``, ``per_channel_alpha``, ``beta_init``, ``shift_init``...)."""

        def build(self, **kwargs):
            instance = Module.Config.build(self, **kwargs)
            instance._sharding_config = _with_sharding_of_weight(instance, instance._sharding_config)
            return instance

    def __init__(self, config: Config) -> None:
        base.__init__(self, config.normalized_shape, **config.init)

    cls = type(name, (base, Module), {"Config": Config, "__init__": __init__, "__module__": __name__})
    cls.__doc__ = f"normlab's {base.__name__} as a torchtitan Module (built from ``{name}.Config``)."
    Config.__qualname__ = f"{name}.Config"
    return cls


TitanDyT = _titan_class(DyT, "TitanDyT")
TitanDyISRU = _titan_class(DyISRU, "TitanDyISRU")
TitanDerf = _titan_class(Derf, "TitanDerf")
#: normlab's registry name -> its torchtitan Module.
TITAN_NORMS: dict[str, type] = {"dyt": TitanDyT, "dyisru": TitanDyISRU, "derf": TitanDerf}


def titan_config(source, to: str, init: dict | None = None):
    """The config of a ``to`` layer in the place of the norm config ``source``: its channels, eps, param placements
    and activations' placements, and ``param_init`` cleared (the layer's ``reset_parameters`` initialises it).

    Args:
        source: A torchtitan ``RMSNorm.Config`` or ``LayerNorm.Config``.
        to: "dyt", "dyisru" or "derf".
        init: The layer's keywords.
    """
    if to not in TITAN_NORMS:
        raise ValueError(f"normlab torchtitan: to={to!r}; the torchtitan layers are {', '.join(TITAN_NORMS)}")
    kwargs = dict(init or {})
    spec = norm_spec(to)
    unknown = sorted(set(kwargs) - set(spec.init_kwargs) - {"kernel"})
    if unknown:
        takes = ", ".join(spec.init_kwargs)
        raise TypeError(f"normlab torchtitan: {to!r} does not take {', '.join(unknown)}; it takes {takes}")
    return TITAN_NORMS[to].Config(
        normalized_shape=int(source.normalized_shape),
        eps=float(source.eps),
        elementwise_affine=bool(source.elementwise_affine),
        init=kwargs,
        param_init=None,
        sharding_config=source.sharding_config,
    )


def _norm_sites(config, prefix: str = ""):
    """(fqn, parent, attribute or index, config) for every norm config in a torchtitan model config tree."""
    children = []
    if dataclasses.is_dataclass(config):
        children = [(f.name, getattr(config, f.name, None)) for f in dataclasses.fields(config)]
    elif isinstance(config, list):
        children = list(enumerate(config))
    for key, child in children:
        fqn = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(child, SOURCES):
            yield fqn, config, key, child
        elif dataclasses.is_dataclass(child) or isinstance(child, list):
            yield from _norm_sites(child, fqn)


class NormConverter(ModelConfigConverter):
    """Replaces every RMSNorm and LayerNorm of a torchtitan model config with a normlab layer, with a published
    recipe per site (`normlab.recipes`). ``model_registry(flavor, converters=[NormConverter.Config(to="dyt",
    init="dyt_paper")])``."""

    @dataclass(kw_only=True, slots=True)
    class Config(ModelConfigConverter.Config):
        to: str = "dyt"
        """The layer: "dyt", "dyisru" or "derf"."""
        init: str = "default"
        """The recipe: "default", "dyt_paper" (alpha0 by width and role, DyT without bias) or "derf_paper" (Derf's
        GPT-2 alpha0 1.0 and shift0 0). torchtitan's LLMs are language models, so the papers' language-model values
        apply; their embedding scale does not: torchtitan initialises the token embedding at std 1, the RMS that the
        papers' std-0.02 embedding reaches only after its sqrt(d) scale (1.28 at width 4096)."""
        layer: dict = field(default_factory=dict)
        """More keywords of every layer (``per_channel_alpha``, ``bias``...); one the recipe sets is refused."""

    def __init__(self, config: Config) -> None:
        if config.init not in RECIPES or config.init in MEASURED:
            raise ValueError(
                f"NormConverter: init={config.init!r}; a torchtitan model is built on the meta device, so the recipes "
                f"are {', '.join(r for r in RECIPES if r not in MEASURED)} ({' and '.join(MEASURED)} measure a forward)"
            )
        if config.to not in TITAN_NORMS:
            raise ValueError(f"NormConverter: to={config.to!r}; the torchtitan layers are {', '.join(TITAN_NORMS)}")
        self.config = config
        self.sites: list[str] = []

    def convert(self, model_config):
        spec = norm_spec(self.config.to)
        sites = list(_norm_sites(model_config))
        if not sites:
            raise ValueError(f"NormConverter: {type(model_config).__qualname__} has no RMSNorm or LayerNorm config")
        for fqn, parent, key, source in sites:
            role = site_role(fqn, {"*attention_norm": "attn", "*ffn_norm": "mlp", "norm": "final"})
            try:
                kw, _ = recipe_kwargs(self.config.init, spec, role, int(source.normalized_shape), lm=True)
            except ValueError as e:
                raise ValueError(f"NormConverter: site {fqn}: {e}") from None
            clash = sorted(set(kw) & set(self.config.layer))
            if clash:
                raise ValueError(f"NormConverter: {clash[0]} is set by init {self.config.init!r} and by layer=")
            new = titan_config(source, self.config.to, {**kw, **self.config.layer})
            if isinstance(parent, list):
                parent[key] = new
            else:
                setattr(parent, key, new)
            self.sites.append(fqn)
        return model_config


@override(target=RMSNorm.Config, description="normlab DyT in place of RMSNorm")
def dyt(cfg, **init):
    """Every RMSNorm config becomes normlab's DyT; ``init``: DyT's keywords (``alpha_init``, ``bias``...)."""
    return titan_config(cfg, "dyt", init)


@override(target=RMSNorm.Config, description="normlab DyISRU in place of RMSNorm")
def dyisru(cfg, **init):
    """Every RMSNorm config becomes normlab's DyISRU; ``init``: its keywords (``beta_init``, ``bias``...)."""
    return titan_config(cfg, "dyisru", init)


@override(target=RMSNorm.Config, description="normlab Derf in place of RMSNorm")
def derf(cfg, **init):
    """Every RMSNorm config becomes normlab's Derf; ``init``: its keywords (``alpha_init``, ``shift_init``...)."""
    return titan_config(cfg, "derf", init)
