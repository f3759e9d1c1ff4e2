"""Conversion's one config object: what to convert to, how to calibrate, how to heal.

    from normlab.conversion.config import resolve_convert_config
    cfg = resolve_convert_config(["heal.minutes=10", "heal.lr=3e-3"], model="smollm2", to="dyisru")
    normlab.conversion.workflow.convert_model(cfg)

A dataclass of sections, ``to_dict``/``from_dict``, one ``validate`` that fails before any work (with
`normlab.conversion.limits`), dotted ``--set`` overrides (`normlab.pairs.apply_overrides`); flags are shorthands.

The heal checkpoint's identity is `ConvertConfig.identity`: every field that shapes the converted model or the heal,
flattened, plus the facts only the run knows (the model's fingerprint, the text's hash). A resume whose identity
differs is refused, naming the fields (`ConvertConfig.difference`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Literal

from normlab.conversion.data.config import HEAL_SAMPLES, DataConfig
from normlab.conversion.flags import SHORTHANDS, finite, flag, identity_difference, int_at_least
from normlab.conversion.limits import check_limits
from normlab.pairs import apply_overrides, parse_pairs
from normlab.typed import check_types, choices, field_docs, set_name

if TYPE_CHECKING:
    from normlab.registry import NormSpec

__all__ = ["DataConfig", "CalibrateConfig", "HealConfig", "BudgetConfig", "ConvertConfig", "resolve_convert_config",
           "flag", "identity_difference", "SHORTHANDS", "HEAL_LEARNING_RATES", "choices", "field_docs",
           "check_types", "RETIRED", "drop_retired"]  # fmt: skip

FREE_TABLES = ("init", "site_init")  # tables whose keys are the user's (init.alpha_init=0.5)
LORA_RANK = 8  # the adapters' default rank (heal.train=lora)
HEAL_LEARNING_RATES = {"norms": 2.5e-4, "lora": 1e-3, "all": 2e-5}  # Adam's; HealConfig.rate
SECTIONS = ("data", "calibrate", "heal", "budget")
# what a resumed heal may change (a heal may go on on another device, with another budget): not in its identity
NOT_IDENTITY = tuple(
    "model data.text data.judge out overwrite device heal.minutes heal.tokens heal.checkpoint heal.resume".split()
)
LEGACY_KEYS = {"budget_nats": "budget.nats", "budget_walk": "budget.walk", "budget_refit_every": "budget.refit_every",
               "budget_rank_batches": "budget.rank_batches",  # convert_config.json before 0.2
               "text": "data.text", "eval_text": "data.judge", "calibrate.source": "data.calibrate",
               "budget.text": "data.walk", "heal.text": "data.heal", "heal.self_sequences": "data.samples",
               "heal.self_fraction": "data.self_fraction", "heal.starts": "data.starts",
               "heal.temperature": "data.temperature", "heal.seed": "data.seed",
               "heal.sample_precision": "data.precision"}  # fmt: skip  # before 0.6: what each stage reads, in [data]
# options the project's own measurements rejected, retired in 0.10.0: each with the value that is now the only
# behaviour (a saved config holding it is read), and what a config giving another value is told
RETIRED = {
    "heal.objective": (
        "distill",
        "the heal's objective (block-wise reconstruction, 'blocks') was retired in 0.10.0: at equal minutes it ended "
        "1.3-1.4 nats behind distilling the logits end to end, now the only heal (docs/heal-measurements.md); drop it",
    ),
    "heal.steps": (
        1,
        "converting in steps (walk, heal a share, walk again) was retired in 0.10.0: it converted more sites, not "
        "better ones (docs/heal-measurements.md); drop it, and heal once with heal.minutes or heal.tokens",
    ),
}


def drop_retired(flat: dict, given: str = "{key}") -> dict:
    """``flat`` (dotted keys) without the `RETIRED` options at their one remaining value (an older saved config);
    one at another value is refused with what it was and what to use.

    Args:
        flat: Dotted keys to values.
        given: How the user gave a key, for the message (``"--set {key}"``; ``{name}``: the key's last part).
    """
    for key, (kept, why) in RETIRED.items():
        if key in flat and flat.pop(key) != kept:
            raise ValueError(f"{given.format(key=key, name=key.rsplit('.', 1)[-1])}: {why}")
    return flat


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
    rank_every: int = 1
    """With ``metric="kl"``, the ranking reads every n-th position of those (`ReferenceKL` ``every``; 4: faster)."""
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
            raise ValueError(
                f"{flag('budget.nats')} must be a finite number >= 0 (nats of held-out cross-entropy), got "
                f"{self.nats!r}"
            )
        int_at_least("budget.refit_every", self.refit_every, 0, " (sites between refits; 0: never)")
        int_at_least("budget.rank_batches", self.rank_batches, 1, " (calibration batches)")
        int_at_least("budget.rank_every", self.rank_every, 1, " (every n-th position)")
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


@dataclass
class ConvertConfig:
    """One conversion: the model, the target norm, the text, the sections, the output."""

    model: str = "smollm2"
    """A Hugging Face folder, a .gguf file, or "smollm2" / "qwen-coder" (fetched once:
    `normlab.conversion.data.models`)."""
    to: str = "dyisru"
    """The registered norm every site becomes."""
    per: Literal["global", "channel"] = "global"
    """One fitted parameter per site, or "channel": one per channel."""
    exclude: list[str] = field(default_factory=list)
    """fnmatch patterns of norms to keep as they are."""
    init: dict = field(default_factory=dict)
    """Init kwargs of every replacement ({"alpha_init": 0.5})."""
    site_init: dict = field(default_factory=dict)
    """Init kwargs for some sites: {fnmatch pattern: kwargs}."""
    seq_len: int = 128
    """Tokens per sequence."""
    sequences: int = 32
    """Calibration sequences, and as many held out."""
    out: str | None = None
    """The output folder (save_pretrained, normlab_conversion.json, convert_config.json)."""
    overwrite: bool = False
    """Replace an existing output folder (a normlab conversion) once the new one is done."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Where the model runs: calibration, the budget walk, sampling, the heal and the measurements ("cuda": the
    current GPU). The saved folder is the same either way."""
    data: DataConfig = field(default_factory=DataConfig)
    calibrate: CalibrateConfig = field(default_factory=CalibrateConfig)
    heal: HealConfig = field(default_factory=HealConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def heal_on_samples(self) -> bool:
        """A heal that trains on the original's own samples (``data.heal`` "self" or "self+text")."""
        return self.heal.budgeted and self.data.heals_on_samples

    @property
    def samples_original(self) -> bool:
        """Whether the conversion draws the original's own samples: a heal on them, calibration or the walk."""
        return self.data.reads_samples(self.heal.budgeted)

    def sample_count(self) -> int:
        """The original's samples it draws: ``data.samples`` when set, else `HEAL_SAMPLES` for a heal on them, else
        what calibration and the walk on samples can read (2 x ``sequences``, + 8 kept for validation)."""
        if self.data.samples is not None:
            return self.data.samples
        return HEAL_SAMPLES if self.heal_on_samples else 2 * self.sequences + 8

    def _validate_source(self) -> None:
        d = self.data
        if d.calibrates_on_samples and not self.calibrate.enabled:
            raise ValueError(
                f"{flag('data.calibrate')} self picks what calibration fits on; drop {flag('calibrate.enabled')}"
            )
        if d.heals_on_samples and not self.heal.budgeted:
            raise ValueError(
                f"{flag('data.heal')} applies only to a heal: give a budget ({flag('heal.minutes')} or "
                f"{flag('heal.tokens')}), or drop it"
            )
        if d.walks_on_samples and self.budget.nats is None:
            raise ValueError(f"{flag('data.walk')} applies only with {flag('budget.nats')}")
        uses = [k for k, v in (("data.calibrate", d.calibrates_on_samples), ("data.walk", d.walks_on_samples)) if v]
        n = self.sample_count()
        room = n - min(8, max(1, n // 8))  # the samples' validation part stays out
        if self.sequences * len(uses) > room:
            raise ValueError(
                f"{' and '.join(flag(k) for k in uses)} self read {flag('sequences')} ({self.sequences}) each of "
                f"the original's {n} samples, of which {room} are not validation: raise "
                f"{flag('data.samples')} or lower {flag('sequences')}"
            )

    @classmethod
    def from_dict(cls, d: dict) -> ConvertConfig:
        """A config from a dict such as ``to_dict()`` gives (or ``convert_config.json`` holds); unknown fields
        are named."""
        if not isinstance(d, dict):
            raise ValueError(f"a convert config must be an object of fields, got {type(d).__name__}: {d!r:.80}")
        flat = drop_retired({LEGACY_KEYS.get(k, k): v for k, v in _flatten(d).items()})
        d = apply_overrides(cls().to_dict(), flat, free=FREE_TABLES)
        sections = {"data": DataConfig, "calibrate": CalibrateConfig, "heal": HealConfig, "budget": BudgetConfig}
        for name, kind in sections.items():
            if not isinstance(d[name], dict):
                raise ValueError(f"{name} must be a table of {name} settings ({name}.field=...), got {d[name]!r}")
            d[name] = kind(**d[name])
        return cls(**d)

    def validate(self) -> None:
        """Every check that needs neither the model nor a file, so that a bad config fails before any work."""
        from normlab.kernels import auto_choice
        from normlab.registry import calibratable_norms, norm_spec

        check_types(self)
        for name in ("model", "to"):
            if not getattr(self, name).strip():
                raise ValueError(f"{flag(name)} must be a non-empty string, got {getattr(self, name)!r}")
        spec = norm_spec(self.to)  # the target, resolved once: an unknown name lists the valid ones
        self.calibrate.validate(spec)
        auto_choice()  # NORMLAB_KERNEL, if set, must be valid
        if self.out is not None and not self.out.strip():
            raise ValueError(f"{flag('out')} is empty; name a folder")
        if self.device == "cuda" and not (torch := __import__("torch")).cuda.is_available():
            raise ValueError(
                f"{flag('device')} cuda: this machine has no CUDA device (torch.cuda.is_available() is False, "
                f"torch {torch.__version__}); use --device cpu"
            )
        for name, least in (("seq_len", 2), ("sequences", 1)):
            if getattr(self, name) < least:
                raise ValueError(f"{flag(name)} must be >= {least}, got {getattr(self, name)!r}")
        if not all(isinstance(p, str) for p in self.exclude):
            raise ValueError(f"{flag('exclude')} must be a list of name patterns, got {self.exclude!r}")
        if not all(isinstance(v, dict) for v in self.site_init.values()):
            raise ValueError(f"site_init must map name patterns to init tables, got {self.site_init!r}")
        self.budget.validate(calibrated=self.calibrate.enabled)
        c = self.calibrate
        if c.enabled and not spec.fits:
            raise ValueError(
                f"--to {self.to}: calibration fits the parameter of {', '.join(calibratable_norms())}; "
                f"{self.to} has none to fit: pass --no-calibrate (the new norms keep their default "
                "init)"
            )
        for what, kwargs in [("--init", self.init), *((f"site_init[{p!r}]", kw) for p, kw in self.site_init.items())]:
            if not isinstance(kwargs, dict):
                raise ValueError(f"{what} must be a table of init values, got {kwargs!r}")
            try:
                spec.create(8, **kwargs)
            except (TypeError, ValueError) as e:
                raise ValueError(f"{what} {' '.join(f'{k}={v}' for k, v in kwargs.items())}: {e}") from None
        self.heal.validate()
        self.data.validate()
        if self.samples_original and self.data.samples is None:
            self.data.samples = self.sample_count()  # resolved once, so convert_config.json records it
        self._validate_source()
        self._validate_samples()
        check_limits(self)

    def _validate_samples(self) -> None:
        """The original's samples' knobs are refused where nothing samples, and a heal step may not exceed the
        heal's token budget."""
        h, d, plain = self.heal, self.data, DataConfig.__dataclass_fields__
        sampled = self.samples_original
        why = (
            f"a conversion that samples the original ({flag('data.heal')} self or self+text, "
            f"{flag('data.calibrate')} self, data.walk)"
        )
        for name, idle, needs in (("samples", not sampled, why), ("temperature", not sampled, why),
                                  ("starts", not sampled, why), ("precision", not sampled, why),
                                  ("self_fraction", not (h.budgeted and d.heal == "self+text"),
                                   f"{flag('data.heal')} self+text, whose batches it splits,")):  # fmt: skip
            if idle and getattr(d, name) != plain[name].default:
                raise ValueError(f"{flag('data.' + name)} does nothing here: only {needs} uses it; drop it")
        step = h.batch_size * self.seq_len
        if h.tokens is not None and step > h.tokens:
            raise ValueError(
                f"{flag('heal.batch_size')} {h.batch_size} x {flag('seq_len')} {self.seq_len} = {step:,} tokens a "
                f"step, more than the budget {flag('heal.tokens')} {h.tokens:,}: lower the batch or raise it"
            )

    def identity(self, **facts) -> dict:
        """What a heal checkpoint must share to be resumed: every field that shapes the converted model or the heal
        (not the budget, the output or the checkpoint's place), as dotted keys, plus ``facts`` (the model's
        fingerprint, the text's hash: what only the run knows)."""
        flat = _flatten(self.to_dict())
        for key in NOT_IDENTITY:
            flat.pop(key)
        return {**flat, "heal.lr": self.heal.rate(), **facts}  # the rate the heal runs at: a default may move

    def difference(self, saved: dict | None, **facts) -> str | None:
        """How a checkpoint's identity differs from this config's (the fields named), or None when it does not."""
        if isinstance(saved, dict):  # a checkpoint of before 0.6 names the data fields where they were
            saved = {LEGACY_KEYS.get(k, k): v for k, v in saved.items()}
            saved = {k: v for k, v in saved.items() if k not in RETIRED or v != RETIRED[k][0]}
        return identity_difference(saved, self.identity(**facts))


def _flatten(d: dict, prefix: str = "") -> dict:
    """{"heal": {"lr": 1}} -> {"heal.lr": 1}; the free tables (init, site_init) stay whole."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and k in SECTIONS and not prefix:
            out.update(_flatten(v, f"{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def resolve_convert_config(overrides: dict | list[str] | None = None, **fields_: object) -> ConvertConfig:
    """The defaults, then ``fields_`` (dotted or top-level names: ``model="smollm2"``, ``**{"heal.minutes": 5}``),
    then ``overrides`` (``["heal.lr=3e-3"]``, as ``--set`` gives them); validated. A field given both ways with two
    values (``--heal-tokens 1000 --set heal.tokens=2000``) is an error, not a silent choice.

    Args:
        overrides: Dotted ``key=value`` strings (a list) or a dict, applied last.
        **fields_: Fields by name, dotted for a section's (``**{"heal.minutes": 5}``).
    """
    pairs = (
        parse_pairs(overrides, "--set", "heal.lr=3e-3") if isinstance(overrides, list) else (overrides or {}).items()
    )
    pairs = list(pairs)
    for key in (*fields_, *_flatten(dict(pairs))):  # a nested table ({"heal": {"text": ...}}) by its dotted keys
        if key in LEGACY_KEYS:
            given = key if key in fields_ else f"--set {key}"  # a keyword of the Python API, or as --set took it
            raise ValueError(f"{given} is now {LEGACY_KEYS[key]} (the config's sections moved; CHANGELOG.md)")
        if key in RETIRED:
            raise ValueError(f"{key if key in fields_ else f'--set {key}'}: {RETIRED[key][1]}")
    for key, value in pairs:
        given = fields_.get(key)
        if given is not None and given != value:
            raise ValueError(f"{flag(key)} {given!r} and --set {key}={value!r} disagree: give the field once")
    d = apply_overrides(
        ConvertConfig().to_dict(), {k: v for k, v in fields_.items() if v is not None}, free=FREE_TABLES
    )
    if overrides:
        d = apply_overrides(d, overrides, free=FREE_TABLES)
    try:
        cfg = ConvertConfig.from_dict(d)
    except TypeError as e:  # a section set to something that is not a table
        raise ValueError(f"bad convert config: {e}") from None
    cfg.validate()
    return cfg
