"""Judging a converted language model as it will be used, against its original, as quantizers judge theirs
(llama.cpp's ``llama-perplexity --kl-divergence``): statistics per token and per sequence, not a mean alone.

Per token (every scored position):

* the KL divergence KL(original || converted) of the next-token distributions: mean, median, 99th percentile, max;
* "same top-1": the share of positions where both models' most likely next token is the same.

Per sequence: the gap of next-token cross-entropy (converted minus original, nats per token): its mean, median,
worst, and the count of sequences more than 2 nats above the original. By position: the gap over bins of the
position, which shows a conversion that drifts past the length it was fitted at.

`TokenTally` accumulates these over (ids, start) items: sequences of token ids scored from position ``start`` on
(a chat answer after its prompt; 0 for plain text). Each sequence runs whole, but its logits are made from the
final hidden states a chunk of positions at a time (`sequence_logits`), so a 152k vocabulary at 2,048 tokens costs
256 positions' logits at a time, not 1.2 GB per model.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch import Tensor, nn

from normlab.conversion.batches import Stop, run_hooked

__all__ = ["BINS", "TokenTally", "guard_items", "guard_prefixes", "heal_verdict", "judge_tokens", "kl_rows",
           "top_k_kl"]  # fmt: skip

BINS = (0, 128, 256, 512, 1024, 2048, 4096)  # the position bins of the gap by position: [0, 128), [128, 256), ...
_CHUNK = 256  # positions reduced at a time


def kl_rows(a: Tensor, b: Tensor) -> Tensor:
    """KL(softmax(a) || softmax(b)) per row of logits (..., V), float32.

    Args:
        a: The reference logits (the original's).
        b: The other logits (the converted model's).
    """
    la, lb = a.float().log_softmax(-1), b.float().log_softmax(-1)
    return (la.exp() * (la - lb)).sum(-1)


class TokenTally:
    """The per-token and per-sequence statistics of one text (module docstring), accumulated item by item."""

    def __init__(self) -> None:
        self.kld: list[Tensor] = []
        self.same: list[Tensor] = []
        self.gaps: list[float] = []
        self.ce = [0.0, 0.0]
        self.n_ce = 0
        self.by_bin: dict[int, list[float]] = {}  # bin start -> [summed gap, count]

    def add(self, a: Tensor, b: Tensor, ids: Tensor, start: int = 0) -> None:
        """One sequence: the original's logits ``a`` and the converted model's ``b`` (T, V), its token ids (T,),
        scored from position ``start`` (the first position whose next token counts is ``start - 1``)."""
        first = max(start - 1, 0)
        seq_ce = [0.0, 0.0]
        n = 0
        for lo in range(first, a.shape[0], _CHUNK):
            hi = min(lo + _CHUNK, a.shape[0])
            ca, cb = a[lo:hi].float(), b[lo:hi].float()
            self.same.append((ca.argmax(-1) == cb.argmax(-1)).cpu())
            la, lb = ca.log_softmax(-1), cb.log_softmax(-1)  # once, for the KL and both cross-entropies
            del ca, cb
            self.kld.append((la.exp() * (la - lb)).sum(-1).cpu())
            nxt = ids[lo + 1 : hi + 1].to(la.device)  # the next token of each position that has one
            k = len(nxt)
            if k == 0:
                continue
            ce_a = -la[:k].gather(-1, nxt[:, None])[:, 0]
            ce_b = -lb[:k].gather(-1, nxt[:, None])[:, 0]
            seq_ce[0], seq_ce[1], n = seq_ce[0] + float(ce_a.sum()), seq_ce[1] + float(ce_b.sum()), n + k
            positions = torch.arange(lo, lo + k)
            gap = (ce_b - ce_a).cpu()
            for b0, b1 in zip(BINS, BINS[1:]):
                m = (positions >= b0) & (positions < b1)
                if bool(m.any()):
                    acc = self.by_bin.setdefault(b0, [0.0, 0])
                    acc[0], acc[1] = acc[0] + float(gap[m].sum()), acc[1] + int(m.sum())
        if n:
            self.gaps.append((seq_ce[1] - seq_ce[0]) / n)
            self.ce, self.n_ce = [self.ce[0] + seq_ce[0], self.ce[1] + seq_ce[1]], self.n_ce + n

    def result(self) -> dict:
        """The statistics as a dict (nats; ``same_top1`` a fraction; ``by_position`` keyed "lo-hi")."""
        if not self.kld:
            raise ValueError("judge: no scored positions (empty items, or every item scored from its end)")
        kld = torch.cat(self.kld).double()
        gaps = torch.tensor(self.gaps, dtype=torch.float64)
        out = {
            "tokens": len(kld),
            "kld": {
                "mean": float(kld.mean()),
                "median": float(kld.median()),
                "p99": float(torch.quantile(kld, 0.99)),
                "max": float(kld.max()),
            },
            "same_top1": float(torch.cat(self.same).double().mean()),
            "nonfinite": int((~torch.isfinite(kld)).sum()),  # positions whose logits overflowed: their KL is nan
        }
        if self.n_ce:
            out["ce_original"], out["ce_converted"] = self.ce[0] / self.n_ce, self.ce[1] / self.n_ce
            out["sequences"] = len(gaps)
            out["gap"] = {
                "mean": float(gaps.mean()),
                "median": float(gaps.median()),
                "worst": float(gaps.max()),
                "over_2": int((gaps > 2).sum()),
            }
            out["by_position"] = {
                f"{b0}-{BINS[BINS.index(b0) + 1] - 1}": s / c for b0, (s, c) in sorted(self.by_bin.items())
            }
        return out


_CHUNKABLE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> whether `sequence_logits` may chunk


class _HeadLogits:
    """A sequence's logits, made when sliced: the output layer applied to the final hidden states of those
    positions (and the model's final soft cap, where it has one). Holds (T, hidden), not (T, V)."""

    def __init__(self, hidden: Tensor, head: nn.Module, cap: float | None) -> None:
        self.hidden, self.head, self.cap = hidden, head, cap
        self.shape = (hidden.shape[0], head.out_features)

    def __getitem__(self, rows: slice) -> Tensor:
        out = self.head(self.hidden[rows])
        return out if not self.cap else torch.tanh(out / self.cap) * self.cap


def sequence_logits(model: nn.Module, x: Tensor) -> Tensor | _HeadLogits:
    """The logits of one sequence ``x`` (1, T), (T, V): made a chunk of positions at a time when sliced, from the
    hidden states the model gives its output layer, where that reproduces the model's own logits (checked once per
    model on the first 8 positions, within 1e-4 of their scale); else the model's whole logits.

    Args:
        model: A causal LM (``get_output_embeddings`` a linear layer).
        x: Token ids, (1, T).
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear) or _CHUNKABLE.get(model) is False:
        return model(x, use_cache=False).logits[0]
    got: list[Tensor] = []

    def grab(mod, args):
        got.append(args[0][0])
        raise Stop

    cap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
    run_hooked(model, x, 0, {next(n for n, m in model.named_modules() if m is head): grab}, "pre")
    lazy = _HeadLogits(got[0], head, cap) if len(got) == 1 and got[0].shape[0] == x.shape[-1] else None
    if model not in _CHUNKABLE:
        want = model(x[:, :8], use_cache=False).logits[0].float()
        have = lazy[:8].float() if lazy is not None else None
        _CHUNKABLE[model] = have is not None and bool(
            (have - want).abs().max() <= 1e-4 * max(float(want.abs().max()), 1.0)
        )
    return lazy if _CHUNKABLE[model] else model(x, use_cache=False).logits[0]


@torch.no_grad()
def judge_tokens(original: nn.Module, converted: nn.Module, items: Iterable[tuple[Tensor, int]]) -> dict:
    """`TokenTally`'s statistics of ``converted`` against ``original`` over ``items``: (ids, start) pairs, ids a
    (T,) or (1, T) sequence of token ids, scored from position ``start`` (0: every position).

    Args:
        original: The model before conversion (outputs with ``.logits``).
        converted: The converted model, same tokenizer.
        items: The sequences and where each is scored from.
    """
    tally = TokenTally()
    modes = (original.training, converted.training)
    original.eval()
    converted.eval()
    try:
        for ids, start in items:
            ids = ids.reshape(1, -1)
            device = next(original.parameters()).device
            x = ids.to(device)
            tally.add(sequence_logits(original, x), sequence_logits(converted, x), ids[0], start)
    finally:
        original.train(modes[0])
        converted.train(modes[1])
    return tally.result()


def guard_prefixes(tokenizer: object | None) -> list[Tensor]:
    """The starts a heal on samples from BOS never sees, as token ids: two newlines, and the BOS itself (where the
    tokenizer has one); none without a tokenizer.

    Args:
        tokenizer: The model's tokenizer, or None.
    """
    if tokenizer is None:
        return []
    out = [torch.tensor(tokenizer("\n\n", add_special_tokens=False)["input_ids"], dtype=torch.long)]
    bos = getattr(tokenizer, "bos_token_id", None)
    return out + ([torch.tensor([bos])] if bos is not None else [])


def guard_items(val: list[Tensor], prefixes: list[Tensor], starts: int = 16) -> list[tuple[Tensor, int]]:
    """What a heal is judged on before it is kept: the validation sequences; each again after each of ``prefixes``
    (e.g. two newline tokens, a BOS: starts a heal on samples from BOS never sees); and windows of half a sequence
    cut at ``starts`` offsets of each, so that many different tokens come first (a first token is a massive one, and
    a heal on samples that all start from BOS can break the others: on SmolLM2 the self recipe with LoRA read +13
    nats on a held-out sequence that begins "ath" while its 8 validation sequences improved).

    Args:
        val: The validation batches, (B, T) each.
        prefixes: Token ids put before each sequence, (k,) each.
        starts: Offsets per sequence of the half-length windows.
    """
    seqs = [s for b in val for s in b]
    items = [(s, 0) for s in seqs] + [(torch.cat([p, s])[: len(s)], 0) for p in prefixes for s in seqs]
    for s in seqs:
        half = max(len(s) // 2, 2)
        step = max((len(s) - half) // starts, 1)
        items += [(s[o : o + half], 0) for o in range(step, len(s) - half + 1, step)][:starts]
    return items


def heal_verdict(before: dict, after: dict) -> dict:
    """Whether a heal is kept: its worst sequence and its p99 KL divergence on the guard items (`guard_items`) must
    not rise; a mean that fell does not buy a tail that rose.

    Args:
        before: `judge_tokens` on the guard items before the heal.
        after: The same after it.
    """
    rose = [
        f"{what} {b:.3g} -> {a:.3g}"
        for what, b, a in (
            ("worst sequence gap", before["gap"]["worst"], after["gap"]["worst"]),
            ("p99 KLD", before["kld"]["p99"], after["kld"]["p99"]),
        )
        if not a <= b
    ]
    return {
        "kept": not rose,
        "rose": rose,
        "before": {"worst": before["gap"]["worst"], "p99": before["kld"]["p99"], "mean": before["kld"]["mean"]},
        "after": {"worst": after["gap"]["worst"], "p99": after["kld"]["p99"], "mean": after["kld"]["mean"]},
    }


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x <= 0, accurate at both ends (Maechler 2012); x is clamped just below 0, so a
    student that puts all its mass on the top k gives a finite (very negative) tail."""
    x = x.clamp(max=-1e-7)
    return torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def top_k_kl(logq: torch.Tensor, values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """KL_k(p || q) of the module docstring, averaged over tokens: ``logq`` the student's log-probabilities
    (B, T, V), ``values`` / ``index`` the teacher's top k (B, T, k) from `teacher_top_k`.

    Args:
        logq: The student's log-probabilities, (B, T, V).
        values: The teacher's top k log-probabilities, (B, T, k).
        index: Their token ids, (B, T, k).
    """
    lq = logq.gather(-1, index)
    p = values.exp()
    p_tail = (1.0 - p.sum(-1)).clamp_min(0.0)
    lq_tail = _log1mexp(torch.logsumexp(lq, -1))
    head = (p * (values - lq)).sum(-1)
    tail = torch.xlogy(p_tail, p_tail) - p_tail * lq_tail
    return (head + tail).sum() / head.numel()
