"""A teacher cache for distillation: the original's top-k next-token log-probabilities per sequence, computed the
first time a sequence is drawn and read back every later time.

A heal on the original's own samples (``data.heal = "self"``) passes over its 1,016 training sequences about
three times in 30 minutes on two cores, and the original's forward pass is about a third of a distillation step
(the converted model's forward and backward are the rest). Cached, the teacher is paid for once per sequence.

What it stores and what the loss is. Per token, the k most probable next tokens of the original (their ids and
log-probabilities, float32) and nothing else; the rest of the vocabulary is one "tail" outcome. The loss is the KL
between the two distributions over those k + 1 outcomes (`normlab.conversion.measure.judge.top_k_kl`):

    KL_k(p || q) = sum_{i in S} p_i (log p_i - log q_i) + p_tail (log p_tail - log q_tail),
    S = the original's top k,   p_tail = 1 - sum_{i in S} p_i,   q_tail = 1 - sum_{i in S} q_i.

Merging outcomes never raises a KL, so KL_k <= KL, with equality at k = the vocabulary (tested); it matches the
two models where the original puts its probability and leaves the tail's shape free. The validation curve is
always measured with the full KL and cross-entropy, so a cached heal is judged like any other.
"""

from __future__ import annotations

import torch
from torch import nn

from normlab.conversion.batches import log_probs
from normlab.conversion.measure.judge import top_k_kl

__all__ = ["TeacherCache", "teacher_top_k"]


def teacher_top_k(original: nn.Module, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The original's k largest next-token log-probabilities at every position of ``ids`` (B, T): (values
    float32 (B, T, k), token ids int64 (B, T, k)), in decreasing order.

    Args:
        original: The unconverted model.
        ids: Token ids, (B, T).
        k: How many log-probabilities per position.
    """
    with torch.no_grad():
        logp = log_probs(original, ids, stage="heal (the original, as teacher)")
    return logp.topk(min(k, logp.shape[-1]), dim=-1)


class TeacherCache:
    """The original's top-k per training sequence, keyed by the sequence's tokens (so any stream, a mixed one
    included, is served), computed for the rows not seen before in one batch. ``reused`` and ``computed`` count
    sequences. Memory: 8 bytes x k per token (1,016 sequences of 128 tokens at k = 64: 67 MB).

    Args:
        original: The unconverted model, the teacher.
        k: How many of its largest log-probabilities are kept per token.
    """

    def __init__(self, original: nn.Module, k: int) -> None:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"TeacherCache: k must be an int >= 1, got {k!r}")
        self.original, self.k = original, k
        self.store: dict[bytes, tuple[torch.Tensor, torch.Tensor]] = {}
        self.reused = self.computed = 0

    def targets(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The top k of every row of ``ids`` (B, T): (values (B, T, k), ids (B, T, k))."""
        keys = [row.numpy().tobytes() for row in ids]
        new: dict[bytes, int] = {}  # each unseen row once, even if the batch holds it twice
        for i, key in enumerate(keys):
            if key not in self.store and key not in new:
                new[key] = i
        if new:
            values, index = teacher_top_k(self.original, ids[list(new.values())], self.k)
            for j, key in enumerate(new):
                self.store[key] = (values[j].clone(), index[j].to(torch.int32))
        self.computed += len(new)
        self.reused += len(keys) - len(new)
        rows = [self.store[key] for key in keys]
        return torch.stack([v for v, _ in rows]), torch.stack([i for _, i in rows]).long()

    def loss(self, converted: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """KL_k(original || converted) on ``ids``, the original's side read from the cache (or computed once)."""
        values, index = self.targets(ids)
        logq = log_probs(converted, ids, stage="heal")
        return top_k_kl(logq, values, index)
