"""Massive tokens: the few tokens to which real LLMs give an activation 30-200x the median token's in a few fixed
channels (the attention sinks). They sit at the first position *and* at early delimiter tokens: Sun et al. 2024,
"Massive Activations in Large Language Models" (arXiv 2402.17762). In SmolLM2-135M-Instruct channel 507 of the
residual stream carries about 22,000-25,000 at such a token from block 4 on, against at most about 300 at any
other token.

No element-wise function maps both those and ordinary tokens, so a site where they occur gets a second copy of its
replacement for them (`MassiveTokens`). A token is routed by what it is, not where it is: its largest magnitude
over the few channels that carry the massive activation, against a threshold fitted in calibration. The rule
therefore holds wherever a massive token occurs (position 0, a "\\n\\n" at position 1, a delimiter mid-sequence),
in a left-padded batch, for a chunk after a KV cache and for a one-token call alike. An ordinary token's output
element depends on its own input element alone; the route reads ``len(channels)`` values of each token (4 by
default), against the C values an RMSNorm reduces. A massive token is rescaled by the L2 norm of those same values
before its copy: those channels carry nearly all of its RMS, so the copy sees every massive token at one size,
as the norm does. Without it, Qwen2.5-Coder-0.5B's first tokens, whose RMS varies by 14% (coefficient of
variation) at most sites, lose 14% of their accuracy at every site (the best per-channel linear map's relative
error), against 0.1% rescaled.

The massive copy is fitted per channel on every massive row calibration sees: the calibration sequences' own, and
positions 0 and 1 of two-token sequences ``[t, t]`` for every distinct calibration token ``t`` (a causal model's
first positions see nothing else, so these cover the first tokens and the doubled delimiters no calibration
sequence started with). Fitted on the first tokens of the calibration sequences alone, SmolLM2-135M's copies once
broke a held-out sequence that began with ";" (+11.5 nats on it).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from normlab.conversion.batches import Stop, input_ids, run_hooked
from normlab.conversion.calibrate.stream import BlockStream

__all__ = [
    "EARLY",
    "Detector",
    "formation_site",
    "MassiveRows",
    "MassiveTokens",
    "detector",
    "early_rows",
    "early_token_batches",
    "massive_decision",
    "massive_ratio",
]

EARLY = 2  # the positions of the two-token sequences whose rows the massive copy's fit sees


class MassiveTokens(nn.Module):
    """A norm with its own copy for massive tokens: a token (a row of the last axis) whose largest magnitude over
    ``channels`` exceeds ``threshold`` goes through ``massive``, every other through ``main``.

    With a ``reference``, a massive token is first rescaled so that its ``channels`` have that L2 norm: the massive
    copy then sees every massive token at one size, as the norm it replaces does (those few channels carry nearly
    all of such a token's RMS). The route already reads these values; rescaling adds one multiply per element.
    Without it, the massive copy maps raw values, and a token whose massive activation is 14% larger than
    calibration's comes out 14% too large in every channel (Qwen2.5-Coder-0.5B's first tokens vary that much).

    Where any row is massive, both copies run on every row and `torch.where` picks (no data-dependent shapes); a
    call with none (a decoding step, most chunks) runs ``main`` alone. Under ``torch.export`` (an ONNX export) that
    branch is a ``torch.cond`` (an ONNX ``If``); under ``torch.compile`` both copies always run. A NaN in the
    channels routes its row to ``main``.

    Args:
        main: The replacement for ordinary tokens.
        massive: The replacement for massive tokens.
        channels: The channels that carry the massive activation (indices into the last axis).
        threshold: The magnitude above which a token is massive.
        reference: The L2 norm over ``channels`` a massive token is rescaled to; None: not rescaled.
    """

    def __init__(
        self, main: nn.Module, massive: nn.Module, channels: list[int], threshold: float, reference: float | None = None
    ) -> None:
        super().__init__()
        self.main = main
        self.massive = massive
        self.channels = [int(c) for c in channels]
        self.threshold = float(threshold)  # plain values, not buffers: a model built on the meta device keeps them
        self.reference = None if reference is None else float(reference)

    def forward(self, x: Tensor) -> Tensor:
        carriers = x[..., self.channels]
        heavy = carriers.abs().amax(-1, keepdim=True) > self.threshold  # (..., 1)
        if getattr(torch.compiler, "is_exporting", bool)():  # bool() is False: torch < 2.5
            return torch.cond(heavy.any(), self._routed, self._plain, (x, carriers, heavy))
        if torch.compiler.is_compiling() or bool(heavy.any()):
            return self._routed(x, carriers, heavy)
        return self.main(x)

    def rescaled(self, x: Tensor, carriers: Tensor, heavy: Tensor) -> Tensor:
        """``x`` with each massive row rescaled to ``reference`` over the channels (``carriers``: those values);
        the other rows, whose rescaled values nothing reads, pass as they are (no division by their small norm)."""
        if self.reference is None:
            return x
        squares = carriers.float().pow(2).sum(-1, keepdim=True)  # float32: 25,000 squared overflows float16
        squares = torch.where(heavy, squares, self.reference**2)  # the other rows: a factor of 1
        return x * (self.reference * squares.rsqrt()).to(x.dtype)

    def _routed(self, x: Tensor, carriers: Tensor, heavy: Tensor) -> Tensor:
        return torch.where(heavy, self.massive(self.rescaled(x, carriers, heavy)), self.main(x))

    def _plain(self, x: Tensor, carriers: Tensor, heavy: Tensor) -> Tensor:
        return self.main(x)

    def extra_repr(self) -> str:
        size = "" if self.reference is None else f", reference={self.reference:.4g}"
        return f"channels={self.channels}, threshold={self.threshold:.4g}{size}"


@dataclass(frozen=True)
class Detector:
    """How a site tells its massive tokens: the channels that carry them, the threshold, the margin it was set
    with (the smallest massive token's score over the largest ordinary one's, on the calibration rows), and the
    median L2 norm of the massive rows over the channels, to which `MassiveTokens` rescales them."""

    channels: tuple[int, ...]
    threshold: float
    margin: float
    massive_rows: int
    reference: float

    def route(self, x: Tensor) -> Tensor:
        """Which rows of ``x`` (N, C) are massive."""
        return x[:, list(self.channels)].abs().amax(-1) > self.threshold

    def rescale(self, x: Tensor) -> Tensor:
        """Massive rows ``x`` (N, C) as the massive copy sees them (`MassiveTokens.rescaled`)."""
        pair = self.module(nn.Identity(), nn.Identity())
        return pair.rescaled(x, x[:, pair.channels], x.new_ones(len(x), 1, dtype=torch.bool))

    def module(self, main: nn.Module, massive: nn.Module) -> MassiveTokens:
        """The site's pair of replacements, routed and rescaled by this detector."""
        return MassiveTokens(main, massive, list(self.channels), self.threshold, self.reference)

    def to_dict(self) -> dict:
        return {
            "channels": list(self.channels),
            "threshold": self.threshold,
            "margin": round(self.margin, 2),
            "massive_rows": self.massive_rows,
            "reference": self.reference,
        }


def detector(
    x: Tensor, massive: float, n_channels: int = 4, min_margin: float = 4.0, median: float | None = None
) -> Detector | None:
    """The channels and threshold that separate a site's massive rows from the rest, or None when it has none or
    they do not separate by a factor ``min_margin``.

    A row is massive when its RMS is above ``massive`` x the median row's (``median``: that median RMS, taken from
    rows of ordinary text; the [t, t] pairs are massive at position 0 as often as not, so their own median is not).
    The channels are the ``n_channels`` with the largest mean magnitude over the massive rows; a row's score is its
    largest magnitude over them; the threshold is the geometric mean of the smallest massive score and the largest
    ordinary one.

    Args:
        x: The site's input rows (N, C), float.
        massive: The RMS ratio that makes a row massive.
        n_channels: How many channels the route reads.
        min_margin: The smallest ratio of the massive scores to the ordinary ones that is a clean cut.
        median: The median row RMS of ordinary text; None: the median of ``x``.
    """
    x = x[torch.isfinite(x).all(-1)]
    if len(x) < 2:
        return None
    rms = x.pow(2).mean(-1).sqrt()
    big = rms > massive * (rms.median() if median is None else median)
    if not bool(big.any()) or bool(big.all()):
        return None
    channels = x[big].abs().mean(0).topk(min(n_channels, x.shape[-1])).indices.sort().values
    score = x[:, channels].abs().amax(-1)
    lo, hi = float(score[~big].max()), float(score[big].min())
    if not hi > min_margin * max(lo, 1e-30):
        return None
    threshold = math.sqrt(hi * max(lo, 1e-30))
    reference = float(x[score > threshold][:, channels].norm(dim=-1).median())
    return Detector(tuple(channels.tolist()), threshold, hi / max(lo, 1e-30), int(big.sum()), reference)


def formation_site(rows: dict[str, Tensor], order: list[str], medians: dict[str, float], massive: float) -> str | None:
    """The first site, in run order, where the original model's massive rows separate by a few channels (where the
    massive activation has formed), or None.

    Before it, the tokens that will carry the activation are ordinary in magnitude, yet must pass faithfully for it
    to form: converted with a shared element-wise norm, SmolLM2-135M's sink never forms (held-out CE 4.34 -> 7.85
    per channel, against 5.15 with blocks 0-11 kept).

    Args:
        rows: Site name -> the original model's input rows at the [t, t] pairs (`early_rows`).
        order: The sites in the order the model runs them.
        medians: Site name -> the median token RMS of ordinary text there.
        massive: The RMS ratio that makes a row massive.
    """
    for n in order:
        if n in rows and detector(rows[n], massive, median=medians.get(n)) is not None:
            return n
    return None


def massive_ratio(x: Tensor) -> float:
    """The largest token RMS over the median token RMS of a site's input (..., C); nan for fewer than two tokens.

    Args:
        x: A site's input, channels last.
    """
    rms = x.detach().float().pow(2).mean(-1).sqrt().reshape(-1)
    if len(rms) < 2:
        return math.nan
    return float(rms.max() / rms.median().clamp_min(1e-30))


def massive_decision(ratios: dict[str, list[float]], order: list[str], choice: str, massive: float) -> tuple[bool, str]:
    """Whether any site may route massive tokens (``choice`` "auto" and some site's largest token RMS above
    ``massive`` x the median), and the sentence that says why.

    Args:
        ratios: Site name -> its largest token RMS over the median, per batch (`massive_ratio`).
        order: The sites in the order the model runs them.
        choice: The config's ``calibrate.massive_tokens``: "auto", "route" or "shared".
        massive: The ratio that makes a token massive.
    """
    worst = max(
        ((max((r for r in ratios[n] if r == r), default=math.nan), n) for n in order),
        key=lambda t: -math.inf if t[0] != t[0] else t[0],
    )
    if worst[0] != worst[0]:
        return False, "no sequence axis: one replacement per site"
    found = worst[0] > massive
    if choice == "shared":
        return False, f"massive tokens shared with the rest (calibrate.massive_tokens=shared; up to {worst[0]:.3g}x)"
    if not found:
        return False, f"no massive tokens: the largest token RMS is {worst[0]:.3g}x the median ({worst[1]})"
    return True, f"massive tokens routed to their own copy: RMS up to {worst[0]:.3g}x the median ({worst[1]})"


def early_token_batches(batches: list, max_tokens: int, size: int = 256) -> list[Tensor]:
    """Two-token sequences ``[t, t]`` for each distinct token ``t`` of the calibration batches (a seeded sample of
    ``max_tokens`` of them when there are more), in batches of ``size``; empty when the batches are not token ids
    (an image model's pixels, a dict with more than the ids).

    Args:
        batches: The calibration batches.
        max_tokens: The most distinct tokens used.
        size: Sequences per batch.
    """
    ids = []
    for b in batches:
        if isinstance(b, dict) and set(b) - {"input_ids"}:
            return []
        t = input_ids(b)
        if not isinstance(t, Tensor) or t.dim() != 2 or t.dtype not in (torch.int32, torch.int64):
            return []
        ids.append(t.reshape(-1))
    tokens = torch.unique(torch.cat(ids))
    if len(tokens) > max_tokens:
        tokens = tokens[torch.randperm(len(tokens), generator=torch.Generator().manual_seed(0))[:max_tokens]]
    return list(tokens[:, None].repeat(1, EARLY).split(size))


def early_rows(model: nn.Module, pairs: list, dims: dict[str, int], kind: str) -> dict[str, Tensor]:
    """Each site's input (``kind="in"``) or output ("out") at the positions of the two-token ``pairs``, in the model
    as it is now, channels last, (N * 2, C) in the order (sequence, position); each pass stops once every site has
    run. ``kind="both"`` takes both in the one pass: name -> the input's rows and the output's, side by side
    (N * 2, 2, C).

    Args:
        model: The model.
        pairs: The two-token batches (`early_token_batches`).
        dims: Site name -> its channel dim.
        kind: "in" for the sites' inputs, "out" for their outputs, "both" for both.
    """
    names = list(dims)
    rows = {n: [] for n in names}
    fired: set[str] = set()

    def hook(n):
        def grab(mod, args, y=None):
            x = args[0]
            if kind == "both":
                rows[n].append(torch.stack([_rows(x, dims[n]), _rows(y, dims[n])], 1))
            else:
                rows[n].append(_rows(x if kind == "in" else y, dims[n]))
            fired.add(n)
            if len(fired) == len(names):  # every site has run on this batch: the rest of the model is idle
                raise Stop

        return grab

    for i, batch in enumerate(pairs):
        fired.clear()
        run_hooked(model, batch, i, {n: hook(n) for n in names}, "pre" if kind == "in" else "out")
    return {n: torch.cat(r) for n, r in rows.items()}


class MassiveRows:
    """The massive copies' extra fitting data: positions 0 and 1 of ``[t, t]`` for every distinct calibration token
    (`early_token_batches`). The original model's output at every site is taken at once; a site's input is taken
    when asked, in the model as converted so far (``sequential``), or at once in the original (``sequential=False``).
    ``ready`` is False when the batches are not token ids: the calibration sequences' own rows are then all there is.

    Args:
        model: The model.
        batches: The calibration batches.
        dims: Site name -> its channel dim.
        max_tokens: The most distinct tokens used (a seeded sample beyond).
        sequential: Take each site's input in the model as converted so far (else at once in the original).
        stream: A `BlockStream` of the pairs that serves the inputs block by block; None: hooked passes.
    """

    def __init__(
        self,
        model: nn.Module,
        batches: list,
        dims: dict[str, int],
        max_tokens: int,
        sequential: bool,
        stream: BlockStream | None = None,
    ):
        self.pairs, self.dims = early_token_batches(batches, max_tokens), dims
        self.ready = bool(self.pairs)
        self.stream = stream if self.ready else None  # a BlockStream of the pairs, recorded in the targets' pass
        self.inputs = None
        if self.ready and not sequential and self.stream is None:  # both from the one pass of the original
            both = early_rows(model, self.pairs, dims, "both")
            self.inputs, self.targets = ({n: r[:, k] for n, r in both.items()} for k in (0, 1))
            return
        tail = [n for n in dims if self.stream is not None and self.stream.block_of(n) is None]
        with self.stream.record(tail) if self.stream is not None else contextlib.nullcontext():
            self.targets = early_rows(model, self.pairs, dims, "out") if self.ready else {}

    def __call__(self, model: nn.Module, name: str) -> tuple[Tensor, Tensor]:
        """Site ``name``'s (input, original output) rows at the pairs' positions."""
        if self.inputs is not None:
            return self.inputs[name], self.targets[name]
        s = self.stream
        if s is not None and s.serves(name):  # the pairs' block stream
            rows: list[Tensor] = []
            s.site_inputs(name, self.pairs, lambda t, i: rows.append(_rows(t, self.dims[name])))
            return torch.cat(rows), self.targets[name]
        return early_rows(model, self.pairs, {name: self.dims[name]}, "in")[name], self.targets[name]


def _rows(t: Tensor, dim: int) -> Tensor:
    """A site's rows at the pairs' positions, channels last, float32 on the CPU."""
    t = t.detach().movedim(dim, -1)
    return t[:, :EARLY, :].reshape(-1, t.shape[-1]).float().cpu()
