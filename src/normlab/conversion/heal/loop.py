"""What a heal is made of: the report, the run's state, the budget, the validation curve, the optimizer and the
checkpoint. `normlab.conversion.heal.distill` is the entry point; this module is its parts."""

from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from normlab.conversion.batches import as_batches, input_ids, log_probs, logit_rows, row_chunks
from normlab.conversion.config import HEAL_LEARNING_RATES, HealConfig, identity_difference
from normlab.conversion.data.streams import MixedStream
from normlab.conversion.data.texts import TokenStream
from normlab.conversion.heal.lora import LoRALinear

__all__ = ["HealReport", "HealRun", "Budget", "Validation", "is_ours", "trainable", "frozen", "make_optimizer",
           "load_checkpoint", "heal_state", "mean_finite", "postfix", "lr_factor", "set_lr"]  # fmt: skip


@dataclass
class HealReport:
    train: str = "norms"
    curve: list[dict] = field(default_factory=list)  # tokens, seconds, train_loss, val_ce, val_kl
    best: dict | None = None  # the curve point whose state was kept
    tokens: int = 0
    sequences: int = 0  # distinct stream sequences drawn
    stream_passes: float = 0.0  # sequences drawn / stream length
    seconds: float = 0.0
    resumed_from: int = 0
    lora_rank: int | None = None
    frozen_blocks: int = 0  # the blocks before the first converted one, left the original's (HealConfig.early_blocks)
    rollbacks: int = 0  # times the heal went back to its best state and halved its rate (HealConfig.rollback_nats)
    teacher_computed: int = 0  # with a teacher cache (HealConfig.teacher_top_k): sequences the original ran on
    teacher_reused: int = 0  # and sequences whose targets were read back from it
    precision: str = "float32"  # the steps' arithmetic, and why (HealConfig.precision, resolved)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> HealReport:
        """A report as `to_dict` wrote it; the fields of a retired objective (a checkpoint of before 0.10.0) left."""
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


def is_ours(m: nn.Module) -> bool:
    """A module normlab put into the model (a replacement norm, not a LoRA wrapper).

    Args:
        m: A module of the model.
    """
    return type(m).__module__.startswith("normlab.") and not isinstance(m, LoRALinear)


def trainable(module: nn.Module, train: str) -> list[nn.Parameter]:
    """The parameters a heal with ``train`` ("norms", "lora", "all") trains inside ``module``.

    Args:
        module: The converted model.
        train: "norms", "lora" or "all".
    """
    if train == "all":
        return list(module.parameters())
    params = [p for m in module.modules() if is_ours(m) for p in m.parameters(recurse=False)]
    if train == "lora":
        params += [p for m in module.modules() if isinstance(m, LoRALinear) for p in (m.lora_a, m.lora_b)]
    return params


@contextlib.contextmanager
def frozen(original: nn.Module, converted: nn.Module):
    """Both models in eval mode and every parameter of ``converted`` frozen (the trainer unfreezes what it trains);
    modes and flags are restored on the way out.

    Args:
        original: The unconverted model.
        converted: The model healed.
    """
    modes = (original.training, converted.training)
    grads = [(p, p.requires_grad) for p in converted.parameters()]
    original.eval()
    converted.eval()
    for p, _ in grads:
        p.requires_grad_(False)
    try:
        yield
    finally:
        original.train(modes[0])
        converted.train(modes[1])
        for p, flag in grads:
            if p.requires_grad != flag:
                p.requires_grad_(flag)


def make_optimizer(
    params: list, lr: float, converted: nn.Module, scale: float = 1.0, lora_lr: float = HEAL_LEARNING_RATES["lora"]
) -> torch.optim.Optimizer:
    """Adam over ``params``. DyT's alpha is stored as is and can sit anywhere from 1e-4 to 10 after calibration,
    and Adam's steps are absolute, so each alpha gets a rate relative to its own size (log_beta is already a
    log); LoRA's adapters get their own rate. ``scale`` multiplies every group's rate (after a rollback).

    Args:
        params: The trained parameters.
        lr: The base rate.
        converted: The model they belong to (to find DyT's alphas and LoRA's adapters).
        scale: A multiple of every group's rate.
        lora_lr: The adapters' rate (``heal.lora_lr``).
    """
    alphas = {
        id(m.alpha) for m in converted.modules() if is_ours(m) and isinstance(getattr(m, "alpha", None), nn.Parameter)
    }
    lora = {id(p) for m in converted.modules() if isinstance(m, LoRALinear) for p in (m.lora_a, m.lora_b)}
    plain = [p for p in params if id(p) not in alphas and id(p) not in lora]
    lr = lr * scale
    groups = [{"params": plain, "lr": lr},
              {"params": [p for p in params if id(p) in lora], "lr": lora_lr * scale}]  # fmt: skip
    groups += [
        {"params": [p], "lr": lr * float(p.detach().abs().mean().clamp_min(1e-12))} for p in params if id(p) in alphas
    ]
    return torch.optim.Adam([g for g in groups if g["params"]])


def lr_factor(schedule: str, used: float) -> float:
    """The multiple of the base rate at ``used`` (the fraction of the budget spent): 1 for "constant"; for
    "cosine", a linear warmup over the first 5% of the budget, then a cosine down to 0.1 at its end; for
    "cooldown", 1 until the last 20% of the budget, then a straight line down to 0 at its end (the constant
    rate's noise averaged away at the end, as in a warmup-stable-decay schedule: Hägele et al. 2024, "Scaling Laws
    and Compute-Optimal Training Beyond Fixed Training Durations", arXiv 2405.18392).

    Args:
        schedule: "constant", "cosine" or "cooldown".
        used: The fraction of the budget spent, in [0, 1].
    """
    if schedule == "constant":
        return 1.0
    used = min(max(used, 0.0), 1.0)
    if schedule == "cooldown":
        return min(1.0, (1.0 - used) / COOLDOWN)
    if used < WARMUP:
        return (used + 0.01) / (WARMUP + 0.01)  # never 0: the first step moves
    t = (used - WARMUP) / (1.0 - WARMUP)
    return FLOOR + (1.0 - FLOOR) * 0.5 * (1.0 + math.cos(math.pi * t))


WARMUP, FLOOR = 0.05, 0.1  # the cosine schedule's warmup fraction and final multiple
COOLDOWN = 0.2  # the cooldown schedule's last part of the budget, over which the rate falls to 0


def set_lr(opt: torch.optim.Optimizer, factor: float) -> float:
    """Every group's rate at ``factor`` times its base (recorded in the group on the first call, so it survives a
    checkpoint); returns the first group's rate.

    Args:
        opt: The optimizer.
        factor: The multiple of each group's base rate.
    """
    for g in opt.param_groups:
        g["lr"] = g.setdefault("base_lr", g["lr"]) * factor
    return opt.param_groups[0]["lr"]


def postfix(point: dict) -> str:
    """A curve point as the progress bar shows it.

    Args:
        point: A validation curve point.
    """
    return f"val CE {point['val_ce']:.3f}, KL {point['val_kl']:.3f}"


def mean_finite(xs: list[float]) -> float:
    """The mean of the finite values of ``xs``; NaN when there is none.

    Args:
        xs: Numbers.
    """

    xs = [x for x in xs if math.isfinite(x)]
    return sum(xs) / len(xs) if xs else math.nan


class Budget:
    """The heal's budget (minutes or tokens) and how much of it is spent, across a resume.

    Args:
        cfg: The heal's config section.
        report: The heal's report, whose tokens and seconds a resume continues from.
    """

    def __init__(self, cfg: HealConfig, report: HealReport) -> None:
        self.minutes, self.tokens, self.report = cfg.minutes, cfg.tokens, report
        self.start, self.before = time.monotonic(), report.seconds

    def seconds(self) -> float:
        return self.before + time.monotonic() - self.start

    def used(self) -> float:
        """The fraction of the budget spent."""
        if self.minutes is not None:
            return self.seconds() / 60.0 / self.minutes
        return self.report.tokens / self.tokens


class Validation:
    """The validation split's cross-entropy and KL to the original (whose log-probabilities are computed once),
    and the best state seen (of the trained parameters only).

    Args:
        original: The unconverted model.
        converted: The model healed.
        val: The validation batches (token ids), or None for none.
        params: The trained parameters, whose best state is kept.
    """

    def __init__(self, original: nn.Module, converted: nn.Module, val: list | None, params: list[nn.Parameter]) -> None:
        self.converted = converted
        whole = [input_ids(b) for b in as_batches(val)] if val is not None else []
        # a few rows at a time where the vocabulary is large: the stored targets are those rows' log-probabilities,
        # and a measure holds one part's logits beside them (`logit_rows`)
        self.batches = [p for b in whole for p in row_chunks(b, logit_rows(original, b))]
        with torch.no_grad():
            self.targets = [
                log_probs(original, b, i, stage="heal (the original, as teacher)") for i, b in enumerate(self.batches)
            ]
        self.params = params
        self.best_ce, self.best_point, self.best_state = math.inf, None, None

    def measure(self) -> tuple[float, float]:
        if not self.batches:
            return math.nan, math.nan
        ce = kl = 0.0
        n_ce = n_kl = 0
        with torch.no_grad():
            for i, (ids, target) in enumerate(zip(self.batches, self.targets)):
                logp = log_probs(self.converted, ids, i, stage="heal")
                ce -= float(logp[:, :-1].gather(-1, ids[:, 1:, None].to(logp.device)).sum())
                n_ce += ids[:, 1:].numel()
                kl += float((target.exp() * (target - logp)).sum())
                n_kl += ids.numel()
        return ce / n_ce, kl / n_kl

    def offer(self, point: dict) -> bool:
        """Keep the current state if its validation cross-entropy is the best so far; True when kept."""
        ce = point["val_ce"]
        if not math.isfinite(ce) or ce >= self.best_ce:
            return False
        self.best_ce, self.best_point = ce, point
        self.best_state = [p.detach().clone() for p in self.params]
        return True

    def restore(self) -> None:
        if self.best_state is not None:
            with torch.no_grad():
                for p, v in zip(self.params, self.best_state):
                    p.copy_(v)


@dataclass
class HealRun:
    """One heal in progress: the two models, the data, what is trained and how, and where it is saved
    (`normlab.conversion.heal.distill.distill` reads it)."""

    original: nn.Module
    converted: nn.Module
    stream: TokenStream | MixedStream
    params: list[nn.Parameter]
    cfg: HealConfig
    check: Validation
    budget: Budget
    report: HealReport
    list_name: str  # the nn.ModuleList of blocks
    ckpt: Path | None = None
    state: dict | None = None  # the checkpoint resumed from
    identity: dict | None = None
    progress: bool | None = None

    @property
    def bar_disabled(self) -> bool | None:
        return {True: False, False: True}.get(self.progress)  # None: tqdm shows a bar only on a terminal

    def point(self, train_loss: float, **extra) -> dict:
        """Measure the validation split now and add the point to the curve (kept as the best state if it is)."""
        ce, kl = self.check.measure()
        point = {"tokens": self.report.tokens, "seconds": round(self.budget.seconds(), 2), "train_loss": train_loss,
                 "val_ce": ce, "val_kl": kl, **extra}  # fmt: skip
        point["best"] = self.check.offer(point)
        self.report.curve.append(point)
        return point

    def optimizer(self) -> torch.optim.Optimizer:
        """A fresh optimizer at the configured rate, halved once per rollback so far."""
        return make_optimizer(
            self.params, self.cfg.rate(), self.converted, 0.5**self.report.rollbacks, self.cfg.lora_rate()
        )

    def rolled_back(self, point: dict) -> bool:
        """Roll back when ``point`` is more than ``rollback_nats`` above the best validation point (or not finite):
        the best state is restored, the rollback counted, and True returned; the caller takes a fresh `optimizer`."""
        nats = self.cfg.rollback_nats
        ce, best = point["val_ce"], self.check.best_ce
        if nats is None or self.check.best_state is None or not (math.isfinite(best) and self.check.batches):
            return False
        if math.isfinite(ce) and ce <= best + nats:
            return False
        self.check.restore()
        self.report.rollbacks += 1
        point["rollback"] = True
        return True

    def save(self, opt: torch.optim.Optimizer | None = None, **extra) -> None:
        """Write the checkpoint (atomically), if the heal has one."""
        if self.ckpt is None:
            return
        self.report.seconds = round(self.budget.seconds(), 2)  # a resume goes on from here: its rate and its budget
        state = {"model": heal_state(self.converted, self.params), "report": self.report.to_dict(),
                 "stream": self.stream.state(), "identity": self.identity, "best": self.check.best_point,
                 "best_state": self.check.best_state, "optimizer": opt.state_dict() if opt is not None else None,
                 **extra}  # fmt: skip
        self.ckpt.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.ckpt.with_suffix(".tmp")
        torch.save(state, tmp)
        os.replace(tmp, self.ckpt)


def heal_state(converted: nn.Module, params: list[nn.Parameter]) -> dict[str, torch.Tensor]:
    """What a heal checkpoint keeps of the model: the trained parameters and the buffers of the modules normlab put
    in. The rest are the original's frozen weights, which a resume loads again (the checkpoint's identity says it
    is the same model and settings). A heal of SmolLM2-135M's norms writes 3.8 MB at each validation point, not
    542.

    Args:
        converted: The model healed.
        params: The trained parameters.
    """
    trained = {id(p) for p in params}
    names = {n for n, p in converted.named_parameters(remove_duplicate=False) if id(p) in trained}
    names |= {
        f"{m_name}.{b}".lstrip(".")
        for m_name, m in converted.named_modules()
        if is_ours(m)
        for b, _ in m.named_buffers(recurse=False)
    }
    return {k: v for k, v in converted.state_dict().items() if k in names}


def load_checkpoint(ckpt: Path, converted: nn.Module, identity: dict | None) -> dict:
    """A heal checkpoint, checked (a heal of this normlab, of the same identity) and loaded into
    ``converted``; a bad one is a clear error.

    Args:
        ckpt: The checkpoint file.
        converted: The model its state is loaded into.
        identity: This heal's identity, compared with the checkpoint's; None skips the comparison.
    """
    try:
        state = torch.load(ckpt, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001  (any unpickling error means the file is unusable)
        raise ValueError(
            f"heal: checkpoint {ckpt} is corrupt or not a heal checkpoint ({type(e).__name__}); "
            "delete it or start without resume"
        ) from None
    if not isinstance(state, dict) or not {"model", "report", "stream"} <= set(state):
        raise ValueError(f"heal: {ckpt} is not a heal checkpoint of this normlab; delete it or start without resume")
    if identity is not None:
        diff = identity_difference(state.get("identity"), identity)
        if diff:
            raise ValueError(
                f"heal: checkpoint {ckpt} was made from another model, text or settings ({diff}); "
                "resume with the same ones, or start afresh with another --checkpoint"
            )
    if state.get("objective", "distill") != "distill":  # before 0.10.0
        raise ValueError(f"heal: checkpoint {ckpt} is of the retired block-wise heal; start afresh without resume")
    try:
        unexpected = converted.load_state_dict(state["model"], strict=False).unexpected_keys
        if unexpected:
            raise RuntimeError(f"unexpected keys {unexpected[:3]}")
    except RuntimeError as e:
        raise ValueError(
            f"heal: checkpoint {ckpt} is not of this converted model ({str(e)[:200]}); "
            "delete it or start without resume"
        ) from None
    return state
