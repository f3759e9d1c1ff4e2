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

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Literal

from normlab.conversion.data.config import HEAL_SAMPLES, DataConfig
from normlab.conversion.flags import SHORTHANDS, flag, identity_difference
from normlab.conversion.limits import check_limits
from normlab.conversion.sections import HEAL_LEARNING_RATES, LORA_RANK, BudgetConfig, CalibrateConfig, HealConfig
from normlab.pairs import apply_overrides, parse_pairs
from normlab.typed import check_types, choices, field_docs

if TYPE_CHECKING:
    pass

__all__ = ["DataConfig", "CalibrateConfig", "HealConfig", "BudgetConfig", "ConvertConfig", "resolve_convert_config",
           "flag", "identity_difference", "SHORTHANDS", "HEAL_LEARNING_RATES", "choices", "field_docs",
           "check_types", "RETIRED", "drop_retired", "LORA_RANK", "check_known_keys", "table_keys"]  # fmt: skip

FREE_TABLES = ("init", "site_init")  # tables whose keys are the user's (init.alpha_init=0.5)
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
    extra_classes: list[str] = field(default_factory=list)
    """Norm classes normlab does not know, as ``module:Class=kind`` (kind: layer_norm, rms_norm, rms_norm_offset)."""
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
        from normlab.sites import class_entries

        class_entries(self.extra_classes)  # each class imported, before any work
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


def table_keys(table: dict) -> list[str]:
    """The dotted keys of a config table (``{"heal": {"lr": 1}}`` -> ``["heal.lr"]``), as a config reads them.

    Args:
        table: A table of fields, flat or by section.
    """
    return list(_flatten(table))


def check_known_keys(keys: Iterable[str], said: Callable[[str], str] = str) -> None:
    """Refuse a key whose field moved (`LEGACY_KEYS`) or was retired (`RETIRED`), named as ``said(key)`` says it.

    Args:
        keys: Dotted keys.
        said: How the error names a key where the user wrote it (``--set heal.text``, ``study.toml: [base]: ...``).
    """
    for key in keys:
        if key in LEGACY_KEYS:
            raise ValueError(f"{said(key)} is now {LEGACY_KEYS[key]} (the config's sections moved; CHANGELOG.md)")
        if key in RETIRED:
            raise ValueError(f"{said(key)}: {RETIRED[key][1]}")


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
    # a nested table ({"heal": {"text": ...}}) by its dotted keys; a keyword of the Python API, or as --set took it
    check_known_keys((*fields_, *_flatten(dict(pairs))), lambda key: key if key in fields_ else f"--set {key}")
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
