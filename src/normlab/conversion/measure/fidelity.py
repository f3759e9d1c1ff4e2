"""How close a converted model is to its original: output cosine, mean site error, KL and cross-entropy."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TypedDict

import torch
from torch import nn

from normlab.conversion.batches import LOGITS_PART_BYTES, as_batches, logit_rows, row_chunks, run_batch
from normlab.conversion.measure.judge import TokenTally
from normlab.record import ConversionRecord

__all__ = ["fidelity", "cross_entropy", "predicts_next_token", "ReferenceKL", "REFERENCE_TOP_K", "ConversionResult",
           "check_result"]  # fmt: skip


class ConversionResult(TypedDict, total=False):
    """What a conversion's ``fidelity.json`` holds (`normlab.conversion.workflow.convert_model` fills it; `fidelity`
    gives the first six keys): the one declaration its readers (`normlab.study.METRICS`, ``normlab evaluate``, the
    heal report, the scripts) read by. A key not declared here is refused by `check_result`."""

    output_cosine: float  # the mean per-token cosine of the final outputs, held-out
    sites: dict  # site -> the relative error of its output, ||y_conv - y_orig|| / ||y_orig||
    mean_site_error: float  # their mean
    kl: float  # KL(original || converted) of the next-token distributions, nats/token
    ce_original: float  # next-token cross-entropy, nats/token
    ce_converted: float
    second_text: dict  # the same on the second text: its name, sequences, ce_original, ce_converted, kl
    budget_walk: dict  # the walk: its budget, metric, text, the sites it converted and each step
    calibration: dict  # how the sites were calibrated: the path, why, seconds
    heal: dict  # the heal's report (`normlab.conversion.heal.report.HealReport`) and its guard's verdict
    before_heal: dict  # ce_converted and kl (and second_text) before the heal
    usage: dict  # the judgement as used (`normlab.conversion.measure.usage.usage_report`)
    usage_error: str  # why the judgement failed, when it did (the conversion is saved without it)
    stages: dict  # stage -> seconds
    stage_peak_gb: dict  # stage -> peak resident memory, GB
    bos_every_sequence: bool  # the tokenizer starts every sequence with BOS
    parameters: int  # the original's parameter count


def check_result(result: dict, where: str = "fidelity.json") -> None:
    """Refuse a result with a key `ConversionResult` does not declare, or a value of another kind, naming it.

    Args:
        result: A conversion's result.
        where: What the error begins with.
    """
    from normlab.typed import check_table

    check_table(result, ConversionResult, where)


REFERENCE_TOP_K = 1024  # the original's log-probabilities `ReferenceKL` keeps per position (the heal's teacher_top_k)
# The output layer's share of the work a site's cost replays (on average half the blocks) that `kl_every` allows:
# a 262,144-token vocabulary at width 640 over 18 blocks (the stand-in, bench/convert_stages.csv) reads every 4th
# position; SmolLM2 (0.27 of its blocks) and Qwen2.5-0.5B (0.38) read every one.
HEAD_SHARE = 0.5


def kl_every(model: nn.Module) -> int:
    """Which positions the budget walk's KL reads by default, from the model's shape: every n-th, the smallest n
    with the output layer's multiply-adds per position over n at most `HEAD_SHARE` of the blocks' (parameters stand
    for multiply-adds per token), so the walk's cost does not grow with the vocabulary. 1 where the model names no
    output layer.

    Args:
        model: The original model.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    inp = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if head is None or getattr(head, "weight", None) is None:
        return 1
    seen = {id(p) for m in (head, inp) if m is not None for p in m.parameters()}
    body = sum(p.numel() for p in model.parameters() if id(p) not in seen)
    return max(1, math.ceil(head.weight.numel() / (HEAD_SHARE * max(body, 1)) - 1e-9))


def _logits(out, lm: bool | None):
    """The final output tensor, and whether it holds next-token logits (auto: a ModelOutput with .logits)."""
    for attr in ("logits", "last_hidden_state"):
        if hasattr(out, attr):
            return getattr(out, attr), attr == "logits" if lm is None else lm
    if isinstance(out, (tuple, list)):
        out = out[0]
    return out, bool(lm)


@torch.no_grad()
def fidelity(
    original: nn.Module,
    converted: nn.Module,
    inputs: torch.Tensor | dict | Iterable,
    record: ConversionRecord | None = None,
    *,
    lm: bool | None = None,
    tally: TokenTally | None = None,
) -> ConversionResult:
    """How close ``converted`` is to ``original`` on held-out ``inputs``.

    Args:
        original: the model before conversion.
        converted: the converted model (same architecture, same inputs).
        inputs: held-out batches, as ``convert_norms``' ``calibrate`` takes them (token ids for a language model).
        record: the conversion's record; with it, each converted site's own error is measured too.
        lm: True says that a plain tensor or tuple output (its first element) holds logits; by default only a
            ``.logits`` attribute does.
        tally: A `normlab.conversion.measure.judge.TokenTally` that every sequence of token ids is added to, from
            the same logits: the judgement's statistics of these inputs, without a second pass of both models.

    Returns:
        A dict: per site, the relative error of the norm's output ||y_conv - y_orig|| / ||y_orig|| (both models fed
        the same inputs) and its mean (``mean_site_error``); the mean per-token cosine of the final outputs
        (``output_cosine``); for language models the mean KL(original || converted) of the output distributions
        (``kl``) and, when the inputs are token ids and the model predicts the next token (`predicts_next_token`:
        not a masked LM), both models' next-token cross-entropy (``ce_original``, ``ce_converted``, nats/token).
    """
    sites = [s.name for s in record.sites] if record else []
    # each site's error summed batch by batch: the original's output of the batch waits for the converted's, so
    # one batch's outputs are held at a time, not every batch's (1.4 GB for a 0.5B model's 49 sites at 4,096 tokens)
    held: dict[str, torch.Tensor] = {}
    sq = {n: [0.0, 0.0] for n in sites}  # sum of (y_conv - y_orig)^2, sum of y_orig^2

    def keep(mod, args, y, n):
        held[n] = y.detach().float()

    def compare(mod, args, y, n):
        ya = held.pop(n)
        sq[n][0] += float((y.detach().float() - ya).pow(2).sum())
        sq[n][1] += float(ya.pow(2).sum())

    handles = []
    for model, hook in ((original, keep), (converted, compare)):
        for n in sites:
            handles.append(model.get_submodule(n).register_forward_hook(lambda m, a, y, n=n, f=hook: f(m, a, y, n)))
    cos, kl, n_tok = 0.0, 0.0, 0
    next_token = predicts_next_token(original)
    ce, n_ce = [0.0, 0.0], 0
    has_logits = False
    modes = (original.training, converted.training)
    original.eval()
    converted.eval()
    try:  # a batch a few rows at a time where a large vocabulary's logits would not fit (`logit_rows`)
        parts = ((i, p) for i, w in enumerate(as_batches(inputs)) for p in row_chunks(w, logit_rows(original, w)))
        for i, batch in parts:
            a, is_lm = _logits(run_batch(original, batch, i, stage="held-out"), lm)
            b, _ = _logits(run_batch(converted, batch, i, stage="held-out"), lm)
            ids = _token_ids(batch) if next_token else None
            if tally is not None and is_lm and ids is not None and ids.shape == a.shape[:-1] and ids.dim() == 2:
                for row in range(len(ids)):
                    tally.add(a[row], b[row], ids[row])
            a, b = a.float().reshape(-1, a.shape[-1]), b.float().reshape(-1, b.shape[-1])
            cos += _cos_sum(a, b)
            if is_lm:
                has_logits = True
                kl += _kl_sum(a, b)
                if ids is not None and ids.shape[-1] > 1 and ids.numel() == a.shape[0]:  # next-token cross-entropy
                    for j, logits in enumerate((a, b)):
                        total, n = _ce_sum(logits, ids)
                        ce[j] += total
                    n_ce += n
            n_tok += a.shape[0]
    finally:
        for h in handles:
            h.remove()
        held.clear()
        original.train(modes[0])
        converted.train(modes[1])
    if n_tok == 0:
        raise ValueError("fidelity: the held-out inputs are empty")
    per_site = {n: math.sqrt(d) / max(math.sqrt(o), 1e-30) for n, (d, o) in sq.items()}
    mean = sum(per_site.values()) / len(per_site) if per_site else math.nan
    result = ConversionResult(output_cosine=cos / n_tok, sites=per_site, mean_site_error=mean)
    if has_logits:
        result["kl"] = kl / n_tok
    if n_ce:
        result["ce_original"], result["ce_converted"] = ce[0] / n_ce, ce[1] / n_ce
    return result


def predicts_next_token(model: nn.Module) -> bool:
    """Whether ``model``'s logits at position t predict token t + 1: a Hugging Face model that can generate (a
    causal LM), or any module that is not a Hugging Face model (the caller says, with ``lm=``). A masked LM's
    logits predict the token at their own position, so a next-token cross-entropy means nothing for it.

    Args:
        model: The model.
    """
    can_generate = getattr(model, "can_generate", None)
    return not (hasattr(model, "config") and callable(can_generate)) or bool(can_generate())


ROWS = 256  # logits rows per chunk of the KL and cross-entropy sums: 152k-word vocabularies stay at 0.16 GB a chunk


def _cos_sum(a: torch.Tensor, b: torch.Tensor) -> float:
    """The summed cosine similarity of rows of outputs (N, C), ``ROWS`` rows at a time."""
    cos = torch.nn.functional.cosine_similarity
    return sum(float(cos(a[i : i + ROWS], b[i : i + ROWS], dim=-1).sum()) for i in range(0, len(a), ROWS))


def _kl_sum(a: torch.Tensor, b: torch.Tensor) -> float:
    """The summed KL(softmax(a) || softmax(b)) over rows of logits (N, V), ``ROWS`` rows at a time."""
    total = 0.0
    for i in range(0, len(a), ROWS):
        la, lb = a[i : i + ROWS].log_softmax(-1), b[i : i + ROWS].log_softmax(-1)
        total += float(torch.nn.functional.kl_div(lb, la, log_target=True, reduction="sum"))
    return total


def _ce_sum(logits: torch.Tensor, ids: torch.Tensor) -> tuple[float, int]:
    """The summed next-token cross-entropy of logits (..., T, V) or (N, V) on token ids (..., T), and its count."""
    ids = ids.reshape(-1, ids.shape[-1])
    logits = logits.float().reshape(*ids.shape, -1)[:, :-1]
    nxt = ids[:, 1:].to(logits.device)
    per = max(1, ROWS // nxt.shape[1])  # sequences per chunk
    total = 0.0
    for i in range(0, len(nxt), per):
        rows, want = logits[i : i + per].reshape(-1, logits.shape[-1]), nxt[i : i + per].reshape(-1)
        total += float(torch.nn.functional.cross_entropy(rows, want, reduction="sum"))
    return total, nxt.numel()


@torch.no_grad()
def cross_entropy(model: nn.Module, batches: Iterable[torch.Tensor]) -> float:
    """The mean next-token cross-entropy (nats/token) of a language model (outputs with ``.logits``) on batches of
    token ids; the same number `fidelity` reports as ``ce_converted``.

    Args:
        model: A language model whose outputs have ``.logits``.
        batches: Batches of token ids, each (B, T).
    """
    total, count = 0.0, 0
    was = model.training
    model.eval()
    try:
        for i, batch in enumerate(as_batches(batches)):
            out = run_batch(model, batch, i, no_cache=True, stage="held-out")
            ids = _token_ids(batch)
            if ids is None or not hasattr(out, "logits"):
                raise ValueError("cross_entropy needs batches of token ids and a model whose output has .logits")
            t, n = _ce_sum(out.logits, ids)
            total, count = total + t, count + n
    finally:
        model.train(was)
    if count == 0:
        raise ValueError("cross_entropy: no next-token targets (empty batches, or sequences of one token)")
    return total / count


class ReferenceKL:
    """The mean next-token KL(reference || model) on fixed batches, in nats per position: the first call records the
    model's ``k`` largest log-probabilities at every position of every batch as the reference and reads 0; each later
    call measures the model on the same batches against it. The budget walk's measure with ``budget.metric = "kl"``
    (a `normlab.conversion.calibrate.stream.BlockReplay` measure), what a quantizer judges by.

    The KL is `normlab.conversion.measure.judge.top_k_kl`'s: the rest of the vocabulary is one outcome, so it is at
    most the full KL, and equal to it when ``k`` covers the vocabulary. Positions an attention mask leaves out do not
    count. Memory: 8 bytes x ``k`` per position (32 sequences of 128 tokens at 1,024: 34 MB).

    ``every=n`` measures every n-th position of a sequence (0, n, 2n, ...) and runs the model's output layer on those
    alone (a pre-hook on ``get_output_embeddings()``): the blocks still run on every position, so each measured
    position sees its whole context, and the mean is over a fixed subset. With a vocabulary of 49,152 and 576
    channels the output layer is about a third of a pass; the budget walk ranks its sites this way
    (``budget.rank_every``).

    Args:
        k: How many of the reference's largest log-probabilities are kept per position.
        every: Measure every ``every``-th position (1: all).
    """

    def __init__(self, k: int = REFERENCE_TOP_K, every: int = 1) -> None:
        for name, v in (("k", k), ("every", every)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"ReferenceKL: {name} must be an int >= 1, got {v!r}")
        self.k, self.every = k, every
        self.reference: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    @torch.no_grad()
    def __call__(self, model: nn.Module, batches: Iterable) -> float:
        from normlab.conversion.measure.judge import top_k_kl

        batches = list(as_batches(batches))
        first = self.reference is None
        if not first and len(batches) != len(self.reference):
            raise ValueError(f"ReferenceKL: {len(batches)} batches against a reference of {len(self.reference)}")
        kept, total, count = [], 0.0, 0
        was = model.training
        model.eval()
        head = self._thinning(model)
        try:
            for i, batch in enumerate(batches):
                out = run_batch(model, batch, i, no_cache=True, stage="held-out")
                if not hasattr(out, "logits"):
                    raise ValueError("ReferenceKL needs a model whose output has .logits")
                mask = batch.get("attention_mask") if isinstance(batch, dict) else None
                if mask is not None and head is not None:
                    mask = mask[:, :: self.every]
                rows = out.logits[mask.bool()] if mask is not None else out.logits.flatten(0, -2)  # (positions, V)
                # a part of the positions at a time: Qwen2.5-0.5B's 152k vocabulary held 0.6 GB of log-probabilities
                # per batch beside its logits
                step = max(1, LOGITS_PART_BYTES // (4 * rows.shape[-1]))
                if first:
                    parts = [rows[lo : lo + step].float().log_softmax(-1) for lo in range(0, len(rows), step)]
                    top = [p.topk(min(self.k, p.shape[-1]), dim=-1) for p in parts]
                    kept.append((torch.cat([t.values for t in top]), torch.cat([t.indices for t in top]).int()))
                    continue
                values, index = self.reference[i]
                if values.shape[0] != rows.shape[0]:
                    raise ValueError(
                        f"ReferenceKL: batch {i} has {rows.shape[0]} positions, the reference has {values.shape[0]}: "
                        "measure the batches the reference was recorded on"
                    )
                for lo in range(0, len(rows), step):
                    logp = rows[lo : lo + step].float().log_softmax(-1)
                    total += float(top_k_kl(logp, values[lo : lo + step], index[lo : lo + step].long())) * len(logp)
                count += len(rows)
        finally:
            model.train(was)
            if head is not None:
                head.remove()
        if first:
            self.reference = kept
            return 0.0
        return total / max(count, 1)

    def _thinning(self, model: nn.Module):
        """With ``every`` > 1, a pre-hook that gives the output layer every ``every``-th position of its input (the
        hook's handle); None where every position is measured or the model names no output layer."""
        out = model.get_output_embeddings() if self.every > 1 and hasattr(model, "get_output_embeddings") else None
        if out is None:
            return None
        return out.register_forward_pre_hook(lambda mod, args: (args[0][:, :: self.every], *args[1:]))


def _token_ids(batch) -> torch.Tensor | None:
    ids = batch.get("input_ids") if isinstance(batch, dict) else batch
    return ids if isinstance(ids, torch.Tensor) and not ids.is_floating_point() else None
