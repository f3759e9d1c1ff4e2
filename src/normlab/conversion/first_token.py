"""The first token of a sequence, which real LLMs make an attention sink (an RMS 30-200x the median token's at
some sites): whether it gets its own replacement, the data its fit sees, and the module that applies it.

A causal model's first position attends only to itself, so its activations at every site are a function of its
token alone. The first-token copy is therefore fitted on every distinct token of the calibration text put first
(two-token sequences), not on the few first tokens of the calibration sequences: fitted on the 8 first tokens of 8
sequences, SmolLM2-135M's first-token copies broke a held-out sequence that began with ";" (+11.5 nats on it).
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import Tensor, nn

from normlab.conversion.batches import Stop, input_ids, run_hooked
from normlab.conversion.stream import BlockStream

__all__ = ["FirstRows", "FirstToken", "first_rows", "first_token_batches", "first_token_decision", "first_token_ratio"]


class FirstToken(nn.Module):
    """A norm with its own copy for the first token of each sequence: ``first`` at index 0 of the sequence axis.

    Input (..., T, C). A call with T = 1 is treated as a later token (one decoding step with a KV cache after a
    prompt of at least two tokens); index 0 of any call with T >= 2 is the first token. Chunked prefill,
    where a later chunk starts mid-sequence, is not supported.

    Under ``torch.export`` (an ONNX export) the branch on T is a ``torch.cond`` (an ONNX ``If``), so that the
    exported graph keeps T dynamic and a decoding step runs the main copy alone.

    Args:
        main: The replacement for every later token.
        first: The replacement for the first token.
    """

    def __init__(self, main: nn.Module, first: nn.Module) -> None:
        super().__init__()
        self.main = main
        self.first = first

    def forward(self, x: Tensor) -> Tensor:
        if getattr(torch.compiler, "is_exporting", bool)() and x.dim() >= 2:  # bool() is False: torch < 2.5
            return torch.cond(x.shape[-2] >= 2, self._at_index_0, self.main, (x,))  # an ONNX If: T stays dynamic
        if x.dim() < 2 or x.shape[-2] < 2:
            return self.main(x)
        return torch.cat([self.first(x[..., :1, :]), self.main(x[..., 1:, :])], dim=-2)

    def _at_index_0(self, x: Tensor) -> Tensor:
        """The first copy at index 0 and the main one after it, with no slice of T - 1 tokens (torch.export would
        fix that size)."""
        first = (torch.arange(x.shape[-2], device=x.device) == 0).unsqueeze(-1)
        return torch.where(first, self.first(x[..., :1, :]), self.main(x))


def first_token_ratio(x: Tensor) -> float:
    """RMS of the first token over the median token RMS, for inputs (B, T, C); nan when T < 2 or when the input is
    not a sequence (an image's (N, H, W, C) has no first token).

    Args:
        x: A site's input, (B, T, C).
    """
    if x.dim() != 3 or x.shape[-2] < 2:
        return math.nan
    rms = x.detach().float().pow(2).mean(-1).sqrt()  # (B, T)
    return float(rms[..., 0].median() / rms.median().clamp_min(1e-30))


@torch.no_grad()
def first_token_decision(
    ratios: dict[str, list[float]], order: list[str], first_token: str, massive: float
) -> tuple[bool, str]:
    """Whether the first token gets its own replacement, and the sentence that says why: the largest ratio of the
    first token's RMS to the median token's over the sites (NaN when there is no sequence axis).

    Args:
        ratios: Site name -> the first token's RMS over the median token's, per batch.
        order: The sites in the order the model runs them.
        first_token: The config's choice: "auto", "own" or "shared".
        massive: The ratio above which "auto" gives the first token its own replacement.
    """
    worst = max(
        ((max((r for r in ratios[n] if r == r), default=math.nan), n) for n in order),
        key=lambda t: -math.inf if t[0] != t[0] else t[0],
    )
    own = first_token == "own" or (first_token == "auto" and worst[0] == worst[0] and worst[0] > massive)
    if worst[0] != worst[0]:
        return own, "no sequence axis: one replacement per site"
    return (
        own,
        f"first token {'own' if own else 'shared'}: its RMS is up to {worst[0]:.3g}x the median token's ({worst[1]})",
    )


def first_token_batches(batches: list, max_tokens: int, size: int = 256) -> list[Tensor]:
    """Two-token sequences whose first token is each distinct token of the calibration batches (a seeded sample of
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
    return list(tokens[:, None].repeat(1, 2).split(size))


def first_rows(model: nn.Module, firsts: list, dims: dict[str, int], kind: str) -> dict[str, Tensor]:
    """Each site's input (``kind="in"``) or output ("out") at position 0 of the two-token ``firsts``, in the model as
    it is now, channels last (``dims``: site name -> its channel dim); each pass stops once every site has run.

    Args:
        model: The model.
        firsts: The two-token batches (`first_token_batches`).
        dims: Site name -> its channel dim.
        kind: "in" for the sites' inputs, "out" for their outputs.
    """
    names = list(dims)
    rows = {n: [] for n in names}

    fired: set[str] = set()

    def hook(n):
        def grab(mod, args, y=None):
            rows[n].append(_position0(args[0] if kind == "in" else y, dims[n]).cpu())  # kept on the CPU, as _Rows
            fired.add(n)
            if len(fired) == len(names):  # every site has run on this batch: the rest of the model is idle
                raise Stop

        return grab

    for i, batch in enumerate(firsts):
        fired.clear()
        run_hooked(model, batch, i, {n: hook(n) for n in names}, "pre" if kind == "in" else "out")
    return {n: torch.cat(r) for n, r in rows.items()}


class FirstRows:
    """The first token's fitting data at each site: every distinct calibration token put first (first_token_batches).
    The original model's output at every site is taken at once; a site's input is taken when asked, in the model as
    converted so far (``sequential``), or at once in the original model (``sequential=False``). ``ready`` is False
    when the batches are not token ids: the calibration sequences' own first tokens are then all there is.

    Args:
        model: The model.
        batches: The calibration batches.
        dims: Site name -> its channel dim.
        max_tokens: The most distinct first tokens used (a seeded sample beyond).
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
        self.firsts, self.dims = first_token_batches(batches, max_tokens), dims
        self.ready = bool(self.firsts)
        self.stream = stream if self.ready else None  # a BlockStream of the pairs, recorded in the targets' pass
        tail = [n for n in dims if self.stream is not None and self.stream.block_of(n) is None]
        with self.stream.record(tail) if self.stream is not None else contextlib.nullcontext():
            self.targets = first_rows(model, self.firsts, dims, "out") if self.ready else {}
        self.inputs = first_rows(model, self.firsts, dims, "in") if self.ready and not sequential else None

    def __call__(self, model: nn.Module, name: str) -> tuple[Tensor, Tensor]:
        """Site ``name``'s (input, original output) rows at the first position."""
        if self.inputs is not None:
            return self.inputs[name], self.targets[name]
        s = self.stream
        if s is not None and s.serves(name):  # the pairs' block stream
            rows: list[Tensor] = []
            s.site_inputs(name, self.firsts, lambda t, i: rows.append(_position0(t, self.dims[name]).cpu()))
            return torch.cat(rows), self.targets[name]
        return first_rows(model, self.firsts, {name: self.dims[name]}, "in")[name], self.targets[name]


def _position0(t: Tensor, dim: int) -> Tensor:
    """A site's rows at the first position, channels last, float32 on the CPU."""
    return t.detach().movedim(dim, -1)[:, 0, :].float().cpu()
