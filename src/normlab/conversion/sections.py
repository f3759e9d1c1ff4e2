"""The sections of a conversion's config (`normlab.conversion.config.ConvertConfig`): calibration, the budget walk and
the heal, each a dataclass whose ``validate`` checks what it can alone, before any work (the data section is
`normlab.conversion.data.config.DataConfig`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from normlab.conversion.flags import finite, flag, int_at_least
from normlab.typed import check_types, set_name

if TYPE_CHECKING:
    from normlab.registry import NormSpec

__all__ = ["CalibrateConfig", "BudgetConfig", "HealConfig", "LORA_RANK", "HEAL_LEARNING_RATES"]

LORA_RANK = 8  # the adapters' default rank (heal.train=lora)
HEAL_LEARNING_RATES = {"norms": 2.5e-4, "lora": 1e-3, "all": 2e-5}  # Adam's; HealConfig.rate


@dataclass
class CalibrateConfig:
    """Fitting each replacement to the model's own activations (`normlab.conversion.calibrate.sites`)."""

    enabled: bool = True
    """False: the new norms keep their default init (--no-calibrate)."""
    massive_tokens: Literal["auto", "route", "shared"] = "auto"
    """"route": massive tokens (an RMS above ``massive`` x the median, anywhere) get their own copy at each site where
    a few channels tell them apart; "auto" also keeps the original norm at the sites before the massive activation
    forms, where no channel tells apart the tokens that will carry it (`normlab.conversion.calibrate.massive`);
    "shared": one replacement for every token."""
    target: Literal["original", "local"] = "original"
    """What each site is fitted to reproduce: the original's output there (which also corrects the drift of earlier
    sites), or "local": the original norm on the site's input in the model converted so far."""
    max_tokens: int = 4096
    """Calibration tokens kept per site (besides every first token and the massive copies' rows), >= 16."""
    massive: float = 10.0
    """Tokens with an RMS above this multiple of the median (> 1) stay out of the shared fit."""
    fit_amplitude: bool = True
    """Also fit an amplitude, folded into the weight; false keeps the module's own (sqrt(C) for DyISRU and scaled
    DyT, 1 for DyT)."""
    sequential: bool = True
    """Fit each site on the model converted so far; false: on the original's activations (exact for a site converted
    alone: the budget walk's ranking)."""
    solver: Literal["auto", "profile", "lbfgs"] = "auto"
    """How each fit is solved: "profile" (float32, the amplitude in closed form), "lbfgs" (float64), or "auto"
    (profile unless the target has linear extras: Derf). `normlab.conversion.calibrate.fit.fit_replacement`."""

    def validate(self, to: NormSpec | None = None, name=None) -> None:
        """Every field checked; ``to`` (the target's registry entry), when given, must be one a fit can calibrate.
        ``name`` maps a field's key to how the user typed it (default: its flag or ``--set calibrate.KEY``)."""
        name = name or set_name
        check_types(self, "calibrate.", name)
        if self.max_tokens < 16:
            raise ValueError(f"{name('calibrate.max_tokens')}: expected an int >= 16, got {self.max_tokens!r}")
        if not (self.massive > 1 and math.isfinite(self.massive)):
            raise ValueError(
                f"{name('calibrate.massive')}: expected a finite number > 1 (a multiple of the median token RMS), "
                f"got {self.massive!r}"
            )
        if to is None:
            return
        if self.solver == "profile" and to.also_fits:
            raise ValueError(
                f"{name('calibrate.solver')} profile cannot fit {to.name}'s {', '.join(to.also_fits)} (the profile "
                "search fits one parameter and an amplitude): use auto or lbfgs"
            )


@dataclass
class BudgetConfig:
    """Converting only the sites that fit within a rise of held-out cross-entropy (`normlab.conversion.frontier`)."""

    nats: float | None = None
    """Convert only the sites that fit within this rise of ``metric``, cheapest first (--budget-nats); None: all."""
    metric: Literal["ce", "kl"] = "ce"
    """What the walk ranks and measures by: the rise of next-token cross-entropy on the text, or "kl", the mean KL
    divergence to the original per position (`normlab.conversion.measure.fidelity.ReferenceKL`)."""
    walk: Literal["skip", "stop"] = "skip"
    """At a site over the budget: "skip" it and go on, or "stop" the walk there."""
    refit_every: int = 4
    """Refit every converted site after each K kept, where it lowers the cross-entropy (0: never)."""
    rank_batches: int = 4
    """Calibration batches (8 sequences each) each site's cost alone is ranked on."""
    rank_every: int | None = None
    """With ``metric="kl"``, the ranking reads every n-th position of those (`ReferenceKL` ``every``); None: from the
    model's shape (`normlab.conversion.measure.fidelity.kl_every`: 1 unless the output layer outweighs the blocks)."""
    step_every: int | None = None
    """With ``metric="kl"``, each step of the walk reads every n-th position; None: as ``rank_every``'s None."""
    refit_batches: int = 1
    """Calibration batches each site is fitted again on, in the model converted so far, at its turn (0: never)."""
    defer: float = 3.0
    """A site whose rise in the walk is over this many times its cost alone (at least 0.01 nats) is tried again after
    every other site, so as not to spend the budget cheaper sites could use (0: never; docs/calibration.md)."""
    precision: Literal["auto", "float32", "bf16"] = "auto"
    """The arithmetic of the walk's measurements (fits, refits and the command's stay float32): "bf16" autocasts them,
    "auto" where bf16 matmuls run natively and faster (a GPU; a CPU: `batches.cpu_bf16_speed`), else float32."""

    def validate(self, calibrated: bool = True) -> None:
        self.check()
        if self.nats is None:
            for key, default in ((k, f.default) for k, f in BudgetConfig.__dataclass_fields__.items() if k != "nats"):
                if getattr(self, key) != default:
                    raise ValueError(f"{flag('budget.' + key)} applies only with {flag('budget.nats')}")
        elif not calibrated:
            raise ValueError(f"{flag('budget.nats')} ranks calibrated sites; drop {flag('calibrate.enabled')}")

    def check(self) -> None:
        """Each field alone: the frontier's own check (without a budget it walks the whole curve)."""
        check_types(self, "budget.")
        if self.nats is not None and not (self.nats >= 0 and math.isfinite(self.nats)):
            what = "KL divergence to the original" if self.metric == "kl" else "held-out cross-entropy rise"
            raise ValueError(f"{flag('budget.nats')} must be a finite number >= 0 (nats of {what}), got {self.nats!r}")
        int_at_least("budget.refit_every", self.refit_every, 0, " (sites between refits; 0: never)")
        int_at_least("budget.rank_batches", self.rank_batches, 1, " (calibration batches)")
        for key in ("rank_every", "step_every"):
            if getattr(self, key) is not None:
                int_at_least(f"budget.{key}", getattr(self, key), 1, " (every n-th position), or none")
        int_at_least("budget.refit_batches", self.refit_batches, 0, " (calibration batches; 0: no refit)")
        if not (finite(self.defer) and (self.defer == 0 or self.defer >= 1)):
            raise ValueError(
                f"{flag('budget.defer')} must be 0 (never) or a number >= 1 (times the cost alone), got {self.defer!r}"
            )


@dataclass
class HealConfig:
    """Training the converted model toward the original within a budget (`normlab.conversion.heal.distill`)."""

    minutes: float | None = None
    """The budget in wall-clock minutes (or give ``tokens``)."""
    tokens: int | None = None
    """The budget in tokens through a trained forward and backward."""
    train: Literal["norms", "lora", "all"] = "norms"
    """What is trained: the replacements' parameters ("norms"), those plus low-rank adapters merged at the end
    ("lora"), or every parameter ("all")."""
    lr: float | None = None
    """Adam's rate; None: the default for ``train`` (HEAL_LEARNING_RATES; the norms' 2.5e-4)."""
    schedule: Literal["constant", "cosine", "cooldown"] = "constant"
    """The rate over the budget: "cosine": 5% warm-up, down to lr/10; "cooldown": lr, then down to 0 in the last 20%."""
    batch_size: int = 4
    """Sequences per step: 4 beat 8 per token and per minute (docs/heal-measurements.md, "The batch")."""
    rollback_nats: float | None = 0.5
    """Distill: a validation point this far above the best goes back to it at half the rate; None never does."""
    grad_clip: float = 1.0
    """Distill: the gradient's largest norm, as the lab's (blocks does not clip); 0 does not clip."""
    eval_every: int | None = None
    """Trained tokens between validation points; None: every 8 steps."""
    lora_rank: int = LORA_RANK
    """The adapters' rank (train "lora")."""
    lora_lr: float | None = None
    """The adapters' Adam rate (train "lora"); None: HEAL_LEARNING_RATES["lora"], 1e-3. ``lr`` sets the norms'."""
    early_blocks: Literal["frozen", "trained"] = "frozen"
    """The blocks before the first converted site: "frozen" keeps them the original's (the massive activation forms
    there; trained, Qwen2.5-Coder-0.5B's stopped forming after a leading "["), or "trained" (LoRA or "all")."""
    checkpoint: str | None = None
    """The heal's checkpoint file; None: OUT.heal.pt when there is an output folder."""
    resume: bool = False
    """Continue a heal from its checkpoint."""
    teacher_top_k: int | None = None
    """Distill: cache the original's top k logits per sequence (teacher.py); None: the teacher runs live."""
    precision: Literal["auto", "float32", "bf16"] = "float32"
    """Distill: "bf16" runs each step's matmuls in bf16 (CPU or CUDA autocast), checked before the heal; "auto" where
    the device runs them natively (as budget.precision), else float32; validation and the saved model stay float32."""

    @property
    def budgeted(self) -> bool:
        return self.minutes is not None or self.tokens is not None

    def rate(self) -> float:  # the norms' rate applies under "lora" too
        key = "all" if self.train == "all" else "norms"
        return self.lr if self.lr is not None else HEAL_LEARNING_RATES[key]

    def lora_rate(self) -> float:
        return self.lora_lr if self.lora_lr is not None else HEAL_LEARNING_RATES["lora"]

    def validate(self) -> None:
        check_types(self, "heal.")
        if self.minutes is not None and self.tokens is not None:
            raise ValueError(f"give one heal budget: {flag('heal.minutes')} or {flag('heal.tokens')}")
        for name in ("minutes", "tokens", "lr", "lora_lr"):  # lr, lora_lr: None is the default
            v = getattr(self, name)
            if v is not None and (
                isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or not math.isfinite(v)
            ):
                raise ValueError(f"{flag('heal.' + name)} must be a finite number > 0, got {v!r}")
        if self.tokens is not None and not float(self.tokens).is_integer():
            raise ValueError(f"{flag('heal.tokens')} must be a whole number of tokens, got {self.tokens!r}")
        for name, least in (("batch_size", 1), ("lora_rank", 1), ("eval_every", 1), ("teacher_top_k", 1)):
            v = getattr(self, name)
            if v is None and name in ("eval_every", "teacher_top_k"):
                continue  # None: every 8 steps; the live teacher
            int_at_least(f"heal.{name}", v, least)
        if self.rollback_nats is not None and not (finite(self.rollback_nats) and self.rollback_nats > 0):
            raise ValueError(
                f"{flag('heal.rollback_nats')} must be a finite number > 0 (nats above the best validation point), "
                f"or null to never roll back; got {self.rollback_nats!r}"
            )
        if not (finite(self.grad_clip) and self.grad_clip >= 0):
            raise ValueError(f"{flag('heal.grad_clip')} must be a finite number >= 0 (0: none), got {self.grad_clip!r}")
        if self.checkpoint is not None and not str(self.checkpoint).strip():
            raise ValueError(f"{flag('heal.checkpoint')} must name a file, got {self.checkpoint!r}")
        plain = HealConfig.__dataclass_fields__
        lora_only = {"lora_rank": "sizes heal.train=lora's adapters", "lora_lr": "is heal.train=lora's adapters' rate"}
        for name, why in lora_only.items():
            if self.train != "lora" and getattr(self, name) != plain[name].default:
                raise ValueError(f"{flag('heal.' + name)} {why}: it does nothing here; drop it")
        if not self.budgeted:
            default = HealConfig.__dataclass_fields__
            given = [
                flag(f"heal.{n}")
                for n in ("train", "lr", "resume", "checkpoint", "schedule")
                if getattr(self, n) != default[n].default
            ]
            if given:
                raise ValueError(
                    f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} only to a heal: give "
                    f"a budget ({flag('heal.minutes')} or {flag('heal.tokens')}), or drop it"
                )
