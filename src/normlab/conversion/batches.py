"""Batches, for every part of conversion: what a batch may be, the one way a batch is run through a model, the one
signal that ends a forward pass early, the one way a submodule is swapped, and the autocast a precision field asks
for."""

from __future__ import annotations

import copy
import functools
import inspect
import time
import warnings
from collections.abc import Callable, Iterable

import torch
from torch import nn

__all__ = [
    "Stop",
    "as_batches",
    "autocast_dtype",
    "cpu_bf16_speed",
    "cache_kwarg",
    "input_ids",
    "logit_rows",
    "model_device",
    "run_batch",
    "row_chunks",
    "run_hooked",
    "sharing_copy",
]

#: What one batch may be: a dict of model kwargs, an input tensor, or an (inputs, ...) tuple from a dataloader.
Batch = dict | torch.Tensor | tuple | list


class Stop(Exception):
    """Raised by a hook to end a forward pass once the module of interest has seen its input."""


def as_batches(calibrate: object) -> Iterable:
    """A tensor of inputs, a dict of model kwargs, a list of those, or a dataloader yielding them, as an iterable
    of batches; anything else (a string of text, a number) is a clear TypeError.

    Args:
        calibrate: What the caller gave as calibration data.
    """
    if isinstance(calibrate, (torch.Tensor, dict)):
        return [calibrate]
    if isinstance(calibrate, (str, bytes)) or not isinstance(calibrate, Iterable):
        raise TypeError(
            f"calibrate: expected a tensor of inputs, a dict of model kwargs, a list of those, or a "
            f"dataloader yielding them; got {type(calibrate).__name__}"
        )
    return calibrate


def run_batch(model: nn.Module, batch: Batch, i: int = 0, *, no_cache: bool = False, stage: str = "calibration"):
    """Run batch ``i`` of ``stage``: a dict of model kwargs, an input tensor, or an (inputs, ...) tuple from a
    dataloader.

    ``no_cache`` asks a Hugging Face model not to build a KV cache (``use_cache=False``); a model without that
    argument is called without it. ``Stop`` passes through; any other failure is a ValueError naming the stage and
    the batch.

    Args:
        model: The model.
        batch: A dict of model kwargs, an input tensor, or an (inputs, ...) tuple.
        i: The batch's index, named in errors.
        no_cache: Ask for no KV cache.
        stage: What the batch is for, as the error names it: "calibration", "held-out" (a measurement), "heal".
    """
    if isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], torch.Tensor):
        batch = batch[0]
    device = model_device(model)
    if isinstance(batch, dict):
        args, kwargs = (), {k: v.to(device) if isinstance(v, torch.Tensor) and device else v for k, v in batch.items()}
    elif isinstance(batch, torch.Tensor):
        args, kwargs = (batch.to(device) if device else batch,), {}
    else:
        raise TypeError(
            f"{stage}: batch {i} is a {type(batch).__name__}; expected a tensor, a dict of model "
            "kwargs, or an (inputs, ...) tuple"
        )
    try:
        if no_cache:
            try:
                return model(*args, **kwargs, use_cache=False)
            except TypeError as e:
                if "use_cache" not in str(e):
                    raise
        return model(*args, **kwargs)
    except Stop:
        raise
    except Exception as e:  # noqa: BLE001
        why = _outside_vocabulary(model, batch) or f"{type(e).__name__}: {e}"
        raise ValueError(f"{stage} batch {i} could not be run through the model: {why}") from e


def log_probs(model: nn.Module, batch: Batch, i: int = 0, *, stage: str) -> torch.Tensor:
    """The next-token log-probabilities of ``model`` on ``batch`` (`run_batch` with no KV cache), in float32 or,
    for a float64 model, float64: bf16 or fp16 logits are raised to float32 before the softmax, and nothing is
    lowered, so that a float64 check is exact.

    Args:
        model: The model.
        batch: What `run_batch` takes.
        i: The batch's index, named in errors.
        stage: What the batch is for, as an error names it.
    """
    logits = run_batch(model, batch, i, no_cache=True, stage=stage).logits
    return logits.to(torch.promote_types(logits.dtype, torch.float32)).log_softmax(-1)


def _outside_vocabulary(model: nn.Module, batch: Batch) -> str | None:
    """Why a batch of token ids failed, when some id is outside the model's vocabulary (its input embedding's
    rows); None otherwise."""
    embed = getattr(model, "get_input_embeddings", lambda: None)()
    ids = batch.get("input_ids") if isinstance(batch, dict) else batch
    if not isinstance(embed, nn.Embedding) or not isinstance(ids, torch.Tensor) or ids.is_floating_point():
        return None
    lo, hi, n = int(ids.min()), int(ids.max()), embed.num_embeddings
    if 0 <= lo and hi < n:
        return None
    bad = hi if hi >= n else lo
    return (
        f"token id {bad} is outside the model's vocabulary of {n:,} (its input embedding's rows): ids must be in "
        f"[0, {n}); were they made by another model's tokenizer?"
    )


def model_device(model: nn.Module) -> torch.device | None:
    """The device of ``model``'s first parameter (None without parameters): where its inputs go.

    Args:
        model: The model.
    """
    p = next(model.parameters(), None)
    return None if p is None else p.device


def autocast_dtype(precision: str, model: nn.Module, key: str) -> tuple[torch.dtype | None, str]:
    """The autocast dtype that the config field ``key`` (its value ``precision``: "auto", "float32" or "bf16") asks
    for on ``model``'s device (None: float32), and why. "auto" takes bf16 where the device runs bf16 matmuls
    natively: a GPU that supports bf16, or a CPU with AVX512-BF16 or AMX whose bf16 matmul runs in a child process
    (`normlab.errors.check_cpu_bf16`); "bf16" insists, with a clear error where it cannot run and a warning where
    it runs emulated.

    Args:
        precision: "auto", "float32" or "bf16".
        model: The model whose device decides.
        key: The config field, named in the reason and in errors (``budget.precision``).
    """
    from normlab.errors import NormlabError, check_cpu_bf16

    if precision == "float32":
        return None, f"float32 ({key}=float32)"
    device = model_device(model) or torch.device("cpu")
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return torch.bfloat16, f"bf16 autocast ({key}={precision}, a GPU with bf16)"
        if precision == "bf16":
            raise NormlabError(f"{key}=bf16: this GPU does not support bf16; use {key}=float32")
        return None, f"float32 ({key}=auto: this GPU has no bf16)"
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    if precision == "auto" and not native:
        return None, f"float32 ({key}=auto: this CPU has neither AVX512-BF16 nor AMX)"
    try:
        check_cpu_bf16(what=f"{key}={precision}", instead=f"{key}=float32")
    except NormlabError as e:
        if precision == "bf16":
            raise
        return None, f"float32 ({key}=auto: {e})"
    if precision == "auto" and (speed := cpu_bf16_speed()) < BF16_GAIN:
        return None, f"float32 ({key}=auto: a bf16 matmul runs at {speed:.2f}x float32's speed on this CPU)"
    if not native:
        warnings.warn(
            f"{key}=bf16: this CPU has neither AVX512-BF16 nor AMX, so its bf16 matmuls are emulated and run several "
            f"times slower than float32 (7x for SmolLM2's MLP product on an AVX2 EPYC); {key}=auto takes float32 here",
            stacklevel=2,
        )
        return torch.bfloat16, f"bf16 autocast ({key}=bf16, emulated: this CPU has neither AVX512-BF16 nor AMX)"
    return torch.bfloat16, f"bf16 autocast ({key}={precision})"


BF16_GAIN = 1.2  # "auto" takes bf16 on a CPU only where its matmul is at least this much faster than float32's


@functools.cache
def cpu_bf16_speed() -> float:
    """How many times faster a bf16 matmul under CPU autocast runs than the float32 one on this machine, timed once
    per process: SmolLM2's MLP product (2,048 x 576 by 576 x 1,536), the best of 5 of each, interleaved. A CPU that
    advertises AVX512-BF16 need not run it faster: on an Intel Xeon VM with it this read 0.56-0.65, while on an AMD EPYC
    with it a SmolLM2 pass took 2.7 s in bf16 against 6.7 s. Call it after `normlab.errors.check_cpu_bf16` (which
    survives a CPU whose bf16 matmul dies)."""
    a, b = torch.randn(2048, 576), torch.randn(576, 1536)
    best = {"float32": float("inf"), "bf16": float("inf")}
    for _ in range(5):
        for name in best:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=name == "bf16"):
                t0 = time.perf_counter()
                a @ b
                best[name] = min(best[name], time.perf_counter() - t0)
    return best["float32"] / best["bf16"]


def input_ids(batch: Batch) -> torch.Tensor:
    """The token ids of a batch: its ``input_ids``, the tensor itself, or the first element of a tuple.

    Args:
        batch: A dict of model kwargs, an input tensor, or an (inputs, ...) tuple.
    """
    if isinstance(batch, dict):
        return batch["input_ids"]
    return batch[0] if isinstance(batch, (list, tuple)) else batch


def cache_kwarg(model: nn.Module) -> str:
    """The name under which ``model``'s forward takes (and its output holds) the KV cache: ``cache`` in
    transformers 5, which deprecates ``past_key_values``.

    Args:
        model: The model.
    """
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


#: The most bytes one part of a batch's float32 logits may take (`logit_rows`): a pass that holds both models' logits
#: and their log-softmaxes, or a training step's logits and their gradients, holds several such tensors at once, and
#: a 152k vocabulary at 8 x 128 tokens is 0.6 GB each.
LOGITS_PART_BYTES = 2**28


def logit_rows(model: nn.Module, batch: Batch) -> int:
    """How many rows (sequences) of ``batch`` to run at once so that their logits over ``model``'s output layer
    fit `LOGITS_PART_BYTES` (at least one), at 4 bytes a logit (8 for a float64 head, as `log_probs` keeps
    them); every row for a model without a linear output layer or a batch that is not (B, T) token ids.

    Args:
        model: The model (a Hugging Face model's ``get_output_embeddings`` gives the vocabulary).
        batch: A dict of model kwargs, an input tensor, or an (inputs, ...) tuple.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(batch, (list, tuple)):
        batch = batch[0] if batch else None
    ids = batch.get("input_ids") if isinstance(batch, dict) else batch
    if (
        not isinstance(head, nn.Linear)
        or not isinstance(ids, torch.Tensor)
        or ids.is_floating_point()
        or ids.dim() != 2
    ):
        return 2**62
    size = max(4, head.weight.element_size())
    return max(1, LOGITS_PART_BYTES // (size * ids.shape[-1] * head.out_features))


def row_chunks(batch: Batch, rows: int) -> list[Batch]:
    """``batch`` cut into batches of at most ``rows`` rows (sequences), as even as can be: its tensors split along
    their first axis, the rest of a dict passed to every part. A batch of ``rows`` rows or fewer, or one whose
    tensors do not share a first axis, comes back whole.

    Args:
        batch: A dict of model kwargs, an input tensor, or an (inputs, ...) tuple.
        rows: The most rows a part holds.
    """
    if isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], torch.Tensor):
        batch = batch[0]
    if not isinstance(batch, (torch.Tensor, dict)):
        return [batch]
    tensors = [batch] if isinstance(batch, torch.Tensor) else [v for v in batch.values() if isinstance(v, torch.Tensor)]
    n = {t.shape[0] if t.dim() else -1 for t in tensors}
    if len(n) != 1 or (size := n.pop()) <= rows:
        return [batch]
    rows = -(-size // -(-size // rows))  # the fewest parts, then their rows as even as can be
    if isinstance(batch, torch.Tensor):
        return list(batch.split(rows))
    return [
        {k: v[i : i + rows] if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        for i in range(0, size, rows)
    ]


def sharing_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` that shares its weight matrices and copies the rest: the original kept beside the model a
    conversion changes, at the cost of its norms, biases and buffers rather than of a second model.

    A conversion swaps whole modules (`swap`), so the copy keeps the norms the model had. What may not happen while
    both are in use is an in-place write to a shared matrix: a LoRA merge builds a new weight (`merge_lora`), and a
    heal that trains every weight first gives the model its own copy of the matrices it shares.

    Args:
        model: The model.
    """
    shared = {id(t): t for t in (*model.parameters(), *model.buffers()) if t.dim() >= 2}
    return copy.deepcopy(model, memo=shared)


def run_hooked(model: nn.Module, batch: Batch, i: int, hooks: dict[str, Callable], kind: str) -> None:
    """Run batch i with hooks on the named modules ("out": forward hooks, "pre": pre-hooks); a hook may stop it.

    Args:
        model: The model.
        batch: A dict of model kwargs, an input tensor, or an (inputs, ...) tuple.
        i: The batch's index, named in errors.
        hooks: Module name -> its hook.
        kind: "out" for forward hooks, "pre" for pre-hooks.
    """
    handles = [
        model.get_submodule(n).register_forward_hook(h)
        if kind == "out"
        else model.get_submodule(n).register_forward_pre_hook(h)
        for n, h in hooks.items()
    ]
    try:
        with torch.no_grad():
            run_batch(model, batch, i, no_cache=True)  # no KV cache: nothing reads it, and blocks are replayed
    except Stop:
        pass
    finally:
        for h in handles:
            h.remove()
