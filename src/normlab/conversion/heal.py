"""Healing a converted model on a CPU budget: block-wise reconstruction, then optional distillation.

    record = normlab.convert_norms(model, "dyisru", calibrate=calib)
    report = normlab.heal(original, model, calib, record, minutes=20)   # or tokens=2_000_000

Stage 1, block-wise reconstruction. The converted model's transformer blocks are trained one at a time, in
order, so that each reproduces the original block's output. Block k sees its input in the converted model
(blocks 1..k-1 already healed) and is trained against the original block's output on the original input, so
it also undoes the drift it inherits. The loss is the per-token relative squared error of the residual stream,
||y_conv - y_orig||^2 / ||y_orig||^2, averaged over tokens: a massive-activation token counts as one token,
not as a thousand. ``train="norms"`` trains only the replacements' parameters (alpha/beta, weight, bias);
``train="all"`` trains every weight of the block.

Stage 2, distillation (``distill=`` a fraction of the budget, default 0). The whole converted model is trained
to match the original's next-token distribution, KL(original || converted), which also reaches the norms
outside the blocks (the final norm).

Budget. ``minutes`` (wall time) or ``tokens`` (tokens through a trained forward/backward), split evenly over
the blocks. A block whose loss ends worse than it started, or turns NaN, is put back to its best state and the
heal goes on. ``checkpoint=`` saves the state after every block (atomically); ``resume=True`` continues from it.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from normlab.conversion.batches import Stop, as_batches, input_ids, run_batch

__all__ = ["heal", "HealReport", "find_blocks"]


@dataclass
class HealReport:
    blocks: list[dict] = field(default_factory=list)  # per block: name, loss before / after, steps, kept
    distill: dict | None = None
    tokens: int = 0
    seconds: float = 0.0
    resumed_from: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


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


def _capture(model: nn.Module, blocks: nn.ModuleList, batches: list, *, outputs: bool, stop_at: int | None = None):
    """Per batch: the (args, kwargs) each block was called with, and its output (when ``outputs``)."""
    calls: list[list] = [[None] * len(batches) for _ in blocks]
    outs: list[list] = [[None] * len(batches) for _ in blocks]
    cur = {"b": 0}

    def pre(k):
        def hook(mod, args, kwargs):
            kwargs = {n: v for n, v in kwargs.items() if n not in ("past_key_values", "past_key_value", "layer_past")}
            if "use_cache" in kwargs:
                kwargs["use_cache"] = False
            calls[k][cur["b"]] = (tuple(a.detach() if torch.is_tensor(a) else a for a in args), kwargs)
            if stop_at == k:
                raise Stop

        return hook

    def post(k):
        def hook(mod, args, out):
            outs[k][cur["b"]] = _hidden(out).detach()

        return hook

    handles = [b.register_forward_pre_hook(pre(k), with_kwargs=True) for k, b in enumerate(blocks)]
    if outputs:
        handles += [b.register_forward_hook(post(k)) for k, b in enumerate(blocks)]
    try:
        with torch.no_grad():
            for i, batch in enumerate(batches):
                cur["b"] = i
                try:
                    run_batch(model, batch, i, no_cache=True)
                except Stop:
                    pass
    finally:
        for h in handles:
            h.remove()
    return calls, outs


def _trainable(block: nn.Module, train: str) -> list[nn.Parameter]:
    if train == "all":
        return list(block.parameters())
    return [p for m in block.modules() if _is_ours(m) for p in m.parameters(recurse=False)]


def _is_ours(m: nn.Module) -> bool:
    return type(m).__module__.startswith("normlab.")


def _rel_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y).pow(2).sum(-1) / y.pow(2).sum(-1).clamp_min(1e-30)).mean()


def _call(block: nn.Module, x: torch.Tensor, call) -> torch.Tensor:
    args, kwargs = call
    return _hidden(block(x, *args[1:], **kwargs))


def _block_loss(block, xs, calls, ys) -> float:
    with torch.no_grad():
        return sum(float(_rel_loss(_call(block, x, c), y)) for x, c, y in zip(xs, calls, ys)) / len(xs)


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
            p.requires_grad_(flag)


def _check_budget(minutes, tokens, train: str, distill: float, resume: bool, checkpoint) -> None:
    """heal's options, checked before any work."""
    if (minutes is None) == (tokens is None):
        raise ValueError("heal: give exactly one budget, minutes= or tokens=")
    budget = minutes if minutes is not None else tokens
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget > 0 or not math.isfinite(budget):
        raise ValueError(f"heal: the budget must be a number > 0, got {budget!r}")
    if train not in ("norms", "all"):
        raise ValueError(f"heal: train must be 'norms' or 'all', got {train!r}")
    if not 0.0 <= distill < 1.0:
        raise ValueError(f"heal: distill is the fraction of the budget for distillation, in [0, 1), got {distill!r}")
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


def _load_resume(ckpt: Path, converted: nn.Module, n_blocks: int,
                 identity: dict | None = None) -> tuple[int, list, HealReport]:  # fmt: skip
    """The next block, its inputs and the report so far, from a heal checkpoint of this converted model (and,
    given ``identity``, of the same source model, text and settings)."""
    try:
        state = torch.load(ckpt, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001  (any unpickling error means the file is unusable)
        raise ValueError(f"heal: checkpoint {ckpt} is corrupt or not a heal checkpoint ({type(e).__name__}); "
                         "delete it or start without resume") from None  # fmt: skip
    if not isinstance(state, dict) or not {"model", "next_block", "inputs", "report"} <= set(state):
        raise ValueError(f"heal: {ckpt} is not a heal checkpoint; delete it or start without resume")
    if identity is not None:
        diff = _identity_difference(state.get("identity"), identity)
        if diff:
            raise ValueError(f"heal: checkpoint {ckpt} was made from another model, text or settings ({diff}); "
                             "resume with the same ones, or start afresh with another --checkpoint")  # fmt: skip
    try:
        converted.load_state_dict(state["model"])
    except RuntimeError as e:
        raise ValueError(f"heal: checkpoint {ckpt} is not of this converted model ({str(e)[:200]}); "
                         "delete it or start without resume") from None  # fmt: skip
    if state.get("n_blocks") not in (None, n_blocks):
        raise ValueError(f"heal: checkpoint {ckpt} is for a model with {state['n_blocks']} blocks")
    first = state["next_block"]
    return first, state["inputs"], HealReport(**{**state["report"], "resumed_from": first})


def heal(original: nn.Module, converted: nn.Module, batches, record=None, *, minutes: float | None = None,
         tokens: int | None = None, train: str = "norms", lr: float | None = None, distill: float = 0.0,
         checkpoint: str | Path | None = None, resume: bool = False, identity: dict | None = None,
         progress: bool | None = None) -> HealReport:  # fmt: skip
    """Train ``converted`` toward ``original`` on ``batches`` (token-id tensors or dicts) within a budget.

    Give exactly one of ``minutes`` or ``tokens``. ``record`` (from convert_norms) names the converted sites;
    without it every normlab module counts. Returns a :class:`HealReport`; ``converted`` is updated in place.
    ``identity`` (what the heal was made from: model, text, settings) is stored in the checkpoint, and a resume
    from a checkpoint of another identity is refused with the difference named.
    """
    from tqdm.auto import tqdm

    _check_budget(minutes, tokens, train, distill, resume, checkpoint)
    batches = list(as_batches(batches))  # the same accepted forms, and errors, as calibration
    if not batches:
        raise ValueError("heal: no calibration batches")
    lr = lr if lr is not None else (1e-3 if train == "norms" else 2e-5)
    sites = [s.name for s in record.sites] if record is not None else [
        n for n, m in converted.named_modules() if _is_ours(m)]  # fmt: skip
    list_name = find_blocks(converted, sites)
    blocks_c: nn.ModuleList = converted.get_submodule(list_name)
    blocks_o: nn.ModuleList = original.get_submodule(list_name)
    n_blocks = len(blocks_c)

    start = time.monotonic()
    report = HealReport()
    ckpt = Path(checkpoint) if checkpoint is not None else None
    first = 0
    alphas = {id(m.alpha) for m in converted.modules() if _is_ours(m) and isinstance(getattr(m, "alpha", None),
                                                                                     nn.Parameter)}  # fmt: skip
    with _frozen(original, converted):
        calls_o, ys = _capture(original, blocks_o, batches, outputs=True)
        if resume and ckpt is not None and ckpt.exists():
            first, xs, report = _load_resume(ckpt, converted, n_blocks, identity)
        else:
            calls_c, _ = _capture(converted, blocks_c, batches, outputs=False, stop_at=0)
            xs = [c[0][0] for c in calls_c[0]]
        elapsed0 = report.seconds

        def used() -> float:  # the fraction of the budget spent, across a resume
            if minutes is not None:
                return (elapsed0 + time.monotonic() - start) / 60.0 / minutes
            return report.tokens / tokens

        block_share = (1.0 - distill) / n_blocks
        bar = tqdm(range(first, n_blocks), desc=f"healing {list_name}", unit="block",
                   disable={True: False, False: True}.get(progress))  # fmt: skip
        for k in bar:
            block, calls, yk = blocks_c[k], calls_o[k], ys[k]
            before = _block_loss(block, xs, calls, yk)
            best = copy.deepcopy(block.state_dict())
            end = (k + 1) * block_share
            steps, diverged = _train(lambda i, b=block, x=xs, c=calls, y=yk: _rel_loss(_call(b, x[i], c[i]), y[i]),
                                     _trainable(block, train), lr, len(xs), lambda e=end: used() < e,
                                     report, [_n_tokens(x) for x in xs], alphas)  # fmt: skip
            after = _block_loss(block, xs, calls, yk)
            kept = math.isfinite(after) and after <= before
            if not kept:
                block.load_state_dict(best)
                after = before
            report.blocks.append({"block": f"{list_name}.{k}", "loss_before": before, "loss_after": after,
                                  "steps": steps, "kept": kept, "diverged": diverged})  # fmt: skip
            bar.set_postfix_str(f"rel. error {before:.3f} -> {after:.3f}")
            with torch.no_grad():
                xs = [_call(block, x, c).detach() for x, c in zip(xs, calls)]
            report.seconds = elapsed0 + time.monotonic() - start
            if ckpt is not None:
                _save(ckpt, {"model": converted.state_dict(), "next_block": k + 1, "inputs": xs, "n_blocks": n_blocks,
                             "report": report.to_dict(), "identity": identity})  # fmt: skip
        if distill > 0:
            report.distill = _distill(original, converted, batches, train, lr, lambda: used() < 1.0, report, alphas)
        report.seconds = elapsed0 + time.monotonic() - start
    return report


def _n_tokens(x: torch.Tensor) -> int:
    return int(x.numel() // x.shape[-1]) if x.is_floating_point() else int(x.numel())


def _train(loss_of, params: list, lr: float, n_batches: int, go_on, report: HealReport, n_tok: list[int],
           alphas: set[int]):  # fmt: skip
    """Adam over the batches in turn while ``go_on()`` (at least one step). Stops at a non-finite loss."""
    if not params:
        return 0, False
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(_groups(params, lr, alphas))
    steps, diverged = 0, False
    try:
        while steps == 0 or go_on():
            i = steps % n_batches
            loss = loss_of(i)
            if not torch.isfinite(loss):
                diverged = True
                break
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            steps += 1
            report.tokens += n_tok[i]
    finally:
        for p in params:
            p.requires_grad_(False)
    return steps, diverged


def _groups(params: list, lr: float, alphas: set[int]) -> list[dict]:
    """Adam groups. DyT's alpha is stored as is and can sit anywhere from 1e-4 to 10 after calibration; Adam's steps
    are absolute, so each alpha gets a learning rate relative to its own size (log_beta is already a log)."""
    groups = [{"params": [p for p in params if id(p) not in alphas], "lr": lr}]
    groups += [{"params": [p], "lr": lr * float(p.detach().abs().mean().clamp_min(1e-12))}
               for p in params if id(p) in alphas]  # fmt: skip
    return [g for g in groups if g["params"]]


def _kl(original: nn.Module, converted: nn.Module, batch) -> torch.Tensor:
    with torch.no_grad():
        target = _hidden(getattr(run_batch(original, batch, no_cache=True), "logits", None)).float().log_softmax(-1)
    logits = run_batch(converted, batch, no_cache=True).logits.float()
    return torch.nn.functional.kl_div(logits.log_softmax(-1).flatten(0, -2), target.flatten(0, -2),
                                      log_target=True, reduction="batchmean")  # fmt: skip


def _distill(original, converted, batches, train, lr, go_on, report: HealReport, alphas: set[int]) -> dict:
    """End-to-end: KL(original || converted) of the next-token distributions; keeps the best state."""
    params = (list(converted.parameters()) if train == "all" else
              [p for m in converted.modules() if _is_ours(m) for p in m.parameters(recurse=False)])  # fmt: skip
    evaluate = lambda: sum(float(_kl(original, converted, b)) for b in batches) / len(batches)  # noqa: E731
    before = evaluate()
    best = copy.deepcopy(converted.state_dict())
    steps, diverged = _train(lambda i: _kl(original, converted, batches[i]), params, lr, len(batches), go_on,
                             report, [_n_tokens(input_ids(b)) for b in batches], alphas)  # fmt: skip
    after = evaluate()
    kept = math.isfinite(after) and after <= before
    if not kept:
        converted.load_state_dict(best)
        after = before
    return {"kl_before": before, "kl_after": after, "steps": steps, "kept": kept, "diverged": diverged}
