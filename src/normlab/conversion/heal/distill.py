"""Healing a converted model on a CPU budget, from a stream of text, with a held-out curve.

    splits = normlab.conversion.data.texts.text_splits("text.txt", tokenizer, vocab)     # calib / held / val / stream
    record = normlab.convert_norms(model, "dyisru", calibrate=splits.calib)
    report = normlab.heal(original, model, splits, record, HealConfig(minutes=20))

Data. The heal trains on a `normlab.conversion.data.texts.TokenStream`: fresh sequences of the text, in a random
order, none repeated before all have been used, and never the held-out part nor the validation split. (A list
of token batches is accepted too and becomes such a stream: the old heal on the calibration batches, which
memorized them; keep it for tests and tiny texts.)

The objective: end to end, KL(original || converted) of the next-token distributions on each fresh batch; with
``teacher_top_k=k``, the KL over the original's top k and the rest, its side computed once per sequence and cached
(`normlab.conversion.heal.teacher`: it pays when the stream is passed more than once, as the samples are). (A
block-wise reconstruction objective was retired in 0.10.0: at equal minutes it ended 1.3-1.4 nats behind.)

The settings are a `normlab.conversion.config.HealConfig` (``cfg``); the keywords of the call before it
(``minutes=20``) still work. What is trained (``train``): ``"norms"`` (the replacements' parameters), ``"lora"``
(the norms, plus low-rank adapters on every linear layer of the blocks, merged into the weights when the heal ends:
`normlab.conversion.heal.lora`), or ``"all"`` (every weight of the model).

The curve and the best state. Given ``val`` batches, the heal measures their cross-entropy (and KL to the
original) at the start, every ``eval_every`` trained tokens, and at the end; it shows the last one on the progress
bar, records every point in ``report.curve`` and leaves the model in the state with the lowest validation
cross-entropy it saw, the start included: a heal never ends worse on its validation split than it began.

Budget: ``minutes`` (wall time) or ``tokens`` (tokens through a trained forward/backward). The rate is constant;
or (``schedule="cosine"``) warmed up over the first 5% of the budget and lowered to a tenth by its end;
or (``schedule="cooldown"``) constant, then lowered in a straight line to 0 over the last 20%; always as
a function of the budget spent (`normlab.conversion.heal.loop.lr_factor`); each curve point records the rate
(``lr``). ``checkpoint`` saves the heal (atomically) after each evaluation; ``resume`` continues from it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from normlab.conversion.batches import (
    as_batches,
    autocast_dtype,
    input_ids,
    log_probs,
    logit_rows,
    row_chunks,
    run_batch,
)
from normlab.conversion.calibrate.stream import block_index, find_blocks
from normlab.conversion.config import HealConfig, drop_retired, flag
from normlab.conversion.data.streams import MixedStream
from normlab.conversion.data.texts import TextSplits, TokenStream
from normlab.conversion.heal.loop import (
    Budget,
    HealReport,
    HealRun,
    Validation,
    frozen,
    is_ours,
    load_checkpoint,
    lr_factor,
    mean_finite,
    postfix,
    set_lr,
    trainable,
)
from normlab.conversion.heal.lora import add_lora, merge_lora
from normlab.conversion.heal.teacher import TeacherCache
from normlab.errors import check_memory
from normlab.record import ConversionRecord

__all__ = [
    "heal",
    "check_heal_resources",
    "HealReport",
    "distill",
    "distill_loss",
]

_RUN_OPTIONS = ("val", "progress")  # the call's own keywords besides HealConfig's fields


def _block_list(model: nn.Module, sites: list[str]) -> str:
    """The name of the ``nn.ModuleList`` of blocks holding the converted ``sites`` (`find_blocks`, one block enough)."""
    found = find_blocks(model, sites, least=1)
    if found is None:
        raise ValueError(
            "heal: found no nn.ModuleList of blocks holding the converted norms; the heal keeps the blocks before "
            "the first converted site frozen and needs a model built as a list of blocks (as every Hugging Face "
            "transformer is)"
        )
    return found[0]


def _stream_of(data, seed: int = 0) -> TokenStream | MixedStream:
    if isinstance(data, (TokenStream, MixedStream)):
        return data
    rows = []
    for i, b in enumerate(as_batches(data)):
        ids = input_ids(b)
        if not (isinstance(ids, torch.Tensor) and not ids.is_floating_point() and ids.dim() == 2):
            raise ValueError(
                f"heal: batch {i} is not a (batch, seq_len) tensor of token ids; the heal draws token "
                "sequences (give a TokenStream, or a list of id tensors)"
            )
        rows.append(ids)
    if not rows:
        raise ValueError("heal: no training data")
    if len({r.shape[1] for r in rows}) > 1:
        raise ValueError("heal: the training batches have different sequence lengths")
    return TokenStream(torch.cat(rows), seed)


def _settings(cfg: HealConfig | None, options: dict) -> tuple[HealConfig, dict]:
    """The HealConfig (``cfg``, with any of its fields given as keywords on top), and the run's own options."""
    names = {f.name for f in dataclasses.fields(HealConfig)}
    kept = drop_retired({f"heal.{k}": v for k, v in options.items()}, "heal({name}=...)")  # a retired one at its
    options = {k: v for k, v in options.items() if f"heal.{k}" in kept}  # one remaining value: dropped
    unknown = sorted(set(options) - names - set(_RUN_OPTIONS))
    if unknown:
        raise TypeError(f"heal() got an unexpected keyword {unknown[0]!r}; valid: {', '.join([*_RUN_OPTIONS, *names])}")
    cfg = dataclasses.replace(cfg or HealConfig(), **{k: v for k, v in options.items() if k in names})
    if (cfg.minutes is None) == (cfg.tokens is None):
        raise ValueError("heal: give exactly one budget, minutes= or tokens=")
    if cfg.resume and cfg.checkpoint is None:
        raise ValueError("heal: resume=True needs checkpoint=PATH")
    for name in ("minutes", "tokens"):  # a budget of the wrong kind is named as the API spells it
        v = getattr(cfg, name)
        if v is not None and (
            isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or not math.isfinite(v)
        ):
            raise ValueError(f"heal: the budget must be a number > 0, got {v!r}")
    cfg.validate()
    return cfg, {k: options[k] for k in _RUN_OPTIONS if k in options}


def check_heal_resources(cfg: HealConfig, model: nn.Module, seq_len: int, vocab: int) -> None:
    """Refuse, before any work, a heal this machine cannot hold or a LoRA rank the layers cannot take: the memory
    of the student's weights, gradients and Adam moments, the teacher's weights, and a step's activations and
    logits (teacher and student) for ``cfg.batch_size`` x ``seq_len`` tokens, estimated as ``train`` does; and a
    ``lora_rank`` above the smallest dimension of the linear layers it adapts.

    Args:
        cfg: The heal's config section.
        model: The converted model to be healed.
        seq_len: Tokens per training sequence.
        vocab: The vocabulary size (the logits' width).
    """
    n = sum(p.numel() for p in model.parameters())
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if cfg.train == "lora" and linears:
        least = min(min(m.in_features, m.out_features) for m in linears)
        if cfg.lora_rank > least:
            raise ValueError(
                f"{flag('heal.lora_rank')} = {cfg.lora_rank} is above the smallest dimension of the linear layers "
                f"it adapts ({least}): a rank-{least} update already spans them; use heal.lora_rank <= {least}"
            )
    width = max((m.in_features for m in linears), default=1)
    layers = max(len(linears) // 7, 1)  # about 7 linear layers a block (q, k, v, o, gate, up, down)
    tokens = cfg.batch_size * seq_len
    check_memory(
        20 * n + 4 * tokens * (4 * vocab + 24 * width * layers),
        f"healing {n / 1e6:.0f}M parameters at heal.batch_size={cfg.batch_size} x seq_len={seq_len}",
        "use a smaller heal.batch_size or seq_len",
    )


def heal(
    original: nn.Module,
    converted: nn.Module,
    data: TextSplits | TokenStream | Iterable,
    record: ConversionRecord | None = None,
    cfg: HealConfig | None = None,
    *,
    identity: dict | None = None,
    **options: object,
) -> HealReport:
    """Train ``converted`` toward ``original`` on ``data`` within the budget of ``cfg``.

    Args:
        original: the model before conversion (the teacher; frozen).
        converted: the converted model, updated in place (LoRA, if trained, is merged back).
        data: a `normlab.conversion.data.texts.TextSplits` (its stream, and its validation split for the curve and the
            best state), a `normlab.conversion.data.texts.TokenStream`, or token batches.
        record: the conversion's record (`convert_norms`), which names the converted sites; without it every
            normlab module counts.
        cfg: a `normlab.conversion.config.HealConfig` (default: its defaults); its fields say the objective, what
            trains, the budget in minutes or tokens, the rate and its schedule, the checkpoint.
        identity: what the heal was made from, stored in the checkpoint; a resume from another is refused.
        **options: ``val=`` (validation batches, when ``data`` is not a TextSplits), ``progress=`` (a bar: True,
            False, or None for a terminal only), and any HealConfig field (``minutes=20``), applied over ``cfg``.

    Returns:
        A `HealReport`: tokens, seconds, the validation curve, the best point kept, rollbacks, the teacher cache's
        use.
    """
    cfg, run_options = _settings(cfg, options)
    if cfg.train == "all":  # it writes every weight in place: the ones the original shares become the model's own
        _own_weights(converted, original)
    val = run_options.get("val")
    if isinstance(data, TextSplits):
        data, val = data.stream, data.val if val is None else val
    stream = _stream_of(data)
    logits = original.get_output_embeddings() if hasattr(original, "get_output_embeddings") else None
    vocab = logits.out_features if isinstance(logits, nn.Linear) else 0
    check_heal_resources(cfg, converted, stream.seq_len, vocab)
    cfg, precision = _precision(cfg, converted)
    sites = (
        [s.name for s in record.sites]
        if record is not None
        else [n for n, m in converted.named_modules() if is_ours(m)]
    )
    list_name = _block_list(converted, sites)
    if cfg.eval_every is None:
        cfg = dataclasses.replace(cfg, eval_every=8 * cfg.batch_size * stream.seq_len)  # a val pass ~ one step
    _check_logits(original, stream)
    ckpt = Path(cfg.checkpoint) if cfg.checkpoint is not None else None
    rank = cfg.lora_rank if cfg.train == "lora" else None
    report = HealReport(train=cfg.train, lora_rank=rank, precision=precision)
    blocks = converted.get_submodule(list_name)
    start = first_converted_block(list_name, len(blocks), sites) if cfg.early_blocks == "frozen" else 0
    with frozen(original, converted):
        if cfg.train == "lora":
            add_lora(nn.ModuleList(list(blocks)[start:]), cfg.lora_rank)
        try:
            state = None
            if cfg.resume and ckpt is not None and ckpt.exists():
                state = load_checkpoint(ckpt, converted, identity)
                stream.load_state(state["stream"])
                report = HealReport.from_dict(
                    {**state["report"], "resumed_from": state["report"]["tokens"], "precision": precision}
                )
            params = _trained(converted, list(blocks)[:start], cfg.train)
            check = Validation(original, converted, val, params)
            if state is not None and state.get("best") is not None:
                check.best_ce, check.best_point = state["best"]["val_ce"], state["best"]
                check.best_state = state["best_state"]
            run = HealRun(
                original=original,
                converted=converted,
                stream=stream,
                params=params,
                cfg=cfg,
                check=check,
                budget=Budget(cfg, report),
                report=report,
                list_name=list_name,
                ckpt=ckpt,
                state=state,
                identity=identity,
                progress=run_options.get("progress"),
            )
            distill(run)
            check.restore()
            report.best = check.best_point
        finally:
            if cfg.train == "lora":
                merge_lora(converted)
    report.sequences, report.frozen_blocks = stream.drawn, start  # a resumed report's too (pre-0.4.4: none)
    report.stream_passes = stream.drawn / len(stream)
    report.seconds = run.budget.seconds()
    return report


def _precision(cfg: HealConfig, converted: nn.Module) -> tuple[HealConfig, str]:
    """``heal.precision`` resolved before any step, and why: "auto" by the device, "bf16" refused where it cannot
    run (`normlab.conversion.batches.autocast_dtype`, the one resolver of a precision)."""
    if cfg.precision == "float32":
        return cfg, "float32 (heal.precision=float32)"
    dtype, why = autocast_dtype(cfg.precision, converted, "heal.precision")
    return dataclasses.replace(cfg, precision="bf16" if dtype is not None else "float32"), why


def _trained(scope: nn.Module, early: list[nn.Module], train: str) -> list[nn.Parameter]:
    """What the heal trains inside ``scope`` (`trainable`), less the parameters of the ``early`` blocks."""
    left = {id(p) for b in early for p in b.parameters()}
    return [p for p in trainable(scope, train) if id(p) not in left]


def first_converted_block(list_name: str, n_blocks: int, sites: list[str]) -> int:
    """The index of the first block of ``list_name`` that holds one of ``sites``; the last block when none does (a
    final norm alone converted).

    Args:
        list_name: The blocks' ``nn.ModuleList``, by name.
        n_blocks: How many blocks it holds.
        sites: The converted sites' names.
    """
    held = [b for b in (block_index(list_name, s) for s in sites) if b is not None]
    return min(held, default=n_blocks - 1)


def _own_weights(converted: nn.Module, original: nn.Module) -> None:
    """Give ``converted`` its own copy of every parameter it shares with ``original`` (a
    `normlab.conversion.batches.sharing_copy`), so that training it leaves the original as it was."""
    theirs = {id(p) for p in original.parameters()}
    own: dict[int, nn.Parameter] = {}  # one copy of a tied weight, so it stays tied
    for m in converted.modules():
        for name, p in list(m.named_parameters(recurse=False)):
            if id(p) in theirs:
                if id(p) not in own:
                    own[id(p)] = nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
                setattr(m, name, own[id(p)])


def _check_logits(original: nn.Module, stream) -> None:
    """Refuse, before any training, a model that gives no logits: there is nothing to distill."""
    with torch.no_grad():
        out = run_batch(original, stream.chunks[:1], no_cache=True, stage="heal stream")
    if not hasattr(out, "logits"):
        raise ValueError(
            f"heal: {type(original).__name__} gives no logits, so there is nothing to distill and no "
            "validation cross-entropy: the heal distills the original's next-token distribution"
        )


def distill_loss(original: nn.Module, converted: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """KL(original || converted) of the next-token distributions on ``ids`` (B, T), averaged over tokens: the
    distill objective with the live teacher.

    Args:
        original: The unconverted model, the teacher.
        converted: The student.
        ids: Token ids, (B, T).
    """
    with torch.no_grad():
        target = log_probs(original, ids, stage="heal (the original, as teacher)")
    logp = log_probs(converted, ids, stage="heal")
    return nn.functional.kl_div(logp.flatten(0, -2), target.flatten(0, -2), log_target=True, reduction="batchmean")


def distill(run: HealRun) -> None:
    """End to end: KL(original || converted) on fresh batches; a curve point every ``eval_every`` tokens.

    Args:
        run: The heal's state: the models, the data, the optimizer, the budget and the curve.
    """
    from tqdm.auto import tqdm

    cfg, report, check, budget = run.cfg, run.report, run.check, run.budget
    opt = run.optimizer()
    if run.state is not None and run.state.get("optimizer") is not None:
        opt.load_state_dict(run.state["optimizer"])
    if not report.curve:
        run.point(math.nan)
        run.save(opt)  # from the first moment on, a killed heal can be resumed
    for p in run.params:
        p.requires_grad_(True)
    bar = tqdm(
        total=100,
        desc=f"healing (distill, {report.train})",
        unit="%",
        bar_format="{l_bar}{bar}| {postfix}",
        disable=run.bar_disabled,
    )
    bar.set_postfix_str(postfix(report.curve[-1]))
    losses, norms, next_eval = [], [], report.tokens + cfg.eval_every  # norms: each step's gradient norm, unclipped
    lr = set_lr(opt, lr_factor(cfg.schedule, budget.used()))
    teacher = TeacherCache(run.original, cfg.teacher_top_k) if cfg.teacher_top_k is not None else None
    device = next(run.converted.parameters()).device.type
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=cfg.precision == "bf16")
    counted = report.teacher_computed, report.teacher_reused  # from before a resume (the cache itself is not saved)
    try:
        while budget.used() < 1.0:
            ids = run.stream.next(cfg.batch_size)
            opt.zero_grad(set_to_none=True)
            loss = _accumulated(run, teacher, ids, autocast)
            if teacher is not None:
                report.teacher_computed, report.teacher_reused = (
                    counted[0] + teacher.computed,
                    counted[1] + teacher.reused,
                )
            if not math.isfinite(loss):
                check.restore()  # back to the best state; a fresh optimizer; carry on
                opt = run.optimizer()
                losses.append(math.nan)
                continue
            norms.append(float(nn.utils.clip_grad_norm_(run.params, cfg.grad_clip or math.inf)))  # the norm before
            lr = set_lr(opt, lr_factor(cfg.schedule, budget.used()))
            opt.step()
            losses.append(loss)
            report.tokens += ids.numel()
            bar.n = min(100, int(100 * budget.used()))
            if report.tokens >= next_eval or budget.used() >= 1.0:
                point = run.point(mean_finite(losses), lr=lr, grad_norm=max(norms, default=math.nan))
                losses, norms, next_eval = [], [], report.tokens + cfg.eval_every
                bar.set_postfix_str(postfix(point))
                if run.rolled_back(point):  # a spike: back to the best state, on at half the rate
                    opt = run.optimizer()
                    lr = set_lr(opt, lr_factor(cfg.schedule, budget.used()))
                    bar.write(
                        f"heal: validation CE {point['val_ce']:.3f} is more than {cfg.rollback_nats:g} nats above "
                        f"the best ({check.best_ce:.3f}): back to that state, rate halved to {lr:.3g}"
                    )
                run.save(opt)
        if losses:
            run.point(mean_finite(losses), lr=lr, grad_norm=max(norms, default=math.nan))
            run.save(opt)
    finally:
        bar.close()
        for p in run.params:
            p.requires_grad_(False)


def _accumulated(run: HealRun, teacher: TeacherCache | None, ids: torch.Tensor, autocast) -> float:
    """The distill loss of one step on ``ids`` (B, T), its gradient accumulated a few rows at a time
    (`normlab.conversion.batches.logit_rows`): the whole batch's gradient, with a large vocabulary's logits and their
    gradients held for one part at a time (a 152k vocabulary: 0.3 GB per tensor at 4 x 128 tokens). NaN where a
    part's loss is not finite (the gradients are then left to the caller's restore)."""
    total = 0.0
    for part in row_chunks(ids, logit_rows(run.original, ids)):
        with autocast:
            loss = (
                distill_loss(run.original, run.converted, part)
                if teacher is None
                else teacher.loss(run.converted, part)
            )
        if not torch.isfinite(loss):
            return math.nan
        (loss * (len(part) / len(ids))).backward()
        total += float(loss.detach()) * len(part) / len(ids)
    return total
