"""Fitting one replacement to a site's data: its parameter (DyISRU/ELN beta, DyT alpha) and an amplitude folded into
its weight, so that new(x) reproduces the original norm's output y after its affine (`fit_replacement`).

The start point is Theorem 3 of the DyISRU paper: DyISRU equals RMSNorm when beta_i = ||x without channel i||^2, so
beta starts at the median of that quantity over the tokens, and the DyT family starts at the matching slope. Two
solvers: "profile" (float32, every channel at once: the amplitude in closed form and a one-dimensional search over
the parameter) and "lbfgs" (float64 L-BFGS over the parameter, the amplitude and the target's linear extras, which
Derf's shift needs). `normlab.conversion.calibrate.sites` runs them site by site.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.func import functional_call

from normlab.conversion.config import CalibrateConfig
from normlab.registry import NormSpec, norm_spec

__all__ = ["FitOutcome", "fit_replacement", "HOMOGENEOUS"]

# Targets whose f(alpha x) is alpha f(x) (the linear `fixed_scale`): an amplitude in the weight would only repeat
# alpha, so alpha alone is fitted (a one-dimensional least squares), and "linear over the data" is what they are.
HOMOGENEOUS = ("fixed_scale",)


@dataclass
class FitOutcome:
    param_name: str
    value: float  # the fitted parameter (its mean when per channel)
    amplitude: float  # factor folded into the weight (mean when per channel)
    rel_error: float  # ||y_fit - y|| / ||y|| on the fitted tokens
    start_error: float  # the same at the start point (Theorem 3, then the scan)
    ok: bool
    notes: list[str]
    explained: float | None = None  # the share of the target's variance (about each channel's mean) the fit
    # explains; None when the target does not vary (e.g. one repeated first token)
    solver: str = "lbfgs"  # "profile" (float32, amplitude in closed form) or "lbfgs" (float64); fit_replacement

    def to_dict(self) -> dict:
        return {
            "param_name": self.param_name,
            "value": self.value,
            "amplitude": self.amplitude,
            "rel_error": self.rel_error,
            "start_error": self.start_error,
            "converged": self.ok,
            "explained": self.explained,
            "solver": self.solver,
        }


@dataclass(frozen=True)
class _Problem:
    """One fit's settings: the fitted parameter's name, one per channel or one, whether the amplitude is fitted, and
    the solver's iterations (L-BFGS's, or the profile search's golden-section steps)."""

    spec: NormSpec
    per: bool
    fit_amplitude: bool
    iters: int

    @property
    def name(self) -> str:
        return self.spec.fits


def _spec_of(new: nn.Module) -> NormSpec:
    """The registry's facts about ``new``, which must have a parameter a calibration fits."""
    spec = norm_spec(new.registry_name) if hasattr(new, "registry_name") else None
    if spec is None or spec.fits is None:
        raise ValueError(f"{type(new).__name__} has no parameter a calibration fits (the registry's `fits`)")
    return spec


def _start(new: nn.Module, x: Tensor, problem: _Problem) -> Tensor:
    """Theorem 3 start: beta_i = median over tokens of ||x without i||^2; DyT: the slope that matches it."""
    per_channel, name = problem.per, problem.name
    z = x - x.mean(-1, keepdim=True) if problem.spec.centred else x
    rest = (z.pow(2).sum(-1, keepdim=True) - z.pow(2)).clamp_min(1e-30)  # (N, C)
    beta = rest.median(0).values if per_channel else rest.median().reshape(1)
    if name == "log_beta":
        return beta.log()
    c = x.shape[-1]
    built_in = getattr(new, "scale", None)
    amp = math.sqrt(c) if isinstance(built_in, str) else 1.0  # scaled_dyt carries sqrt(C); dyt 1
    return (c / beta).sqrt() / amp  # alpha: amp * alpha = sqrt(C / beta), DyISRU's slope at 0


def _coarse_scan(out, x: Tensor, y: Tensor, p0: Tensor, la0: Tensor, fit_amplitude: bool) -> tuple[Tensor, Tensor]:
    """A coarse scan over the parameter's scale (and the amplitude) in log steps, per channel when the parameter is
    per channel, on at most 512 tokens: the start point of L-BFGS."""
    sub = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))[:512]
    col = lambda p, la: (out(p, la, x[sub]) - y[sub]).pow(2).mean(0)  # noqa: E731  (C,) loss per channel
    on = {"dtype": torch.float64, "device": x.device}
    steps = torch.arange(-8.0, 8.5, 1.0, **on)
    amps = torch.arange(-4.0, 4.5, 1.0, **on) if fit_amplitude else torch.zeros(1, **on)
    grid = [(d, e) for d in steps for e in amps]
    losses = torch.stack([col(p0 + d, la0 + e) for d, e in grid])  # (trials, C)
    losses = torch.where(torch.isfinite(losses), losses, torch.inf)
    if p0.numel() > 1:  # channels are independent: the best trial for each
        pick = losses.argmin(0)
    else:
        pick = losses.sum(1).argmin().expand(1)
    if bool(torch.isfinite(losses.gather(0, pick[None].expand(1, losses.shape[1]))).all()):
        p0 = p0 + torch.stack([grid[int(i)][0] for i in pick])
        la0 = la0 + torch.stack([grid[int(i)][1] for i in pick])
    return p0, la0


def _degenerate(name: str, value: Tensor, x: Tensor) -> list[str]:
    """Notes on a fit that makes the replacement linear over the data (beta >> x^2, or alpha max|x| < 0.01)."""
    xmax2 = float(x.pow(2).max())
    if name == "log_beta" and float(value.min()) > 1e4 * xmax2:
        return [f"degenerate: beta {float(value.min()):.3g} >> every x^2 (max {xmax2:.3g}); linear over the data"]
    if name == "alpha" and float(value.max()) * math.sqrt(xmax2) < 1e-2:
        return ["degenerate: alpha * max|x| < 0.01; linear over the data"]
    return []


def _lbfgs(loss, p0: Tensor, la0: Tensor, q0: list[Tensor], problem: _Problem, notes: list):
    """L-BFGS from the start point over the parameter, the amplitude (if fitted) and the linear extras; returns
    them and the final loss (NaN, with a note, when L-BFGS fails)."""
    p = p0.clone().requires_grad_(True)
    fit_amplitude = problem.fit_amplitude
    la = la0.clone().requires_grad_(fit_amplitude)
    qs = [q.clone().requires_grad_(True) for q in q0]
    opt = torch.optim.LBFGS(
        [p, la, *qs] if fit_amplitude else [p, *qs],
        max_iter=problem.iters,
        line_search_fn="strong_wolfe",
        tolerance_grad=1e-12,
        tolerance_change=1e-15,
    )

    def closure():
        opt.zero_grad()
        value = loss(p, la, qs)
        value.backward()
        return value

    try:
        opt.step(closure)
        final = float(loss(p, la, qs).detach())
    except (RuntimeError, ValueError) as e:  # noqa: PERF203
        final = math.nan
        notes.append(f"L-BFGS failed ({e})")
    return p, la, qs, final


def _profile_fit(new: nn.Module, x: Tensor, y: Tensor, problem: _Problem):
    """The fit as a search over the parameter alone, in float32, every channel at once (``per``).

    Every fitted norm is ``weight * g(x; p) + bias``, so its output at amplitude a is v + a (u - v), with u the
    output at the copied weight and v at weight 0: for each p the best amplitude is closed form (least squares,
    kept > 0), and what is left is a one-dimensional search over log p per channel. A grid in steps of 1 around
    the Theorem 3 start (+-8, walked on past its ends while that improves), then golden-section search within one
    step of the grid's best (a unimodal loss has its minimum there), every token each time. Returns (log p, log
    amplitude, the start's loss, the final loss), the losses as means over tokens and channels."""
    name, per, fit_amplitude = problem.name, problem.per, problem.fit_amplitude
    module = copy.deepcopy(new).float().requires_grad_(False).to(x.device)  # fitted where the rows are (the CPU)
    x, y = x.float(), y.float()
    w0, param = module.weight.detach().clone(), getattr(module, name)
    shape = param.shape
    with torch.no_grad():
        module.weight.zero_()
        v = module(x)  # the output at weight 0: the bias, whatever p is
        module.weight.copy_(w0)
    r = y - v

    def losses(p: Tensor) -> tuple[Tensor, Tensor]:
        """Per channel (or one, summed) squared error at log-parameter p with its best amplitude, and that amplitude's
        log."""
        with torch.no_grad():
            param.copy_((p if name == "log_beta" else p.exp()).expand(shape))
            g = module(x) - v
            dims = (0,) if per else (0, 1)
            if fit_amplitude:
                a = ((g * r).sum(dims) / (g * g).sum(dims)).clamp_min(1e-6).nan_to_num(1.0)
            else:
                a = torch.ones((), device=x.device)
            e = (a * g - r).pow(2).sum(dims) * torch.ones_like(p)
        return torch.where(torch.isfinite(e), e, torch.inf), a.log() * torch.ones_like(p)

    start = _start(new, x.double(), problem).float()
    p0 = start if name == "log_beta" else start.log()
    grid = p0 + torch.arange(-8.0, 8.5, 1.0, device=p0.device)[:, None]  # (17, p)
    scan = torch.stack([losses(q)[0] for q in grid])
    pick = scan.argmin(0)
    p0, f0 = grid.gather(0, pick[None])[0], scan.gather(0, pick[None])[0]
    step = torch.where(pick == 0, -1.0, torch.where(pick == len(grid) - 1, 1.0, 0.0))
    for _ in range(16):  # a best point at the grid's end: walk on, one step at a time, while it improves
        if not bool(step.any()):
            break
        fq = losses(p0 + step)[0]
        better = (step != 0) & (fq < f0)
        p0, f0, step = torch.where(better, p0 + step, p0), torch.where(better, fq, f0), torch.where(better, step, 0.0)
    f0, la0 = losses(p0)
    p, f = _golden(lambda q: losses(q)[0], p0 - 1.0, p0 + 1.0, problem.iters)
    f, la = losses(p)
    better = f <= f0  # per channel: never worse than the start
    p, la, f = torch.where(better, p, p0), torch.where(better, la, la0), torch.where(better, f, f0)
    n = x.numel()
    return p.double(), la.double(), float(f0.sum()) / n, float(f.sum()) / n


def _golden(loss, lo: Tensor, hi: Tensor, iters: int) -> tuple[Tensor, Tensor]:
    """Golden-section search of ``loss`` (one value per entry) over [lo, hi], every entry at once; returns the best
    point and its loss."""
    gr = (math.sqrt(5.0) - 1.0) / 2.0
    c, d = hi - gr * (hi - lo), lo + gr * (hi - lo)
    fc, fd = loss(c), loss(d)
    for _ in range(iters):
        left = fc <= fd  # the minimum lies in [lo, d]: d becomes the upper end, c the new d
        lo, hi = torch.where(left, lo, c), torch.where(left, d, hi)
        kept_x, kept_f = torch.where(left, c, d), torch.where(left, fc, fd)
        fresh = torch.where(left, hi - gr * (hi - lo), lo + gr * (hi - lo))
        ff = loss(fresh)
        c, fc = torch.where(left, fresh, kept_x), torch.where(left, ff, kept_f)
        d, fd = torch.where(left, kept_x, fresh), torch.where(left, kept_f, ff)
    best = fc <= fd
    return torch.where(best, c, d), torch.where(best, fc, fd)


def fit_replacement(
    new: nn.Module,
    x: Tensor,
    y: Tensor,
    *,
    per_channel: bool = False,
    config: CalibrateConfig | None = None,
    max_iter: int = 60,
) -> FitOutcome:
    """Fit ``new``'s parameter and an amplitude (folded into its weight) so that new(x) reproduces y.

    ``new`` is updated in place; on a failed fit it keeps the start point and the outcome says so.

    Args:
        new: the replacement, a registered norm with a parameter to fit (`NormSpec.fits`).
        x: (N, C), the replacement's input.
        y: (N, C), the original norm's output after its affine.
        per_channel: one parameter and one amplitude per channel (else one each).
        config: the calibration's settings (default: its defaults); the fit reads two of them.
            ``fit_amplitude``: also fit the amplitude (else the module's own is kept). ``solver``: "profile"
            searches the parameter with the amplitude in closed form, in float32, every channel at once; "lbfgs"
            runs L-BFGS in float64 over the parameter, the amplitude and the target's linear extras (Derf's shift);
            "auto": "profile" unless the target has such extras.
        max_iter: bounds L-BFGS; the profile search takes ``max_iter // 3`` golden-section steps (the default 20
            end within 2e-4 in log p).

    Returns:
        The fit's outcome: the fitted value and amplitude, the relative error at the start and at the end, the
        share of the target's variance explained, whether it is ok, and notes (tokens left out, a degenerate or
        failed fit).
    """
    config = CalibrateConfig() if config is None else config
    spec, solver = _spec_of(new), config.solver
    name, linear = spec.fits, spec.also_fits  # the extras are fitted as they are, from their init (Derf's shift)
    if solver == "auto":
        solver = "lbfgs" if linear else "profile"
    if solver not in ("profile", "lbfgs") or (solver == "profile" and linear):
        raise ValueError(f"solver: 'profile' (targets without extras), 'lbfgs' or 'auto', got {solver!r}")
    notes: list[str] = []
    x, y = x.detach(), y.detach()  # data, not a graph (a target computed with gradients on, "local")
    finite = torch.isfinite(x).all(-1) & torch.isfinite(y).all(-1)
    if not bool(finite.all()):
        notes.append(f"{int((~finite).sum())} token(s) with NaN/Inf left out")
        x, y = x[finite], y[finite]
    if len(x) < 2:
        return FitOutcome(name, *[math.nan] * 4, False, notes + ["no finite calibration tokens: default init kept"])
    shape = getattr(new, name).shape
    per = per_channel and shape[0] > 1
    q0 = [getattr(new, k).detach().double().clone() for k in linear]
    iters = max(1, max_iter // 3) if solver == "profile" else max_iter
    amplitude = config.fit_amplitude and spec.name not in HOMOGENEOUS  # alpha is the amplitude there
    problem = _Problem(spec, per, amplitude, iters)
    if solver == "profile":  # its result is never worse than its start, channel by channel: the start is itself
        p, la, start_loss, final = _profile_fit(new, x, y, problem)
        p0, la0, qs = p, la, q0
    else:
        p, la, qs, final, (p0, la0, start_loss) = _lbfgs_fit(new, x, y, problem, notes)
    x, y = x.double(), y.double()
    denom = float(y.pow(2).mean().sqrt()) or 1.0
    ok = True
    if not math.isfinite(final) or final > start_loss:
        notes.append("fit did not improve on its start (non-finite or worse): start point kept")
        p, la, qs, final, ok = p0, la0, q0, start_loss, False
    if not math.isfinite(final):
        notes.append("fit is NaN: default init kept")
        return FitOutcome(name, math.nan, math.nan, math.nan, math.nan, False, notes)
    p, la = p.detach(), la.detach()
    value = p.exp()  # beta, or alpha
    degenerate = [] if spec.name in HOMOGENEOUS else _degenerate(name, value, x)  # linear by design there
    notes += degenerate
    ok = ok and not degenerate
    with torch.no_grad():  # into the module: the parameter, the amplitude (into the weight), the linear extras
        getattr(new, name).copy_((p if name == "log_beta" else value).to(getattr(new, name)).expand(shape))
        new.weight.mul_(la.exp().to(new.weight))
        for k, q in zip(linear, qs):
            getattr(new, k).copy_(q.detach().to(getattr(new, k)))
    variance = float((y - y.mean(0)).pow(2).mean())
    explained = 1.0 - final / variance if variance > 0 else None
    errors = (math.sqrt(final) / denom, math.sqrt(start_loss) / denom)
    return FitOutcome(
        name.removeprefix("log_"), float(value.mean()), float(la.exp().mean()), *errors, ok, notes, explained, solver
    )


def _lbfgs_fit(new: nn.Module, x: Tensor, y: Tensor, problem: _Problem, notes: list):
    """The float64 fit by L-BFGS from the coarse scan's point, over the parameter, the amplitude and the linear extras;
    returns (p, log amplitude, extras, final loss, (the start's p, log amplitude and loss))."""
    name = problem.name
    x, y = x.double(), y.double()
    on = {"dtype": torch.float64, "device": x.device}  # fitted where the rows are (the CPU)
    w0 = new.weight.detach().to(**on)
    linear = problem.spec.also_fits
    others = {k: v.detach().to(**on) for k, v in new.named_parameters() if k not in (name, "weight", *linear)}
    q0 = [getattr(new, k).detach().to(**on).clone() for k in linear]
    shape = getattr(new, name).shape
    module = copy.deepcopy(new).to(**on)

    def out(p: Tensor, log_amp: Tensor, inputs: Tensor = x, qs: list[Tensor] = q0) -> Tensor:
        theta = p if name == "log_beta" else p.exp()  # both fitted in log space: they stay > 0
        params = {name: theta.expand(shape), "weight": w0 * log_amp.exp(), **others, **dict(zip(linear, qs))}
        return functional_call(module, params, (inputs,))

    def loss(p: Tensor, log_amp: Tensor, qs: list[Tensor] = q0) -> Tensor:
        return (out(p, log_amp, qs=qs) - y).pow(2).mean()

    start = _start(new, x, problem)
    p0 = start if name == "log_beta" else start.log()
    la0 = torch.zeros_like(p0)
    with torch.no_grad():
        p0, la0 = _coarse_scan(out, x, y, p0, la0, problem.fit_amplitude)
        start_loss = float(loss(p0, la0))
    p, la, qs, final = _lbfgs(loss, p0, la0, q0, problem, notes)
    return p, la, qs, final, (p0, la0, start_loss)
