"""Calibration block by block on cached block inputs, as layer-wise quantizers (GPTQ, AWQ) calibrate.

A decoder is a chain of blocks: block b's input is block b-1's output. Sequential calibration fits site k on its
input in the model whose sites 1..k-1 are converted. Re-running the converted prefix up to every site costs about
one forward pass per site (61 sites on SmolLM2: about 30 passes). Here the original model runs once; each block's
call (its arguments: the attention mask, the rotary embeddings, ...) is kept, and the converted stream's hidden
state is kept at the block it has reached. A site in block b is then fitted on the input of block b alone, run on
that hidden state; once every site of block b is fitted, the stream advances through block b once. Each block runs
once to advance and once per site inside it (the pass stops at the site), never the prefix.

It applies only where it is exact. `BlockStream.find` takes the model's largest ``nn.ModuleList`` of one block class
that holds sites; the recording pass checks that the blocks run once each, in order, and that each block's input
is the previous block's output, bit for bit. Anything else (no such list, a block called twice, something between
blocks) leaves the model on the re-running path, and the reason is recorded. A site after the blocks whose input is
the last block's output, bit for bit (a final norm), reads the stream once it has passed every block; any other
site outside the blocks (an embedding norm) takes the re-running path: one pass each.

Memory: one hidden state per calibration batch (tokens x width x 4 bytes for float32), and the blocks' other
arguments, which the model computes once per forward and every block shares. The estimate is checked against the
machine's memory before the stream is built; a stream that would not fit leaves the model on the re-running path.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from normlab.conversion.batches import Stop, model_device, run_batch
from normlab.errors import machine_memory

__all__ = ["BlockStream", "block_index", "find_blocks"]


def find_blocks(model: nn.Module, sites: list[str], least: int = 2) -> tuple[str, int] | None:
    """The model's decoder blocks: the name of the ``nn.ModuleList`` of one class holding the most sites (at least
    ``least`` of its blocks holding one), and its length; None when there is none. Calibration streams blocks only
    where two or more hold a site; a heal freezes the blocks before the first converted one, so one suffices there.

    Args:
        model: The model.
        sites: The names of the sites to be converted.
        least: How many of the list's blocks must hold a site.
    """
    best = None
    for name, m in model.named_modules():
        if not isinstance(m, nn.ModuleList) or len(m) == 0 or len({type(c) for c in m}) != 1:
            continue
        prefix = f"{name}." if name else ""
        held = {s.removeprefix(prefix).split(".")[0] for s in sites if s.startswith(prefix)}
        inside = sum(s.startswith(prefix) for s in sites)
        if len(held) >= max(least, 1) and (best is None or inside > best[0]):
            best = (inside, name, len(m))
    return None if best is None else (best[1], best[2])


def block_index(prefix: str, site: str) -> int | None:
    """The index of the block of the ``prefix`` list that holds ``site``; None outside it.

    Args:
        prefix: The name of the blocks' ``nn.ModuleList`` (``model.layers``).
        site: A module's name.
    """
    head = f"{prefix}."
    return int(site[len(head) :].split(".")[0]) if site.startswith(head) else None


def _hidden(args: tuple, kwargs: dict) -> Tensor | None:
    h = args[0] if args else kwargs.get("hidden_states")
    return h if isinstance(h, Tensor) else None


def _with_hidden(args: tuple, kwargs: dict, h: Tensor) -> tuple[tuple, dict]:
    if args:
        return (h, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": h}


def _output(out) -> Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


class BlockStream:
    """One set of batches (the calibration sequences, or the first-token pairs) flowing through the converted model
    block by block. ``record`` it during the original model's pass; then `site_inputs` gives a site's inputs in the
    model as converted so far, and the stream advances itself to the site's block (module docstring).

    Args:
        model: The model.
        prefix: The name of the ``nn.ModuleList`` of its blocks (`find_blocks`).
        n_blocks: How many blocks it holds.
    """

    def __init__(self, model: nn.Module, prefix: str, n_blocks: int) -> None:
        self.model, self.prefix, self.n = model, prefix, n_blocks
        self.blocks = model.get_submodule(prefix)
        self.calls: list[list[tuple[tuple, dict]]] = []  # per batch, per block: its args and kwargs (hidden: None)
        self.hidden: list[Tensor] | None = None  # per batch: the converted stream's input to block ``self.at``
        self.at = 0
        self.broken: str | None = None  # why the stream cannot be used (then every site re-runs the prefix)
        self._last: Tensor | None = None
        self.hidden_bytes = 0
        self.tail: dict[str, bool] = {}  # sites after the blocks: whether their input is the last block's output
        self.ran = 0  # blocks every recorded batch ran (a pass stops once its last site has run)

    def block_of(self, site: str) -> int | None:
        """The index of the block that holds ``site``, or None for a site outside the blocks."""
        return block_index(self.prefix, site)

    def serves(self, site: str) -> bool:
        """Whether ``site``'s inputs come from this stream: it is sound, and the site is in a block not yet passed, or
        reads the last block's output (a final norm)."""
        b = self.block_of(site)
        if b is None:
            return self.broken is None and self.tail.get(site, False)
        return self.broken is None and self.at <= b < self.ran

    @contextmanager
    def record(self, outside: list[str] = ()):
        """Hooks that keep each block's call while the original model runs the batches (in order, once each), and
        that check, for each of the ``outside`` sites, whether its input is the last block's output."""

        def pre(b):
            def hook(mod, args, kwargs):
                h = _hidden(args, kwargs)
                if b == 0:
                    self.calls.append([])
                    self.hidden_bytes += h.numel() * h.element_size() if h is not None else 0
                elif self._last is None or h is None or h.shape != self._last.shape or not torch.equal(h, self._last):
                    self.broken = self.broken or f"the input of {self.prefix}.{b} is not {self.prefix}.{b - 1}'s output"
                if h is None:
                    self.broken = self.broken or f"{self.prefix}.{b} is not called with its hidden state first"
                if not self.calls or len(self.calls[-1]) != b:
                    self.broken = self.broken or f"the blocks of {self.prefix} do not run once each, in order"
                else:
                    args, kwargs = _with_hidden(args, kwargs, None) if h is not None else (args, kwargs)
                    self.calls[-1].append((args, kwargs))

            return hook

        def post(b):
            def hook(mod, args, kwargs, out):
                self._last = _output(out)

            return hook

        def after(name):
            def hook(mod, args):
                ran = bool(self.calls) and len(self.calls[-1]) == self.n and self._last is not None
                same = ran and args[0].shape == self._last.shape and torch.equal(args[0], self._last)
                self.tail[name] = self.tail.get(name, True) and same

            return hook

        handles = [self.model.get_submodule(n).register_forward_pre_hook(after(n)) for n in outside]
        for b, block in enumerate(self.blocks):
            handles.append(block.register_forward_pre_hook(pre(b), with_kwargs=True))
            handles.append(block.register_forward_hook(post(b), with_kwargs=True))
        try:
            yield self
        finally:
            for h in handles:
                h.remove()
            self._last = None
            self.ran = min((len(c) for c in self.calls), default=0)  # a pass that stopped after its last site
            if self.ran == 0:
                self.broken = self.broken or f"no block of {self.prefix} ran"

    def memory(self) -> int:
        """Bytes the stream keeps: one hidden state per batch, twice while it advances (the blocks' other arguments
        are the model's own, shared by every block)."""
        return 2 * self.hidden_bytes

    def check_fits(self) -> None:
        """Leave the stream (broken, with the reason) when its hidden states would not fit in half the machine's
        memory."""
        total = machine_memory()
        if total and self.memory() > total // 2:
            self.broken = self.broken or (
                f"its cached block inputs ({self.memory() / 2**20:.0f} MB) would not fit in half the machine's "
                f"memory ({total / 2**30:.1f} GB)"
            )

    def _start(self, batches: list) -> None:
        """The converted model's input to block 0 for every batch: a pass that stops there."""
        grabbed: list[Tensor] = []

        def hook(mod, args, kwargs):
            grabbed.append(_hidden(args, kwargs).detach())
            raise Stop

        handle = self.blocks[0].register_forward_pre_hook(hook, with_kwargs=True)
        try:
            for i, batch in enumerate(batches):
                try:
                    with torch.no_grad():
                        run_batch(self.model, batch, i, no_cache=True)
                except Stop:
                    pass
        finally:
            handle.remove()
        self.hidden, self.at = grabbed, 0

    def _run(self, b: int, i: int, h: Tensor):
        """Block ``b`` on batch ``i``'s hidden state ``h``; a failure is a ValueError naming the batch and the block,
        as `run_batch` names a batch (``Stop`` passes through)."""
        args, kwargs = _with_hidden(*self.calls[i][b], h)
        try:
            with torch.no_grad():
                return self.blocks[b](*args, **kwargs)
        except Stop:
            raise
        except Exception as e:  # noqa: BLE001
            raise ValueError(
                f"calibration batch {i} could not be run through {self.prefix}.{b}: {type(e).__name__}: {e}"
            ) from e

    def advance(self, b: int, batches: list) -> None:
        """Move the stream to the input of block ``b``, through the blocks as converted now."""
        if self.hidden is None:
            self._start(batches)
        if b < self.at:
            raise RuntimeError(f"block stream at {self.prefix}.{self.at} cannot go back to block {b}")
        while self.at < b:
            self.hidden = [_output(self._run(self.at, i, h)).detach() for i, h in enumerate(self.hidden)]
            self.at += 1

    def site_inputs(self, site: str, batches: list, take: Callable[[Tensor, int], None]) -> None:
        """Call ``take(input, batch index)`` with ``site``'s input on every batch, in the model as converted so far;
        each run of its block stops at the site."""
        b = self.block_of(site)
        if b is None:  # a site that reads the last block's output
            self.advance(self.n, batches)
            for i, h in enumerate(self.hidden):
                take(h, i)
            return
        self.advance(b, batches)
        module = self.model.get_submodule(site)

        def grab(mod, args):
            take(args[0], grab.batch)
            raise Stop

        handle = module.register_forward_pre_hook(grab)
        try:
            for i, h in enumerate(self.hidden):
                grab.batch = i
                try:
                    self._run(b, i, h)
                except Stop:
                    pass
        finally:
            handle.remove()


class Replayed(nn.Module):
    """Stands in for a block in its model's list of blocks while a replay measures: called, it returns the block's
    kept output for the batch the model is running (``at["batch"]``) instead of running it. Every other attribute
    is the block's own (a decoder reads, e.g., a layer's ``attention_type`` before calling it); its parameters are
    not registered here, so the model's own are unchanged.

    Args:
        block: The block it stands in for.
        outputs: The block's kept output, per batch.
        at: The index of the batch the model is running, as `BlockReplay` counts it.
    """

    def __init__(self, block: nn.Module, outputs: list, at: dict) -> None:
        super().__init__()
        object.__setattr__(self, "block", block)  # not a submodule: the model's parameters stay the block's
        self.outputs, self.at = outputs, at

    def forward(self, *args, **kwargs):
        return self.outputs[self.at["batch"]]

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["block"], name)


class BlockReplay:
    """A language model's cross-entropy on fixed batches (or another ``measure(model, batches) -> float``: the KL to
    the original, `normlab.conversion.measure.fidelity.ReferenceKL`), re-measured from a block on: every block's
    output on the batches is kept, and a measurement after a change in block ``start`` (or later) replays blocks
    0..start-1 from the kept outputs instead of running them. The budget walk measures each site's cost this way.

    Exact where the stream is: the first measurement runs the whole model and checks the chain (`BlockStream.record`);
    where it does not hold (``broken`` says why) every measurement runs the whole model. ``keep=True`` keeps what the
    blocks it ran gave, for the next measurement; ``keep=False`` leaves the kept outputs as they were (for a change that
    is undone after). ``dtype`` (bf16) autocasts every measurement, the kept outputs included."""

    def __init__(
        self,
        model: nn.Module,
        batches: list,
        blocks: tuple[str, int] | None,
        sites: list[str],
        dtype: torch.dtype | None = None,
        measure: Callable[[nn.Module, list], float] | None = None,
    ) -> None:
        from normlab.conversion.measure.fidelity import cross_entropy

        self.model, self.batches, self.sites, self.dtype = model, batches, sites, dtype
        self._measure = cross_entropy if measure is None else measure
        self.stream = BlockStream(model, *blocks) if blocks else None
        self.outputs: list[list] | None = None
        self._pending: tuple[int, list] | None = None
        self.broken = None if blocks else "no decoder blocks found"
        self.after: set[str] = set()  # sites outside the blocks that run after all of them (a final norm)

    def block_of(self, site: str) -> int:
        """Where a change at ``site`` starts to matter: its block; the number of blocks for a site after them (only
        the model's head runs); 0 for any other."""
        b = self.stream.block_of(site) if self.stream is not None else None
        if b is not None:
            return b
        return self.stream.n if self.stream is not None and site in self.after else 0

    def measure(self, start: int = 0, *, keep: bool = True) -> float:
        """The measure on the batches (the mean next-token cross-entropy by default), blocks before ``start``
        replayed."""
        if self.dtype is None:
            return self._measured(start, keep)
        with torch.autocast((model_device(self.model) or torch.device("cpu")).type, dtype=self.dtype):
            return self._measured(start, keep)

    def _measured(self, start: int, keep: bool) -> float:
        self._pending = None
        if self.broken is not None:
            return self._measure(self.model, self.batches)
        if self.outputs is None:
            return self._first()
        n = self.stream.n
        start = min(start, n)
        fresh = [[None] * len(self.batches) for _ in range(n)]
        blocks = self.stream.blocks
        with self._counting() as at:
            handles = [blocks[b].register_forward_hook(self._keeper(fresh, b, at)) for b in range(start, n)]
            real = [blocks[b] for b in range(start)]
            for b in range(start):  # the model calls its blocks through the list: a stand-in there is called instead
                blocks[b] = Replayed(real[b], self.outputs[b], at)
            try:
                ce = self._measure(self.model, self.batches)
            finally:
                for b in range(start):
                    blocks[b] = real[b]
                for h in handles:
                    h.remove()
        self._pending = (start, fresh)
        if keep:
            self.commit()
        return ce

    def commit(self) -> None:
        """Keep what the last measurement's blocks gave (the change it measured stays); nothing to keep when every
        measurement runs the whole model."""
        if self._pending is None or self.outputs is None:
            return
        start, fresh = self._pending
        self.outputs[start:] = fresh[start:]

    @contextmanager
    def _counting(self):
        """The index of the batch the model is running, from a pre-hook on the model (one call per batch)."""
        at = {"batch": -1}
        handle = self.model.register_forward_pre_hook(lambda mod, args: at.__setitem__("batch", at["batch"] + 1))
        try:
            yield at
        finally:
            handle.remove()

    @staticmethod
    def _keeper(into: list, b: int, at: dict):
        def hook(mod, args, out):
            into[b][at["batch"]] = out

        return hook

    def _first(self) -> float:
        """The first measurement: the whole model, checking the chain and keeping every block's output."""
        n, blocks = self.stream.n, self.stream.blocks
        self.outputs = [[None] * len(self.batches) for _ in range(n)]
        outside = [s for s in self.sites if self.stream.block_of(s) is None]
        with self._counting() as at:
            handles = [blocks[b].register_forward_hook(self._keeper(self.outputs, b, at)) for b in range(n)]
            ran = {}
            for s in outside:  # a site outside the blocks: did every block run before it, on every batch?
                handles.append(
                    self.model.get_submodule(s).register_forward_pre_hook(
                        lambda mod, args, _s=s: ran.__setitem__(
                            _s, ran.get(_s, True) and self.stream.calls != [] and len(self.stream.calls[-1]) == n
                        )
                    )
                )
            try:
                with self.stream.record():
                    ce = self._measure(self.model, self.batches)
            finally:
                for h in handles:
                    h.remove()
        self.stream.calls.clear()  # a replay keeps the blocks' outputs, not their calls
        self.broken = self.stream.broken
        self.after = {s for s, ok in ran.items() if ok}
        size = sum(o.numel() * o.element_size() for row in self.outputs for o in row if isinstance(o, Tensor))
        total = machine_memory()
        if self.broken is None and (
            any(not isinstance(o, Tensor) for row in self.outputs for o in row) or (total and 2 * size > total // 2)
        ):
            self.broken = "the blocks' outputs are not tensors, or would not fit in a quarter of the memory"
        if self.broken is not None:
            self.outputs = None
        return ce
