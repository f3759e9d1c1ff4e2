"""The lab's optimizers and schedule: AdamW, or torch.optim.Muon for the blocks' matrices beside AdamW, and warmup
plus cosine decay. The trainer (`normlab.lab.train`) builds them with `build_optimizer`."""

from __future__ import annotations

import math

import torch

from normlab.lab.config import TrainConfig

__all__ = ["lr_at", "muon_parameters", "Optimizers", "build_optimizer"]


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to cfg.lr, then cosine decay to cfg.min_lr at cfg.steps.

    Args:
        step: The step.
        cfg: The run's config.
    """
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def muon_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The hidden matrices Muon updates: every 2-D weight inside the blocks (attention and MLP projections).
    The embedding, the head and every vector or scalar stay with AdamW, as in modded-nanogpt.

    Args:
        model: The GPT.
    """
    return [p for p in model.blocks.parameters() if p.dim() == 2]


class Optimizers:
    """Muon and AdamW stepped together: one object to the trainer and to the checkpoint."""

    def __init__(self, *optimizers: torch.optim.Optimizer) -> None:
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict]:
        return [g for o in self.optimizers for g in o.param_groups]

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"optimizers": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state: dict) -> None:
        for o, s in zip(self.optimizers, state["optimizers"], strict=True):
            o.load_state_dict(s)


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig, device: torch.device):
    """AdamW (weight decay on matrices and embeddings only), or with ``optimizer = "muon"`` torch.optim.Muon for
    the blocks' matrices (``muon_parameters``) and AdamW for the rest. Each group keeps its peak rate in
    ``peak_lr``; the schedule (``lr_at``) scales every group alike.

    Args:
        model: The GPT.
        cfg: The run's config.
        device: Where it trains (fused AdamW on CUDA).
    """
    muon = muon_parameters(model) if cfg.optimizer == "muon" else []
    taken = {id(p) for p in muon}
    rest = [p for p in model.parameters() if id(p) not in taken]
    decay = [p for p in rest if p.dim() >= 2]  # matrices and embeddings
    no_decay = [p for p in rest if p.dim() < 2]  # norm weights, biases, alpha, log_beta
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    adamw = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=device.type == "cuda")
    for g in adamw.param_groups:
        g["peak_lr"] = cfg.lr
    if not muon:
        return adamw
    opt = torch.optim.Muon(muon, lr=cfg.muon_lr, weight_decay=cfg.weight_decay, momentum=cfg.muon_momentum)
    for g in opt.param_groups:
        g["peak_lr"] = cfg.muon_lr
    return Optimizers(opt, adamw)
