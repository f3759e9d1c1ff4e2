"""Low-rank adapters (LoRA) for healing: a trainable update of a frozen linear layer, folded into its weight when
the heal ends, so that a saved model has no adapters.

    wrapped = add_lora(model.model.layers, rank=8)   # every nn.Linear inside, wrapped; B = 0, so outputs unchanged
    ...                                             # train the wrappers' lora_a / lora_b
    merge_lora(model)                               # W += B A * scale, the wrappers removed
"""

from __future__ import annotations

import math

import torch
from torch import nn

from normlab.conversion.config import LORA_RANK

__all__ = ["LoRALinear", "add_lora", "merge_lora", "LORA_RANK"]


class LoRALinear(nn.Module):
    """``base(x) + (x A^T) B^T * scale``; B starts at zero, so the output starts equal to the base layer's.

    Args:
        base: The wrapped layer (frozen).
        rank: The adapters' rank.
        scale: The low-rank term's multiple.
    """

    def __init__(self, base: nn.Linear, rank: int = LORA_RANK, scale: float = 1.0) -> None:
        super().__init__()
        self.base, self.scale = base, scale
        w = base.weight
        self.lora_a = nn.Parameter(
            torch.randn(rank, base.in_features, dtype=w.dtype, device=w.device) / math.sqrt(base.in_features)
        )
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank, dtype=w.dtype, device=w.device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + nn.functional.linear(nn.functional.linear(x, self.lora_a), self.lora_b) * self.scale

    def merged(self) -> nn.Linear:
        """The base layer with the update folded into a new weight (the same outputs, up to rounding). The old weight
        is left as it was: the original model may share it (`normlab.conversion.batches.sharing_copy`)."""
        w = self.base.weight
        with torch.no_grad():
            self.base.weight = nn.Parameter(
                w + (self.lora_b @ self.lora_a).to(w) * self.scale, requires_grad=w.requires_grad
            )
        return self.base


def add_lora(module: nn.Module, rank: int = LORA_RANK) -> list[LoRALinear]:
    """Wrap every ``nn.Linear`` inside ``module`` in a `LoRALinear`; returns the wrappers.

    Args:
        module: The model or block whose linear layers are wrapped.
        rank: The adapters' rank.
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"LoRA rank: expected an int >= 1, got {rank!r}")
    wrapped = []
    for m in list(module.modules()):
        for child_name, child in list(m.named_children()):
            if type(child) is nn.Linear:
                lora = LoRALinear(child, rank)
                setattr(m, child_name, lora)
                wrapped.append(lora)
    return wrapped


def merge_lora(module: nn.Module) -> int:
    """Fold every `LoRALinear` inside ``module`` into its base layer, in place; returns how many.

    Args:
        module: The model or block.
    """
    n = 0
    for m in list(module.modules()):
        for child_name, child in list(m.named_children()):
            if isinstance(child, LoRALinear):
                setattr(m, child_name, child.merged())
                n += 1
    return n
