"""Block-wise healing: the blocks are trained one at a time, in order, each to reproduce the original block's output
(per-token relative squared error of the residual stream) from its input in the converted model, so that it also
undoes the drift it inherits. A pool of fresh sequences, sized to the budget, is carried through the blocks: each
block trains on its own depth's view of the pool. `normlab.conversion.heal.distill.heal` with ``objective="blocks"``.
"""

from __future__ import annotations

import math
import time

import torch
from torch import nn

from normlab.conversion.batches import Stop, run_batch
from normlab.conversion.heal.loop import HealRun, make_optimizer, mean_finite, postfix

__all__ = ["blocks"]


def _hidden(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _rel_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y).pow(2).sum(-1) / y.pow(2).sum(-1).clamp_min(1e-30)).mean()


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
            run_batch(model, ids, no_cache=True, stage="heal")
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
            run_batch(model, ids, no_cache=True, stage="heal")
    except Stop:
        pass
    finally:
        h.remove()
    return got["x"]


def _call(block: nn.Module, x: torch.Tensor, call) -> torch.Tensor:
    args, kwargs = call
    return _hidden(block(x, *args[1:], **kwargs))


def _pool_size(run: HealRun, n_blocks: int, block: nn.Module, call, x0: torch.Tensor) -> int:
    """Pool sequences for the budget: with a token budget, each block's share of it; with minutes, what a block's
    share of the time trains on once (one forward of the original block, a forward and backward of the converted
    one, one more forward to carry the pool on: about five forwards), timed on one batch."""
    minutes, tokens, batch_size = run.cfg.minutes, run.cfg.tokens, run.cfg.batch_size
    if tokens is not None:
        per_block = math.ceil(tokens / n_blocks / run.stream.seq_len)
    else:
        with torch.no_grad():
            _call(block, x0, call)
            t = time.monotonic()
            _call(block, x0, call)
            forward = (time.monotonic() - t) / len(x0)
        per_block = int(minutes * 60.0 / n_blocks * 0.9 / (5.0 * forward))
    cap = int(1.5e9 / (3 * x0[0].numel() * 4))  # x_orig, x_conv and y_orig for the pool within 1.5 GB
    n = min(per_block, len(run.stream), cap)
    return max(min(batch_size, len(run.stream)), n - n % batch_size if n >= batch_size else n)


def blocks(run: HealRun) -> None:
    """Train the converted model's blocks one at a time (see the module docstring); a curve point about every
    tenth block, a checkpoint after each.

    Args:
        run: The heal's state: the models, the data, the optimizer, the budget and the curve.
    """
    from tqdm.auto import tqdm

    cfg, report = run.cfg, run.report
    blocks_c: nn.ModuleList = run.converted.get_submodule(run.list_name)
    blocks_o: nn.ModuleList = run.original.get_submodule(run.list_name)
    n_blocks = len(blocks_c)
    calls, x0 = _block_calls(run.original, blocks_o, run.stream.chunks[: cfg.batch_size])
    if run.state is not None:
        first, x_o, x_c = run.state["next_block"], run.state["x_orig"], run.state["x_conv"]
    else:
        first = 0
        n_pool = _pool_size(run, n_blocks, blocks_o[0], calls[0], x0)
        pool = run.stream.next(n_pool).split(cfg.batch_size)
        x_o = [_embed(run.original, blocks_o, ids) for ids in pool]
        x_c = [_embed(run.converted, blocks_c, ids) for ids in pool]
        run.point(math.nan, block=-1)
    bar = tqdm(
        range(first, n_blocks),
        desc=f"healing {run.list_name} (blocks, {report.train})",
        unit="block",
        disable=run.bar_disabled,
    )
    bar.set_postfix_str(postfix(report.curve[-1]))
    every, block_losses = max(1, math.ceil(n_blocks / 10)), []
    for k in bar:
        call = calls[k]
        with torch.no_grad():
            ys = [_call(blocks_o[k], x, _fitc(call, x)) for x in x_o]
        before, after, losses = _train_block(run, k, blocks_c[k], call, x_c, ys)
        with torch.no_grad():
            x_c = [_call(blocks_c[k], x, _fitc(call, x)).detach() for x in x_c]
        x_o = ys
        block_losses += losses
        if (k + 1) % every == 0 or k == n_blocks - 1:  # about ten points on the curve: each costs a forward on val
            run.point(mean_finite(block_losses), block=k)
            block_losses = []
        bar.set_postfix_str(f"rel. error {before:.3f} -> {after:.3f}; {postfix(report.curve[-1])}")
        run.save(next_block=k + 1, x_orig=x_o, x_conv=x_c)


def _train_block(run: HealRun, k: int, block: nn.Module, call, x_c: list, ys: list) -> tuple[float, float, list]:
    """Block ``k`` trained on the pool until its share of the budget is spent; kept only if its error fell and it
    did not diverge. Returns the error before and after, and the step losses."""
    mine = {id(p) for p in run.params}
    block_params = [p for p in block.parameters() if id(p) in mine]
    before = float(_rel_loss(_call(block, x_c[0], _fitc(call, x_c[0])), ys[0]).detach()) if x_c else math.nan
    saved = [p.detach().clone() for p in block_params]
    end = (k + 1) / len(run.converted.get_submodule(run.list_name))
    steps, losses, diverged = 0, [], False
    if block_params:
        for p in block_params:
            p.requires_grad_(True)
        opt = make_optimizer(block_params, run.cfg.rate(), run.converted, lora_lr=run.cfg.lora_rate())
        order = torch.randperm(len(x_c), generator=torch.Generator().manual_seed(k))
        try:
            while steps == 0 or run.budget.used() < end:
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
                run.report.tokens += x_c[i].shape[0] * x_c[i].shape[1]
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
    run.report.blocks.append(
        {
            "block": f"{run.list_name}.{k}",
            "loss_before": before,
            "loss_after": after,
            "steps": steps,
            "pool_passes": steps / max(1, len(x_c)),
            "kept": kept,
            "diverged": diverged,
        }
    )
    return before, after, losses


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
