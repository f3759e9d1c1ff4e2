"""Run configuration: a dataclass, named presets, and ``key=value`` overrides.

A run is a preset plus a few changed fields (``--set lr=1e-3 model.width=256``),
never a new flag per field. The resolved config is written next to the results.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields
from typing import Literal

from normlab.kernels import auto_choice
from normlab.lab.data import check_text_files
from normlab.lab.model import GPTConfig
from normlab.pairs import apply_overrides, parse_pairs
from normlab.typed import check_types, choices

__all__ = ["TrainConfig", "PRESETS", "OPTIMIZERS", "RENAMED", "resolve_config", "apply_overrides"]

#: Fields that were renamed: an old config (a TOML, a --set, a saved run's config.json) is refused with the new
#: spelling, never read with a silently different meaning.
RENAMED = {
    "model.alpha_table": (
        "model.alpha_table was replaced in 0.9.0 by model.recipe, a recipe name of normlab.replace_norms: "
        "model.recipe = 'dyt_paper' (or 'dyt_paper@W') gives the same alpha0 per site and, as the DyT paper's LLaMA "
        "code does, DyT without bias and the sqrt(d) embedding scalar (model.embed_scale = 'none' removes it)"
    ),
}


def check_renamed(keys: Iterable[str]) -> None:
    """Refuse a renamed field among dotted ``keys``, naming its new spelling (`RENAMED`).

    Args:
        keys: Dotted field names (``model.width``).
    """
    for key in keys:
        if key in RENAMED:
            raise ValueError(RENAMED[key])


@dataclass
class TrainConfig:
    """One training run: the model, the data, the optimizer and its schedule, and what is logged (``--set
    KEY=VALUE``)."""

    model: GPTConfig = field(default_factory=GPTConfig)
    data: list[str] = field(default_factory=list)
    """Text files; empty: the default Shakespeare corpus."""
    val_fraction: float = 0.1
    """The share of the bytes held out for validation."""
    steps: int = 600
    batch_size: int = 32
    lr: float = 3e-4
    """AdamW's peak rate (with optimizer = "muon": the embedding's, the head's, the scalars' and the vectors')."""
    min_lr: float = 3e-5
    """The rate the cosine schedule ends at."""
    optimizer: Literal["adamw", "muon"] = "adamw"
    """"adamw", or "muon": torch.optim.Muon for the blocks' matrices, AdamW for the rest."""
    muon_lr: float = 0.02
    """Muon's peak rate (the schedule scales it as it scales lr)."""
    muon_momentum: float = 0.95
    warmup: int = 50
    """Steps of linear warmup."""
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 0
    eval_every: int = 100
    eval_batches: int = 20
    log_every: int = 10
    metrics_every: int = 100
    """Alignment, ranks, residual std, the Jacobian: one probed step every N."""
    jacobian_site: str = "blocks.0.norm_attn"
    checkpoint_every: int = 100
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """"auto": cuda if available, else cpu."""
    amp: Literal["auto", "bf16", "none"] = "auto"
    """"auto": bf16 autocast on cuda, none on cpu; or "bf16", "none"."""
    compile: bool = False
    tensorboard: bool = False
    out: str = "runs/default"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        d = dict(d)
        model = d.pop("model", {})
        if not isinstance(model, dict):
            raise ValueError(
                f"model must be a table of model settings (model.width=..., model.norm=...), got {model!r}"
            )
        if model.get("alpha_table", "") is None:  # a config saved before 0.9.0, where the field was unset
            model = {k: v for k, v in model.items() if k != "alpha_table"}
        check_renamed([f"model.{k}" for k in model])
        model = GPTConfig(**model)
        return cls(model=model, **d)

    def validate(self) -> None:
        """Every check that can be made without data, so that a bad config fails before any work."""
        check_types(self, name=str)
        self.model.validate()
        positive = ("steps", "batch_size", "eval_every", "eval_batches", "log_every", "metrics_every",
                    "checkpoint_every")  # fmt: skip
        for f in positive:
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{f} must be an int >= 1, got {v!r}")
        for f in ("lr", "min_lr", "weight_decay", "grad_clip", "muon_lr"):
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                raise ValueError(f"{f} must be a finite number >= 0, got {v!r}")
        if self.optimizer == "muon" and self.lr <= 0:
            raise ValueError(f"optimizer = 'muon' schedules muon_lr as a fraction of lr: lr must be > 0, got {self.lr}")
        if not 0.0 <= self.muon_momentum < 1.0:
            raise ValueError(f"muon_momentum must be in [0, 1), got {self.muon_momentum!r}")
        changed = [f for f in ("muon_lr", "muon_momentum") if getattr(self, f) != _DEFAULTS[f]]
        if self.optimizer != "muon" and changed:  # a knob the optimizer ignores: refused, not silently dropped
            raise ValueError(
                f"{changed[0]} = {getattr(self, changed[0])!r} sets Muon, but optimizer = {self.optimizer!r} does not "
                "use it (a sweep over it would train the same run under different names): set optimizer = 'muon', "
                f"or leave {changed[0]} out"
            )
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if not isinstance(self.data, list):
            raise ValueError(f"data must be a list of text files, got {self.data!r}")
        check_text_files(self.data)  # before the run folder is made
        auto_choice()  # NORMLAB_KERNEL, if set, must be valid
        if not isinstance(self.out, str) or not self.out.strip():
            raise ValueError(f"out must name a folder, got {self.out!r}")
        for f in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, f) < 1.0:
                raise ValueError(f"{f} must be in [0, 1) (AdamW's moment decay), got {getattr(self, f)!r}")
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {self.val_fraction!r}")
        sites = self.model.site_names()
        if self.jacobian_site not in sites:
            raise ValueError(
                f"jacobian_site {self.jacobian_site!r} is not a norm site of this model; sites: {', '.join(sites)}"
            )


OPTIMIZERS = choices(TrainConfig, "optimizer")  # ("adamw", "muon"): read from the field

PRESETS: dict[str, dict] = {
    # seconds: for tests
    "tiny": {
        "model": {"width": 32, "depth": 2, "heads": 2, "context": 32},
        "steps": 40, "batch_size": 8, "warmup": 5, "eval_every": 20, "eval_batches": 2, "log_every": 5,
        "metrics_every": 20, "checkpoint_every": 10,
    },
    # a few minutes on 2 CPU cores (the dissection's pathology is already visible here). lr 1e-3: at 3e-4, RMSNorm
    # reached only 2.448 in 600 steps (measured); DyT alpha=1 stays at the attractor either way.
    "cpu": {
        "model": {"width": 128, "depth": 4, "heads": 4, "context": 128},
        "steps": 600, "batch_size": 32, "lr": 1e-3, "min_lr": 1e-4, "warmup": 50, "eval_every": 100,
        "eval_batches": 20, "log_every": 10, "metrics_every": 100, "checkpoint_every": 100,
    },
    # `normlab reproduce`'s default profile: 4 x 64, 250 steps, ~15 s a run on one core (the phase experiment's scale)
    "small": {
        "model": {"width": 64, "depth": 4, "heads": 4, "context": 64},
        "steps": 250, "batch_size": 16, "lr": 1e-3, "min_lr": 1e-4, "warmup": 10, "eval_every": 50,
        "eval_batches": 8, "log_every": 10, "metrics_every": 50, "checkpoint_every": 50,
    },
    # the dissection's narrow shape, 24 x 1024, sized for about 10 minutes on one H100
    "gpu": {
        "model": {"width": 1024, "depth": 24, "heads": 16, "context": 512},
        "steps": 1500, "batch_size": 16, "warmup": 100, "eval_every": 250, "eval_batches": 20, "log_every": 25,
        "metrics_every": 250, "checkpoint_every": 500, "compile": True,
    },
    # the dissection's wide shape at about the same parameter count, 5 x 2048
    "gpu-wide": {
        "model": {"width": 2048, "depth": 5, "heads": 16, "context": 512},
        "steps": 1500, "batch_size": 16, "warmup": 100, "eval_every": 250, "eval_batches": 20, "log_every": 25,
        "metrics_every": 250, "checkpoint_every": 500, "compile": True,
    },
    # GPT-2 small (12 x 768, context 1024) for the scaling study's GPU check (scripts/gpu_study.sh): bf16 and
    # torch.compile; 1000 steps of 32 x 1024 tokens (33M tokens) take minutes on one H100. model.block picks the block.
    "gpt2-small": {
        "model": {"width": 768, "depth": 12, "heads": 12, "context": 1024},
        "steps": 1000, "batch_size": 32, "lr": 6e-4, "min_lr": 6e-5, "warmup": 100, "eval_every": 100,
        "eval_batches": 20, "log_every": 10, "metrics_every": 250, "checkpoint_every": 250, "compile": True,
        "amp": "bf16",
    },
}  # fmt: skip


def resolve_config(preset: str = "cpu", overrides: dict | list[str] | None = None, **fields: object) -> TrainConfig:
    """A preset, then ``fields`` (e.g. norm="dyt", out=...), then ``overrides``; validated.

    Args:
        preset: A preset of `PRESETS` ("cpu", "gpu", ...).
        overrides: Dotted ``key=value`` strings or a dict, applied last.
        **fields: Fields by name (``norm`` stands for ``model.norm``); None values are skipped.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; valid: {', '.join(PRESETS)}")
    base = TrainConfig().to_dict()
    base = _merge(base, PRESETS[preset])
    shorthand = {"norm": "model.norm"}
    flat = {shorthand.get(k, k): v for k, v in fields.items() if v is not None}
    check_renamed(flat)
    base = apply_overrides(base, flat)
    if overrides:
        pairs = overrides.items() if isinstance(overrides, dict) else parse_pairs(overrides, "--set", "lr=3e-4")
        check_renamed(k for k, _ in pairs)
        base = apply_overrides(base, overrides)
    try:
        cfg = TrainConfig.from_dict(base)
    except TypeError as e:  # a section set to something that is not a dict
        raise ValueError(f"bad config: {e}") from None
    cfg.validate()
    return cfg


def _merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


_DEFAULTS = {f.name: f.default for f in fields(TrainConfig)}  # what "not given" reads as, for the relevance checks
