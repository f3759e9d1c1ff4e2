"""Sequential calibration: fit each replacement on the activations of the model as converted so far.

Why sequential. A real pretrained model has dozens of norms. Fitting each one on the *original* model's
activations hides how their errors compound: on SmolLM2-135M (61 RMSNorms) the independent fit raised the
held-out cross-entropy from 3.7 to 486. Here the sites are fitted in the order the model runs them; site k is
fitted on its input in the model whose sites 1..k-1 are already replaced, against the original model's output
at site k. The fit therefore also corrects what the earlier replacements got wrong.

The objective is what the next layer sees: the site's output after its affine (weight, bias), not the
normalized output before it. Channels the model weights heavily weigh heavily in the fit.

Each replacement gets two fitted quantities (per site, or per channel with ``per="channel"``): its own
parameter (DyISRU/ELN beta, DyT alpha) and an amplitude folded into its weight, from Theorem 3 of the DyISRU paper
on (`normlab.conversion.calibrate.fit`). The inputs come block by block from cached block inputs where the model is a
chain
of blocks (`normlab.conversion.calibrate.stream`), else from passes of the converted prefix.

Massive activations. Real LLMs give a few tokens an RMS 30-200x the median, carried by a few fixed channels: the
first token, and early delimiters such as a leading "\n\n" (the attention sinks). No element-wise function maps both
those and ordinary tokens, so:

* at each site where they occur and a few channels tell them apart, massive tokens get their own replacement
  (`normlab.conversion.calibrate.massive.MassiveTokens`, routed by those channels' magnitude, wherever the token sits;
  ``massive_tokens="auto"``). Its fit is per channel, on the massive rows rescaled to one size over those channels
  (as the module rescales them): a sink token has a fixed shape, so ||x without channel i|| then hardly varies
  across them, and Theorem 3 makes DyISRU nearly exact. It is fitted on every massive row of the
  calibration sequences and of ``[t, t]`` for every distinct calibration token ``t``;
* massive tokens that no channel separates are left out of the fit of the shared replacement (``massive=10``: RMS
  above 10x the median), so that a handful of tokens does not drag the fit for every other token. Their count is
  recorded.

Guard rails: calibration tokens with NaN or Inf are left out (and counted); a fit whose loss is not finite,
or that ends worse than its start, keeps the start point and is flagged; a fit that runs to a degenerate value
(linear over the whole data, or saturated) is flagged. Flagged fits never read "ok".
"""

from __future__ import annotations

import contextlib
import math
import time

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from normlab.conversion.batches import Stop, as_batches, run_hooked
from normlab.conversion.calibrate.fit import FitOutcome, fit_replacement
from normlab.conversion.calibrate.massive import (
    MassiveRows,
    detector,
    early_rows,
    formation_site,
    massive_decision,
    massive_ratio,
)
from normlab.conversion.calibrate.stream import BlockStream, find_blocks
from normlab.conversion.config import ConvertConfig
from normlab.record import Site
from normlab.registry import NormSpec, norm_spec
from normlab.sites import swap

__all__ = ["FitOutcome", "fit_replacement", "calibrate_sites", "per_channel_kwargs"]


# --------------------------------------------------------------------------
# the sequential pass over a model's sites
# --------------------------------------------------------------------------
def per_channel_kwargs(spec: NormSpec | str) -> dict:
    """The init kwargs that give ``spec``'s fitted parameter one value per channel.

    Args:
        spec: The target norm's `NormSpec` (what a conversion passes), or its registry name.
    """
    spec = norm_spec(spec) if isinstance(spec, str) else spec
    return {"per_channel_beta": True} if spec.fits == "log_beta" else {"per_channel_alpha": True}


def _massive_copy(new: nn.Module, site, spec: NormSpec) -> nn.Module:
    """The massive tokens' own replacement: per channel, with the shared replacement's copied affine."""
    twin = spec.create(site.dim, **{**site.kwargs, **per_channel_kwargs(spec)})
    twin.load_state_dict({k: v.expand_as(twin.state_dict()[k]) for k, v in new.state_dict().items()})
    return twin.to(device=new.weight.device, dtype=new.weight.dtype).train(new.training)


class _Rows:
    """The rows of one site's activations kept for its fit: every first token, and a fixed sample of the rest.

    The sample depends only on the batch index and shape, so the original and the converted model keep the
    same tokens, and the fit pairs each converted input with the original output of the same token.
    """

    def __init__(self, quota: int) -> None:
        self.quota = quota
        self.first: list[torch.Tensor] = []
        self.rest: list[torch.Tensor] = []

    def add(self, t: torch.Tensor, batch: int) -> None:
        t = t.detach().float()
        if t.dim() == 3 and t.shape[-2] >= 2:  # (B, T, C): a sequence axis (a per-head norm's (B, T, H, D) has none)
            self.first.append(t[..., 0, :].reshape(-1, t.shape[-1]).cpu())
            t = t[..., 1:, :]
        rows = t.reshape(-1, t.shape[-1])
        g = torch.Generator().manual_seed(batch)
        self.rest.append(rows[torch.randperm(len(rows), generator=g)[: self.quota].to(rows.device)].cpu())

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.rest[0].shape[-1]
        rest = torch.cat(self.rest)
        return (torch.cat(self.first) if self.first else rest.new_empty(0, c)), rest


def _site_inputs(model: nn.Module, batches: list, name: str, quota: int, channel_dim: int = -1, stream=None) -> _Rows:
    """The input of site ``name`` on every batch, in the model as converted so far, channels last: from the block
    stream where it serves the site, else from passes of the whole model that stop there."""
    rows = _Rows(quota)
    if stream is not None and stream.serves(name):
        stream.site_inputs(name, batches, lambda t, i: rows.add(t.movedim(channel_dim, -1), i))
        return rows

    def grab_in(mod, args):
        rows.add(args[0].movedim(channel_dim, -1), grab_in.batch)
        raise Stop

    for i, batch in enumerate(batches):
        grab_in.batch = i
        run_hooked(model, batch, i, {name: grab_in}, "pre")
    return rows


def _local_targets(old: nn.Module, *xs: Tensor) -> tuple[Tensor, ...]:
    """The original norm applied to the site's input in the converted model (``target="local"``)."""
    ref = next(old.parameters(), xs[0])
    return tuple(old(t.to(ref)).float().cpu() if len(t) else t for t in xs)


def _drop_massive(site: Site, x: Tensor, y: Tensor, massive: float) -> tuple[Tensor, Tensor]:
    """The tokens whose RMS is above ``massive`` x the median left out of the shared fit (noted), unless fewer
    than two would remain."""
    rms = x.pow(2).mean(-1).sqrt()
    keep = ~(rms > massive * rms.nanmedian())
    if int((~keep).sum()) and int(keep.sum()) >= 2:
        site.notes.append(f"{int((~keep).sum())} massive token(s) (RMS > {massive:g}x median) left out")
        x, y = x[keep], y[keep]
    return x, y


def _record(site: Site, out: FitOutcome, out_massive: FitOutcome | None, per: str) -> None:
    """A site's fits (and its massive copy's) in its record."""
    site.fit = {**out.to_dict(), "per": per}
    site.notes += out.notes
    if out_massive is not None:
        site.fit["massive"] = out_massive.to_dict()
        site.notes += [f"massive copy: {m}" for m in out_massive.notes]


class _OriginalPass:
    """One pass of the model as it is over the batches, hooked at every site: the order the sites run in, their
    outputs (the fits' targets), their inputs too with ``keep_inputs``, each input's dimension and its largest token
    RMS over the median's. A pass stops once every site has run (an LM head is idle)."""

    def __init__(self, model: nn.Module, batches: list, dims: dict[str, int], quota: int, keep_inputs: bool) -> None:
        self.order: list[str] = []
        self.targets = {n: _Rows(quota) for n in dims}
        self.inputs = {n: _Rows(quota) for n in dims} if keep_inputs else None
        self.ratios: dict[str, list[float]] = {n: [] for n in dims}
        self.medians: dict[str, list[float]] = {n: [] for n in dims}
        self.sample = {n: _Rows(64) for n in dims}  # a few input rows of each batch: where massive tokens separate
        self.ndim: dict[str, int] = {}
        self.dims = dims
        for i, batch in enumerate(batches):
            self.batch, self.fired = i, set()
            run_hooked(model, batch, i, {n: self._hook(n) for n in dims}, "out")
        missing = [n for n in dims if n not in self.order]
        if missing:
            raise ValueError(f"calibrate: the norm {missing[0]} never ran on the calibration data")

    def _hook(self, n: str):
        def hook(mod, args, y):
            if n not in self.order:
                self.order.append(n)
            x = args[0].movedim(self.dims[n], -1)
            self.ndim[n] = x.dim()
            self.targets[n].add(y.movedim(self.dims[n], -1), self.batch)
            if self.inputs is not None:
                self.inputs[n].add(x, self.batch)
            self.ratios[n].append(massive_ratio(x) if x.dim() == 3 else math.nan)
            self.medians[n].append(float(x.detach().float().pow(2).mean(-1).sqrt().median()))
            if x.dim() == 3:
                self.sample[n].add(x, self.batch)
            self.fired.add(n)
            if len(self.fired) == len(self.dims):
                raise Stop

        return hook


def calibrate_sites(
    model: nn.Module,
    sites: list[tuple[Site, nn.Module]],
    calibrate: list,
    config: ConvertConfig,
    *,
    spec: NormSpec,
    progress: bool | None = None,
) -> tuple[str, dict]:
    """Fit and swap every site in the order the model runs them (the module docstring); returns the massive-token
    decision (a note), how the inputs were taken (`_path`, for the record) and the sites kept as they were, with
    the reason (``massive_tokens="auto"``: the sites before the massive activation forms).

    ``config`` (a `ConvertConfig`) gives the ``calibrate`` section and ``per``. ``config.calibrate.sequential=False``
    fits every site on its input in the *original* model instead (one pass for all sites): each fit is then exact
    for that site converted alone, which is what ranking the sites one by one needs (`normlab.conversion.frontier`);
    errors compound when many such fits are used together.

    ``sites`` pairs each of the conversion's Site records (name, dim, kwargs; this fills in fit, notes and
    massive) with its built replacement. On any failure every original is put back.

    Args:
        model: The model, changed in place: each site is swapped for its fitted replacement.
        sites: (site, replacement) pairs in the order the model runs them.
        calibrate: The calibration batches (token ids or model inputs).
        config: The `ConvertConfig` (its ``calibrate`` section and ``per``).
        spec: The target norm's registry facts.
        progress: Show a progress bar; None: when stderr is a terminal.
    """
    batches = list(as_batches(calibrate))
    if not batches:
        raise ValueError("calibrate: the calibration data is empty")
    t0 = time.perf_counter()
    c = config.calibrate
    replacements = {s.name: new for s, new in sites}
    sites = [s for s, _ in sites]
    max_tokens, sequential = c.max_tokens, c.sequential
    quota = max(1, math.ceil(max_tokens / len(batches)))
    by_name = {s.name: s for s in sites}
    dims = {s.name: s.kwargs.get("channel_dim", -1) for s in sites}
    blocks = find_blocks(model, list(by_name)) if sequential else None
    stream = BlockStream(model, *blocks) if blocks else None
    was_training = model.training
    model.eval()
    swapped: dict[str, nn.Module] = {}  # name -> the original module, to restore on failure
    try:
        outside = [n for n in by_name if stream is not None and stream.block_of(n) is None]
        with stream.record(outside) if stream is not None else contextlib.nullcontext():
            seen = _OriginalPass(model, batches, dims, quota, keep_inputs=not sequential)  # 1. the order, the targets
        order, targets, inputs, ndim = seen.order, seen.targets, seen.inputs, seen.ndim
        if stream is not None:
            stream.check_fits()
        route, decision = massive_decision(seen.ratios, order, c.massive_tokens, c.massive)
        extra = None
        if route:  # the [t, t] pairs, their targets, and their own block stream, in one pass of the original
            seq = {n: dims[n] for n in order if ndim[n] == 3 and dims[n] in (-1, 2)}  # (B, T, C), channels last
            pairs = BlockStream(model, *blocks) if stream is not None and stream.broken is None else None
            extra = MassiveRows(model, batches, seq, max_tokens, sequential, pairs)
        kept = _before_formation(model, extra, order, seen, c) if route and c.massive_tokens == "auto" else {}
        path = _path(stream, sequential, order)
        bar = tqdm(
            order, desc=f"calibrating {spec.name}", unit="site", disable={True: False, False: True}.get(progress)
        )
        for n in bar:  # 2. each site on the input of the model converted so far
            if n in kept:
                continue
            site, new = by_name[n], replacements[n]
            rows_in = inputs[n] if inputs is not None else _site_inputs(model, batches, n, quota, dims[n], stream)
            x, y = torch.cat(rows_in.tensors()), torch.cat(targets[n].tensors())
            xe, ye = extra(model, n) if extra is not None and n in extra.dims else (x[:0], y[:0])
            if c.target == "local":  # the original norm on the converted input: no correction of upstream drift
                y, ye = _local_targets(model.get_submodule(n), x, xe)
            routed = route and extra is not None and n in extra.dims
            new, out = _fit_site(site, new, (x, y), (xe, ye) if routed else None, config, spec)
            swapped[n] = swap(model, n, new)
            bar.set_postfix_str(f"{n}: rel. error {out.rel_error:.3f}")
        path["seconds"] = round(time.perf_counter() - t0, 2)
    except BaseException:
        for n, old in swapped.items():  # all or nothing: put the original norms back
            swap(model, n, old)
        raise
    finally:
        model.train(was_training)
    return decision, path, kept


def _before_formation(model: nn.Module, extra: MassiveRows, order: list[str], seen: _OriginalPass, c) -> dict:
    """The sites before the massive activation forms (`normlab.conversion.calibrate.massive.formation_site`), each with
    the
    reason it keeps its original norm; none when it never forms or forms at the first site."""
    if not extra.ready:
        return {}
    pairs = extra.inputs if extra.inputs is not None else early_rows(model, extra.pairs, extra.dims, "in")
    rows = {n: torch.cat([*seen.sample[n].tensors(), pairs[n]]) for n in pairs}
    medians = {n: float(torch.tensor(v).median()) for n, v in seen.medians.items() if v}
    at = formation_site(rows, order, medians, c.massive)
    if at is None:
        return {}
    why = (
        f"before the massive activation forms ({at}): the tokens that will carry it are not told apart here, and "
        "a shared element-wise norm keeps it from forming (calibrate.massive_tokens=route converts it)"
    )
    return {n: why for n in order[: order.index(at)]}


def _fit_site(site: Site, new: nn.Module, rows: tuple, extra: tuple | None, config: ConvertConfig, spec: NormSpec):
    """One site's fit on its calibration rows (x, y) and, where massive tokens are routed, the ``extra`` rows of the
    [t, t] pairs (None: not routed). With a `detector` that separates the site's massive rows, those get their own
    copy, fitted per channel, and the shared replacement fits the rest; else the shared one fits all. Massive tokens
    no detector separates stay out of the shared fit. Fills in the site's record; returns the module to swap in and
    the shared fit's outcome."""
    c, (x, y) = config.calibrate, rows
    xe, ye = extra if extra is not None else (x[:0], y[:0])
    finite = x[torch.isfinite(x).all(-1)]
    typical = float(finite.pow(2).mean(-1).sqrt().median()) if extra is not None and len(finite) else None
    found = detector(torch.cat([x, xe]), c.massive, median=typical) if extra is not None else None
    twin = out_massive = None
    if found is not None:
        pool_x, pool_y = torch.cat([x, xe]), torch.cat([y, ye])
        heavy = found.route(pool_x)
        twin = _massive_copy(new, site, spec)
        out_massive = fit_replacement(twin, found.rescale(pool_x[heavy]), pool_y[heavy], per_channel=True, config=c)
        site.massive = found.to_dict()
        light = ~found.route(x)
        x, y = x[light], y[light]
    x, y = _drop_massive(site, x, y, c.massive)
    out = fit_replacement(new, x, y, per_channel=config.per == "channel", config=c)
    _record(site, out, out_massive, config.per)
    if found is None:
        return new, out
    return found.module(new, twin), out


def _path(stream: BlockStream | None, sequential: bool, order: list[str]) -> dict:
    """How the sites' inputs are taken, for the record: "blocks" (a block stream), "prefix" (passes of the whole
    converted model up to each site) or "original" (one pass of the original, ``sequential=False``)."""
    if not sequential:
        return {"path": "original", "why": "sequential=False: every site on the original model's activations"}
    if stream is None or stream.broken is not None:
        why = (
            stream.broken
            if stream is not None
            else "no decoder blocks found (no nn.ModuleList of blocks holding the sites)"
        )
        return {"path": "prefix", "why": why}
    outside = [n for n in order if not stream.serves(n)]
    return {"path": "blocks", "blocks": f"{stream.prefix} ({stream.n})", "memory_mb": round(stream.memory() / 2**20, 1),
            "outside": outside}  # fmt: skip
