"""Healing a converted model on a CPU budget, from a stream of text, with a held-out curve.

    splits = normlab.conversion.hf.text_splits("text.txt", tokenizer, vocab)     # calib / held / val / stream
    record = normlab.convert_norms(model, "dyisru", calibrate=splits.calib)
    report = normlab.heal(original, model, splits.stream, record, val=splits.val, minutes=20)

Data. The heal trains on a :class:`~normlab.conversion.hf.TokenStream`: fresh sequences of the text, in a random
order, none repeated before all have been used, and never the held-out part nor the validation split. (A list
of token batches is accepted too and becomes such a stream: the old heal on the calibration batches, which
memorized them; keep it for tests and tiny texts.)

Objectives (``objective=``):

* ``"distill"``: end to end, KL(original || converted) of the next-token distributions on each fresh batch.
* ``"blocks"``: block-wise reconstruction. The blocks are trained one at a time, in order, each to reproduce the
  original block's output (per-token relative squared error of the residual stream) from its input in the
  converted model, so that it also undoes the drift it inherits. A pool of fresh sequences, sized to the budget,
  is carried through the blocks: each block trains on its own depth's view of the pool.

What is trained (``train=``): ``"norms"`` (the replacements' parameters), ``"lora"`` (the norms, plus low-rank
adapters on every linear layer of the blocks, merged into the weights when the heal ends:
:mod:`normlab.conversion.lora`), or ``"all"`` (every weight of the blocks; with ``distill``, every weight of the model).

The curve and the best state. Given ``val`` batches, the heal measures their cross-entropy (and KL to the
original) at the start, every ``eval_every`` trained tokens (distill) or after each block (blocks), and at the
end; it shows the last one on the progress bar, records every point in ``report.curve`` and leaves the model in
the state with the lowest validation cross-entropy it saw, the start included: a heal never ends worse on its
validation split than it began.

Budget: ``minutes`` (wall time) or ``tokens`` (tokens through a trained forward/backward). ``checkpoint=``
saves the heal (atomically) after each block or evaluation; ``resume=True`` continues from it.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from normlab.conversion.batches import Stop, as_batches, input_ids, run_batch
from normlab.conversion.hf import TokenStream
from normlab.conversion.lora import LORA_RANK, LoRALinear, add_lora, merge_lora

__all__ = ["heal", "HealReport", "find_blocks", "OBJECTIVES", "TRAINS", "DEFAULT_OBJECTIVE", "DEFAULT_TRAIN"]

OBJECTIVES = ("distill", "blocks")
TRAINS = ("norms", "lora", "all")
LEARNING_RATES = {"norms": 1e-3, "lora": 1e-3, "all": 2e-5}  # Adam; the norms' rate also applies under "lora"
DEFAULT_OBJECTIVE, DEFAULT_TRAIN = "distill", "norms"  # chosen by scripts/heal_study.py at equal minutes (README)


@dataclass
class HealReport:
    objective: str = "distill"
    train: str = "norms"
    blocks: list[dict] = field(default_factory=list)  # per block (objective "blocks"): loss before / after, steps
    curve: list[dict] = field(default_factory=list)  # tokens, seconds, train_loss, val_ce, val_kl
    best: dict | None = None  # the curve point whose state was kept
    tokens: int = 0
    sequences: int = 0  # distinct stream sequences drawn
    stream_passes: float = 0.0  # sequences drawn / stream length
    seconds: float = 0.0
    resumed_from: int = 0
    lora_rank: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------
def find_blocks(model: nn.Module, site_names: Iterable[str]) -> str:
    """The name of the ``nn.ModuleList`` holding the transformer blocks: the one that holds the most sites."""
    sites = list(site_names)
    best, count = None, 0
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) > 0:
            n = sum(any(s.startswith(f"{name}.{i}.") for i in range(len(m))) for s in sites)
            if n > count:
                best, count = name, n
    if best is None:
        raise ValueError("heal: found no nn.ModuleList of blocks holding the converted norms; block-wise healing "
                         "needs a model built as a list of blocks (as every Hugging Face transformer is)")  # fmt: skip
    return best


def _hidden(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _is_ours(m: nn.Module) -> bool:
    return type(m).__module__.startswith("normlab.") and not isinstance(m, LoRALinear)


def _norm_params(module: nn.Module) -> list[nn.Parameter]:
    return [p for m in module.modules() if _is_ours(m) for p in m.parameters(recurse=False)]


def _trainable(module: nn.Module, train: str) -> list[nn.Parameter]:
    if train == "all":
        return list(module.parameters())
    params = _norm_params(module)
    if train == "lora":
        params += [p for m in module.modules() if isinstance(m, LoRALinear) for p in (m.lora_a, m.lora_b)]
    return params


def _rel_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y).pow(2).sum(-1) / y.pow(2).sum(-1).clamp_min(1e-30)).mean()


def _save(path: Path, state: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


@contextlib.contextmanager
def _frozen(original: nn.Module, converted: nn.Module):
    """Both models in eval mode and every parameter of ``converted`` frozen (the trainer unfreezes what it trains);
    modes and flags are restored on the way out."""
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


def _check_budget(minutes, tokens, train: str, objective: str, resume: bool, checkpoint) -> None:
    """heal's options, checked before any work."""
    if (minutes is None) == (tokens is None):
        raise ValueError("heal: give exactly one budget, minutes= or tokens=")
    budget = minutes if minutes is not None else tokens
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget > 0 or not math.isfinite(budget):
        raise ValueError(f"heal: the budget must be a number > 0, got {budget!r}")
    if train not in TRAINS:
        raise ValueError(f"heal: train must be one of {', '.join(TRAINS)}, got {train!r}")
    if objective not in OBJECTIVES:
        raise ValueError(f"heal: objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
    if resume and checkpoint is None:
        raise ValueError("heal: resume=True needs checkpoint=PATH")


def _identity_difference(saved: dict | None, now: dict, keys=None) -> str | None:
    """What differs between a checkpoint's identity and this heal's (over ``keys``, default all), named; None
    when they match."""
    if saved is None:
        return "it records no identity (written by an older normlab)"
    keys = sorted(set(saved) | set(now)) if keys is None else sorted(keys)
    diffs = [f"{k}: checkpoint {saved.get(k)!r} vs now {now.get(k)!r}" for k in keys if saved.get(k) != now.get(k)]
    return "; ".join(diffs) or None


def _load_checkpoint(ckpt: Path, converted: nn.Module, identity: dict | None, objective: str) -> dict:
    try:
        state = torch.load(ckpt, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001  (any unpickling error means the file is unusable)
        raise ValueError(f"heal: checkpoint {ckpt} is corrupt or not a heal checkpoint ({type(e).__name__}); "
                         "delete it or start without resume") from None  # fmt: skip
    if not isinstance(state, dict) or not {"model", "report", "stream", "objective"} <= set(state):
        raise ValueError(f"heal: {ckpt} is not a heal checkpoint of this normlab; delete it or start without resume")
    if identity is not None:
        diff = _identity_difference(state.get("identity"), identity)
        if diff:
            raise ValueError(f"heal: checkpoint {ckpt} was made from another model, text or settings ({diff}); "
                             "resume with the same ones, or start afresh with another --checkpoint")  # fmt: skip
    if state["objective"] != objective:
        raise ValueError(f"heal: checkpoint {ckpt} is of a heal with objective {state['objective']!r}, not "
                         f"{objective!r}")  # fmt: skip
    try:
        converted.load_state_dict(state["model"])
    except RuntimeError as e:
        raise ValueError(f"heal: checkpoint {ckpt} is not of this converted model ({str(e)[:200]}); "
                         "delete it or start without resume") from None  # fmt: skip
    return state


def _stream_of(data, seed: int = 0) -> TokenStream:
    if isinstance(data, TokenStream):
        return data
    rows = []
    for i, b in enumerate(as_batches(data)):
        ids = input_ids(b)
        if not (isinstance(ids, torch.Tensor) and not ids.is_floating_point() and ids.dim() == 2):
            raise ValueError(f"heal: batch {i} is not a (batch, seq_len) tensor of token ids; the heal draws token "
                             "sequences (give a TokenStream, or a list of id tensors)")  # fmt: skip
        rows.append(ids)
    if not rows:
        raise ValueError("heal: no training data")
    if len({r.shape[1] for r in rows}) > 1:
        raise ValueError("heal: the training batches have different sequence lengths")
    return TokenStream(torch.cat(rows), seed)


class _Budget:
    def __init__(self, minutes, tokens, report: HealReport) -> None:
        self.minutes, self.tokens, self.report = minutes, tokens, report
        self.start, self.before = time.monotonic(), report.seconds

    def seconds(self) -> float:
        return self.before + time.monotonic() - self.start

    def used(self) -> float:
        """The fraction of the budget spent, across a resume."""
        if self.minutes is not None:
            return self.seconds() / 60.0 / self.minutes
        return self.report.tokens / self.tokens


class _Validation:
    """The validation split's cross-entropy and KL to the original (whose log-probabilities are computed once),
    and the best state seen (of the trained parameters only)."""

    def __init__(self, original: nn.Module, converted: nn.Module, val, params: list[nn.Parameter]) -> None:
        self.converted, self.batches = converted, [input_ids(b) for b in as_batches(val)] if val is not None else []
        with torch.no_grad():
            self.targets = [run_batch(original, b, i, no_cache=True).logits.float().log_softmax(-1)
                            for i, b in enumerate(self.batches)]  # fmt: skip
        self.params = params
        self.best_ce, self.best_point, self.best_state = math.inf, None, None

    def measure(self) -> tuple[float, float]:
        if not self.batches:
            return math.nan, math.nan
        ce = kl = 0.0
        n_ce = n_kl = 0
        with torch.no_grad():
            for i, (ids, target) in enumerate(zip(self.batches, self.targets)):
                logp = run_batch(self.converted, ids, i, no_cache=True).logits.float().log_softmax(-1)
                ce -= float(logp[:, :-1].gather(-1, ids[:, 1:, None]).sum())
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


def _groups(params: list, lr: float, alphas: set[int], lora: set[int]) -> list[dict]:
    """Adam groups. DyT's alpha is stored as is and can sit anywhere from 1e-4 to 10 after calibration; Adam's steps
    are absolute, so each alpha gets a learning rate relative to its own size (log_beta is already a log)."""
    plain = [p for p in params if id(p) not in alphas and id(p) not in lora]
    groups = [{"params": plain, "lr": lr},
              {"params": [p for p in params if id(p) in lora], "lr": LEARNING_RATES["lora"]}]
    groups += [{"params": [p], "lr": lr * float(p.detach().abs().mean().clamp_min(1e-12))}
               for p in params if id(p) in alphas]  # fmt: skip
    return [g for g in groups if g["params"]]


def _optimizer(params, lr, converted) -> torch.optim.Optimizer:
    alphas = {id(m.alpha) for m in converted.modules() if _is_ours(m) and isinstance(getattr(m, "alpha", None),
                                                                                     nn.Parameter)}  # fmt: skip
    lora = {id(p) for m in converted.modules() if isinstance(m, LoRALinear) for p in (m.lora_a, m.lora_b)}
    return torch.optim.Adam(_groups(params, lr, alphas, lora))


# --------------------------------------------------------------------------
# the heal
# --------------------------------------------------------------------------
def heal(original: nn.Module, converted: nn.Module, data, record=None, *, val=None, minutes: float | None = None,
         tokens: int | None = None, objective: str = DEFAULT_OBJECTIVE, train: str = DEFAULT_TRAIN,
         lr: float | None = None, batch_size: int = 8, eval_every: int | None = None, lora_rank: int = LORA_RANK,
         checkpoint: str | Path | None = None, resume: bool = False, identity: dict | None = None,
         progress: bool | None = None) -> HealReport:  # fmt: skip
    """Train ``converted`` toward ``original`` on ``data`` (a TokenStream, or token batches) within a budget.

    Give exactly one of ``minutes`` or ``tokens``. ``record`` (from convert_norms) names the converted sites;
    without it every normlab module counts. ``val``: validation batches for the curve and the best state (see
    the module docstring). Returns a :class:`HealReport`; ``converted`` is updated in place (LoRA merged).
    ``identity`` (what the heal was made from) is stored in the checkpoint; a resume from another is refused.
    """
    _check_budget(minutes, tokens, train, objective, resume, checkpoint)
    stream = _stream_of(data)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"heal: batch_size must be an int >= 1, got {batch_size!r}")
    lr = lr if lr is not None else LEARNING_RATES[train]
    sites = [s.name for s in record.sites] if record is not None else [
        n for n, m in converted.named_modules() if _is_ours(m)]  # fmt: skip
    list_name = find_blocks(converted, sites)
    ckpt = Path(checkpoint) if checkpoint is not None else None
    if eval_every is None:
        eval_every = 8 * batch_size * stream.seq_len  # every 8 steps: a validation pass costs about one step
    report = HealReport(objective=objective, train=train, lora_rank=lora_rank if train == "lora" else None)
    if objective == "distill" or val is not None:
        with torch.no_grad():
            out = run_batch(original, stream.chunks[:1], no_cache=True)
        if not hasattr(out, "logits"):
            raise ValueError(f"heal: {type(original).__name__} gives no logits, so there is nothing to distill and no "
                             "validation cross-entropy; heal it with objective='blocks' and no val")  # fmt: skip
    with _frozen(original, converted):
        if train == "lora":
            add_lora(converted.get_submodule(list_name), lora_rank)
        try:
            state = None
            if resume and ckpt is not None and ckpt.exists():
                state = _load_checkpoint(ckpt, converted, identity, objective)
                stream.load_state(state["stream"])
                report = HealReport(**{**state["report"], "resumed_from": state["report"]["tokens"]})
            params = _trainable(converted if objective == "distill" else converted.get_submodule(list_name), train)
            check = _Validation(original, converted, val, params)
            if state is not None and state.get("best") is not None:
                check.best_ce, check.best_point = state["best"]["val_ce"], state["best"]
                check.best_state = state["best_state"]
            budget = _Budget(minutes, tokens, report)
            run = _distill if objective == "distill" else _blocks
            run(original, converted, stream, params, lr, batch_size, eval_every, check, budget, report, ckpt, state,
                identity, list_name, progress)  # fmt: skip
            check.restore()
            report.best = check.best_point
        finally:
            if train == "lora":
                merge_lora(converted)
    report.sequences = stream.drawn
    report.stream_passes = stream.drawn / len(stream)
    report.seconds = budget.seconds()
    return report


def _point(report: HealReport, budget: _Budget, check: _Validation, train_loss: float, **extra) -> dict:
    ce, kl = check.measure()
    point = {"tokens": report.tokens, "seconds": round(budget.seconds(), 2), "train_loss": train_loss, "val_ce": ce,
             "val_kl": kl, **extra}  # fmt: skip
    point["best"] = check.offer(point)
    report.curve.append(point)
    return point


def _postfix(point: dict) -> str:
    return f"val CE {point['val_ce']:.3f}, KL {point['val_kl']:.3f}"


def _kl(original: nn.Module, converted: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        target = run_batch(original, ids, no_cache=True).logits.float().log_softmax(-1)
    logp = run_batch(converted, ids, no_cache=True).logits.float().log_softmax(-1)
    return nn.functional.kl_div(logp.flatten(0, -2), target.flatten(0, -2), log_target=True, reduction="batchmean")


def _distill(original, converted, stream, params, lr, batch_size, eval_every, check, budget, report, ckpt, state,
             identity, list_name, progress) -> None:  # fmt: skip
    """End to end: KL(original || converted) on fresh batches; a curve point every ``eval_every`` tokens."""
    from tqdm.auto import tqdm

    opt = _optimizer(params, lr, converted)
    if state is not None and state.get("optimizer") is not None:
        opt.load_state_dict(state["optimizer"])
    def save() -> None:
        if ckpt is not None:
            _save(ckpt, _state(converted, report, stream, check, identity, opt))

    if not report.curve:
        _point(report, budget, check, math.nan)
        save()  # from the first moment on, a killed heal can be resumed
    for p in params:
        p.requires_grad_(True)
    bar = tqdm(total=100, desc=f"healing (distill, {report.train})", unit="%", bar_format="{l_bar}{bar}| {postfix}",
               disable={True: False, False: True}.get(progress))  # fmt: skip
    bar.set_postfix_str(_postfix(report.curve[-1]))
    losses, next_eval = [], report.tokens + eval_every
    try:
        while budget.used() < 1.0:
            ids = stream.next(batch_size)
            loss = _kl(original, converted, ids)
            if not torch.isfinite(loss):
                check.restore()  # back to the best state; a fresh optimizer; carry on
                opt = _optimizer(params, lr, converted)
                losses.append(math.nan)
                continue
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
            report.tokens += ids.numel()
            bar.n = min(100, int(100 * budget.used()))
            if report.tokens >= next_eval or budget.used() >= 1.0:
                point = _point(report, budget, check, _mean(losses))
                losses, next_eval = [], report.tokens + eval_every
                bar.set_postfix_str(_postfix(point))
                save()
        if losses:
            _point(report, budget, check, _mean(losses))
            save()
    finally:
        bar.close()
        for p in params:
            p.requires_grad_(False)


def _mean(xs: list[float]) -> float:
    xs = [x for x in xs if math.isfinite(x)]
    return sum(xs) / len(xs) if xs else math.nan


def _state(converted, report, stream, check, identity, opt=None, **extra) -> dict:
    return {"model": converted.state_dict(), "report": report.to_dict(), "stream": stream.state(),
            "objective": report.objective, "identity": identity, "best": check.best_point,
            "best_state": check.best_state, "optimizer": opt.state_dict() if opt is not None else None,
            **extra}  # fmt: skip


# --------------------------------------------------------------------------
# block-wise reconstruction on a pool of fresh sequences
# --------------------------------------------------------------------------
def _block_calls(model: nn.Module, blocks: nn.ModuleList, ids: torch.Tensor) -> tuple[list, torch.Tensor]:
    """The (args, kwargs) each block is called with on ``ids`` (their extra arguments depend only on the shape:
    positions, the causal mask), and block 0's input."""
    calls: list = [None] * len(blocks)

    def pre(k):
        def hook(mod, args, kwargs):
            kwargs = {n: v for n, v in kwargs.items() if n not in ("past_key_values", "past_key_value", "layer_past")}
            if "use_cache" in kwargs:
                kwargs["use_cache"] = False
            calls[k] = (tuple(a.detach() if torch.is_tensor(a) else a for a in args), kwargs)

        return hook

    handles = [b.register_forward_pre_hook(pre(k), with_kwargs=True) for k, b in enumerate(blocks)]
    try:
        with torch.no_grad():
            run_batch(model, ids, no_cache=True)
    finally:
        for h in handles:
            h.remove()
    return calls, calls[0][0][0]


def _embed(model: nn.Module, blocks: nn.ModuleList, ids: torch.Tensor) -> torch.Tensor:
    """Block 0's input for ``ids`` (the pass stops there)."""
    got = {}

    def hook(mod, args, kwargs):
        got["x"] = (args[0] if args else kwargs["hidden_states"]).detach()
        raise Stop

    h = blocks[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            run_batch(model, ids, no_cache=True)
    except Stop:
        pass
    finally:
        h.remove()
    return got["x"]


def _call(block: nn.Module, x: torch.Tensor, call) -> torch.Tensor:
    args, kwargs = call
    return _hidden(block(x, *args[1:], **kwargs))


def _pool_size(minutes, tokens, n_blocks, batch_size, seq_len, block, call, x0, stream_len) -> int:
    """Pool sequences for the budget: with a token budget, each block's share of it; with minutes, what a block's
    share of the time trains on once (one forward of the original block, a forward and backward of the converted
    one, one more forward to carry the pool on: about five forwards), timed on one batch."""
    if tokens is not None:
        per_block = math.ceil(tokens / n_blocks / seq_len)
    else:
        with torch.no_grad():
            _call(block, x0, call)
            t = time.monotonic()
            _call(block, x0, call)
            forward = (time.monotonic() - t) / len(x0)
        per_block = int(minutes * 60.0 / n_blocks * 0.9 / (5.0 * forward))
    cap = int(1.5e9 / (3 * x0[0].numel() * 4))  # x_orig, x_conv and y_orig for the pool within 1.5 GB
    n = min(per_block, stream_len, cap)
    return max(min(batch_size, stream_len), n - n % batch_size if n >= batch_size else n)


def _blocks(original, converted, stream, params, lr, batch_size, eval_every, check, budget, report, ckpt, state,
            identity, list_name, progress) -> None:  # fmt: skip
    from tqdm.auto import tqdm

    blocks_c: nn.ModuleList = converted.get_submodule(list_name)
    blocks_o: nn.ModuleList = original.get_submodule(list_name)
    n_blocks = len(blocks_c)
    probe = stream.chunks[:batch_size]
    calls, x0 = _block_calls(original, blocks_o, probe)
    if state is not None:
        first, x_o, x_c = state["next_block"], state["x_orig"], state["x_conv"]
    else:
        first = 0
        n_pool = _pool_size(budget.minutes, budget.tokens, n_blocks, batch_size, stream.seq_len, blocks_o[0],
                            calls[0], x0, len(stream))  # fmt: skip
        pool = stream.next(n_pool).split(batch_size)
        x_o = [_embed(original, blocks_o, ids) for ids in pool]
        x_c = [_embed(converted, blocks_c, ids) for ids in pool]
        _point(report, budget, check, math.nan, block=-1)
    bar = tqdm(range(first, n_blocks), desc=f"healing {list_name} (blocks, {report.train})", unit="block",
               disable={True: False, False: True}.get(progress))  # fmt: skip
    bar.set_postfix_str(_postfix(report.curve[-1]))
    mine = {id(p) for p in params}
    every, block_losses = max(1, math.ceil(n_blocks / 10)), []
    for k in bar:
        block, call = blocks_c[k], calls[k]
        with torch.no_grad():
            ys = [_call(blocks_o[k], x, _fitc(call, x)) for x in x_o]
        block_params = [p for p in block.parameters() if id(p) in mine]
        before = float(_rel_loss(_call(block, x_c[0], _fitc(call, x_c[0])), ys[0]).detach()) if x_c else math.nan
        saved = [p.detach().clone() for p in block_params]
        end = (k + 1) / n_blocks
        steps, losses, diverged = 0, [], False
        if block_params:
            for p in block_params:
                p.requires_grad_(True)
            opt = _optimizer(block_params, lr, converted)
            order = torch.randperm(len(x_c), generator=torch.Generator().manual_seed(k))
            try:
                while steps == 0 or budget.used() < end:
                    i = int(order[steps % len(order)])
                    loss = _rel_loss(_call(block, x_c[i], _fitc(call, x_c[i])), ys[i])
                    if not torch.isfinite(loss):
                        diverged = True
                        break
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
                    losses.append(float(loss.detach()))
                    steps += 1
                    report.tokens += x_c[i].shape[0] * x_c[i].shape[1]
            finally:
                for p in block_params:
                    p.requires_grad_(False)
        after = float(_rel_loss(_call(block, x_c[0], _fitc(call, x_c[0])), ys[0]).detach()) if x_c else math.nan
        kept = math.isfinite(after) and after <= before and not diverged
        if not kept:
            with torch.no_grad():
                for p, v in zip(block_params, saved):
                    p.copy_(v)
            after = before
        report.blocks.append({"block": f"{list_name}.{k}", "loss_before": before, "loss_after": after, "steps": steps,
                              "pool_passes": steps / max(1, len(x_c)), "kept": kept, "diverged": diverged})  # fmt: skip
        with torch.no_grad():
            x_c = [_call(block, x, _fitc(call, x)).detach() for x in x_c]
        x_o = ys
        block_losses += losses
        if (k + 1) % every == 0 or k == n_blocks - 1:  # about ten points on the curve: each costs a forward on val
            _point(report, budget, check, _mean(block_losses), block=k)
            block_losses = []
        bar.set_postfix_str(f"rel. error {before:.3f} -> {after:.3f}; {_postfix(report.curve[-1])}")
        if ckpt is not None:
            _save(ckpt, _state(converted, report, stream, check, identity, next_block=k + 1, x_orig=x_o, x_conv=x_c))


def _fit(kwargs: dict, x: torch.Tensor) -> dict:
    """The captured keyword arguments for a batch of ``x``'s size (the last pool batch may be smaller)."""
    b = x.shape[0]
    out = {}
    for n, v in kwargs.items():
        if torch.is_tensor(v) and v.dim() >= 1 and v.shape[0] > b:
            v = v[:b]
        elif isinstance(v, tuple) and all(torch.is_tensor(t) and t.dim() >= 1 for t in v) and v and v[0].shape[0] > b:
            v = tuple(t[:b] for t in v)
        out[n] = v
    return out


def _fitc(call, x: torch.Tensor):
    args, kwargs = call
    return args, _fit(kwargs, x)
