"""Fused kernels (DyT, Derf, DyISRU, RMSNorm in Triton; more on the CPU), each checked against
`normlab.functional`: Triton on GPUs, C++ kernels built once per machine on CPUs.

The one place that picks a path: one function per fused norm (``dyt``, ``derf``, ``scaled_dyt``, ``dyisru``,
``eln``, ``rms_norm``), each taking the tensors and ``kernel=``. A module's forward checks its input and
calls one of them. The Triton entry points themselves are `normlab.kernels.fused`, the CPU paths
`normlab.kernels.cpu`.

``kernel=`` chooses:
    "auto"       CUDA tensors: the Triton kernel when Triton is installed. CPU tensors (float32, bfloat16,
                 float16): the fused CPU path of `normlab.kernels.cpu` (PyTorch's own fused op for
                 LayerNorm) once its library is loaded, for DyISRU and ELN at every size and for the
                 others from ``cpu.MIN_FUSED`` (65,536) elements when autograd records the call (a smaller
                 input takes the reference, cheaper there), at every size when it does not (inference);
                 until then the reference, while a background thread builds it (once
                 per machine), so no call waits. Otherwise, inside torch.compile (which fuses the
                 reference itself) and under torch.func transforms, the reference;
    "triton"     always the Triton kernel (on CPU only under TRITON_INTERPRET=1, for testing);
    "cpu"        always the fused CPU path (a CPU tensor of a supported dtype, else a clear error),
                 waiting for the one-time build if needed;
    "reference"  always `normlab.functional`.

The environment variable ``NORMLAB_KERNEL=reference`` makes every ``"auto"`` take the reference math (to
compare, or to rule the fused paths out); unset or ``auto``, it changes nothing.

The functions here take tensors of any shape (..., C); non-contiguous inputs are copied
to a contiguous layout with unit column stride first.
"""

from __future__ import annotations

import functools
import os
import warnings

import torch

from normlab import functional as FN
from normlab.errors import NormlabError

# at the top: an import inside the dispatchers cost a decode step's norm 1-3 us
from normlab.kernels import cpu, fused

__all__ = ["triton_status", "select", "direct", "autocast_params", "dyt", "derf", "scaled_dyt", "dyisru", "eln",
           "rms_norm", "KERNEL_CHOICES", "TRITON_DTYPES"]  # fmt: skip

KERNEL_CHOICES = ("auto", "triton", "cpu", "reference")


@functools.lru_cache(maxsize=1)
def triton_status() -> tuple[bool, str]:
    """(available, reason): whether ``import triton`` works, and why not."""
    try:
        import triton  # noqa: F401
    except Exception as e:  # noqa: BLE001  (ImportError, or a broken install)
        return False, f"Triton cannot be imported ({type(e).__name__}: {e}); pip install triton"
    return True, ""


TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def on_cuda(x: torch.Tensor) -> bool:
    """Whether ``x`` is a CUDA tensor (one function, so that tests can take the CUDA branch on a CPU)."""
    return x.is_cuda


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def auto_choice() -> str:
    """What ``kernel="auto"`` means in this process: 'auto', or 'reference' under ``NORMLAB_KERNEL=reference``."""
    value = os.environ.get("NORMLAB_KERNEL", "auto") or "auto"
    if value not in ("auto", "reference"):
        raise NormlabError(f"NORMLAB_KERNEL={value!r}: expected 'auto' or 'reference' (or unset)")
    return value


def select(choice: str, x: torch.Tensor, owner: str, *params: torch.Tensor | None, min_fused: int | None = None) -> str:
    """The path ``owner`` takes on ``x`` for the module setting ``choice``: 'triton', 'cpu' or 'reference'.
    ``min_fused``: the smallest CPU input ``auto`` fuses (default ``cpu.MIN_FUSED``).

    Args:
        choice: The module's ``kernel`` setting.
        x: The input.
        owner: The layer named in errors.
        *params: Its parameters (None where absent).
        min_fused: The smallest CPU input ``auto`` fuses; None: ``cpu.MIN_FUSED``.
    """
    if x.device.type == "meta":  # shapes and dtypes only (meta-device init): every setting takes the reference
        return "reference"
    if choice == "auto":
        choice = auto_choice()
    if choice == "reference":
        return "reference"
    if is_dtensor(x, *params):
        return _dtensor_path(choice, owner)
    if choice == "cpu":
        if x.device.type != "cpu" or x.dtype not in cpu.FAST_DTYPES:
            raise NormlabError(
                f"{owner}(kernel='cpu'): the fused CPU path takes a CPU tensor of float32, bfloat16 "
                f"or float16; got {x.dtype} on {x.device}. Use kernel='auto'"
            )
        return "cpu" if cpu.usable(x, *params, wait=True) else "reference"
    if choice == "auto":
        if on_cuda(x):  # the Triton kernels take float32, bfloat16 and float16; float64 takes the reference
            return "triton" if triton_status()[0] and x.dtype in TRITON_DTYPES else "reference"
        # MIN_FUSED is the autograd function's fixed cost; a call autograd does not record (inference, a decode
        # step) calls the op directly, which is cheaper than the reference at every size
        least = 0 if not cpu.records_grad(x, *params) else cpu.MIN_FUSED if min_fused is None else min_fused
        return "cpu" if x.numel() >= least and cpu.usable(x, *params) else "reference"
    ok, why = triton_status()  # not on a CPU tensor's "auto" path: torch.compile traces that one
    if not ok:
        raise NormlabError(f"{owner}(kernel='triton'): {why}")
    if not x.is_cuda and not interpreting():
        raise NormlabError(
            f"{owner}(kernel='triton'): the input is on {x.device}; the fused kernel needs a CUDA "
            "tensor, or TRITON_INTERPRET=1 to run it on the CPU for testing"
        )
    return "triton"


#: Said once per process, the first time a DTensor reaches a norm on the "auto" path.
DTENSOR_NOTE = (
    "normlab: {owner} was given a DTensor (tensor or sequence parallel): it runs the reference math, which DTensor "
    "computes on each rank's local shard by its own rules for every operation (parameter gradients reduced where "
    "the input is sharded); the fused kernels take plain tensors only, so this path is the reference's speed"
)
_SAID: set[str] = set()


def is_dtensor(*tensors: torch.Tensor | None) -> bool:
    """Whether any of ``tensors`` is a ``torch.distributed.tensor.DTensor`` (imported only where torch.distributed
    is built, and never by a plain-tensor call: the type check comes first)."""
    if all(t is None or type(t) is torch.Tensor or type(t) is torch.nn.Parameter for t in tensors):
        return False
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(t, DTensor) for t in tensors)


def _dtensor_path(choice: str, owner: str) -> str:
    """'reference' for a DTensor on the auto path (said once); a named fused path is refused, saying why."""
    if choice != "auto":
        raise NormlabError(
            f"{owner}(kernel={choice!r}): the fused kernels take plain tensors, and this input or a parameter is a "
            "DTensor (tensor or sequence parallel). Use kernel='auto' or 'reference': DTensor then computes the "
            "reference math on each rank's shard"
        )
    if "dtensor" not in _SAID:
        _SAID.add("dtensor")
        warnings.warn(DTENSOR_NOTE.format(owner=owner), RuntimeWarning, stacklevel=4)
    return "reference"


def direct(module: torch.nn.Module, x: torch.Tensor, *params: torch.Tensor | None) -> bool:
    """Whether a fused norm module's call on ``x`` may go straight to its CPU op, past the routing: autograd is off
    (inference mode or no_grad, as in a decode step), ``x`` is a non-empty CPU tensor of a fused dtype whose last axis
    is the module's channels, the parameters are CPU tensors of x's dtype (so autocast, which would cast them to it,
    changes nothing), outside torch.compile and torch.func, ``module.kernel`` allows the CPU path, and the library is
    loaded. Where this answers True, `select` answers 'cpu' for the same call and the module calls the same function,
    so the output is the same; every other call takes the routed path and its checks. Measured in a decoding SmolLM2
    (docs/folding.md): the routed path's Python, about 20 calls per norm site, cost 2-3% of a decode step.

    Args:
        module: A fused norm module.
        x: Its input.
        *params: Its parameters (None where absent).
    """
    if torch.is_grad_enabled() or type(x) is not torch.Tensor or x.dim() == 0 or x.shape[-1] != module.dim:
        return False
    kernel = module.kernel
    if module.channel_dim not in (-1, x.dim() - 1) or (
        kernel != "cpu" and (kernel != "auto" or auto_choice() == "reference")
    ):
        return False
    return cpu.usable(x, *params)  # the device, dtypes, compile, torch.func and the library: select's own test


#: The device types torch.autocast knows; asking about another (``meta``) raises in torch itself.
AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu", "mtia", "maia", "xla", "ipu", "privateuseone")


def autocast_params(x: torch.Tensor, *params: torch.Tensor | None) -> tuple:
    """Under torch.autocast the fused kernels take the parameters in the input's dtype, as autocast would.

    Args:
        x: The input.
        *params: The parameters (None where absent).
    """
    if x.device.type in AUTOCAST_DEVICES and torch.is_autocast_enabled(x.device.type):
        return tuple(None if p is None else p.to(x.dtype) for p in params)
    return params


def _as_param(p: torch.Tensor | float | None, x: torch.Tensor, owner: str) -> torch.Tensor | None:
    """A parameter as the fused paths take it: a number becomes a (1,) tensor of x's dtype on x's device."""
    if p is None or isinstance(p, torch.Tensor):
        return p
    if isinstance(p, (int, float)) and not isinstance(p, bool):
        return torch.full((1,), float(p), dtype=x.dtype, device=x.device)
    raise TypeError(f"{owner}: a parameter must be a tensor or a number, got {type(p).__name__}")


def _route(
    kernel: str, owner: str, x: torch.Tensor, *params: torch.Tensor | float | None, min_fused: int | None = None
):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{owner}: x must be a tensor, got {type(x).__name__}")
    cast = autocast_params(x, *(_as_param(p, x, owner) for p in params))
    return select(kernel, x, owner, *cast, min_fused=min_fused), cast


def dyt(
    x: torch.Tensor,
    alpha: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    *,
    kernel: str = "auto",
) -> torch.Tensor:
    """weight * tanh(alpha x) + bias on the path ``kernel`` picks; alpha of shape (1,) or (C,).

    Args:
        x: The input, (..., C), channels last.
        alpha: (1,) or (C,).
        weight: gamma, (C,), or None (1).
        bias: beta, (C,), or None.
        kernel: "auto" (Triton on CUDA tensors, the C++ op on CPU tensors, else the reference), "triton", "cpu" or
            "reference".
    """
    path, p = _route(kernel, "DyT", x, alpha, weight, bias)
    if path == "triton":
        return fused.dyt(x, *p)
    if path == "cpu":
        return cpu.dyt(x, *p)
    return FN.dyt(x, alpha, weight, bias)


def scaled_dyt(
    x: torch.Tensor,
    alpha: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    *,
    scale: FN.Scale = "C",
    kernel: str = "auto",
) -> torch.Tensor:
    """sqrt(C) weight * tanh(alpha x) + bias (``scale`` 'C' or 'C-1'): DyT's kernels with the scale folded in.

    Args:
        x: The input, (..., C), channels last.
        alpha: (1,) or (C,).
        weight: gamma, (C,), or None (1).
        bias: beta, (C,), or None.
        scale: "C" for sqrt(C), "C-1" for sqrt(C-1).
        kernel: "auto" (Triton on CUDA tensors, the C++ op on CPU tensors, else the reference), "triton", "cpu" or
            "reference".
    """
    path, (a, w, b) = _route(kernel, "ScaledDyT", x, alpha, weight, bias)
    s = FN.channel_scale(x.shape[-1], scale)
    if path == "triton":
        return fused.dyt(x, a, fused.unit_weight(w, x) * s, b)
    if path == "cpu":
        return cpu.dyt(x, a, w, b, scale=s)
    return FN.scaled_dyt(x, alpha, weight, bias, scale)


def derf(
    x: torch.Tensor,
    alpha: torch.Tensor,
    shift: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    *,
    kernel: str = "auto",
) -> torch.Tensor:
    """weight * erf(alpha x + shift) + bias on the path ``kernel`` picks.

    Args:
        x: The input, (..., C), channels last.
        alpha: (1,) or (C,).
        shift: (1,) or (C,).
        weight: gamma, (C,), or None (1).
        bias: beta, (C,), or None.
        kernel: "auto" (Triton on CUDA tensors, the C++ op on CPU tensors, else the reference), "triton", "cpu" or
            "reference".
    """
    path, p = _route(kernel, "Derf", x, alpha, shift, weight, bias)
    if path == "triton":
        return fused.derf(x, *p)
    if path == "cpu":
        return cpu.derf(x, *p)
    return FN.derf(x, alpha, shift, weight, bias)


def _isru_min_fused() -> int:
    return cpu.MIN_FUSED_ISRU


def dyisru(
    x: torch.Tensor,
    beta: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    *,
    scale: FN.Scale = "C",
    kernel: str = "auto",
) -> torch.Tensor:
    """sqrt(C) weight * x / sqrt(beta + x^2) + bias on the path ``kernel`` picks.

    Args:
        x: The input, (..., C), channels last.
        beta: (1,) or (C,), > 0.
        weight: gamma, (C,), or None (1).
        bias: beta, (C,), or None.
        scale: "C" for sqrt(C), "C-1" for sqrt(C-1).
        kernel: "auto" (Triton on CUDA tensors, the C++ op on CPU tensors, else the reference), "triton", "cpu" or
            "reference".
    """
    path, (be, w, b) = _route(kernel, "DyISRU", x, beta, weight, bias, min_fused=_isru_min_fused())
    s = FN.channel_scale(x.shape[-1], scale)
    if path == "triton":
        return fused.dyisru(x, be, w, b, s)
    if path == "cpu":
        return cpu.dyisru(x, be, w, b, scale=s)
    return FN.dyisru(x, beta, weight, bias, scale)


def eln(
    x: torch.Tensor,
    beta: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    *,
    scale: FN.Scale = "C-1",
    kernel: str = "auto",
) -> torch.Tensor:
    """ELN on the CPU path or the reference (there is no Triton kernel for ELN: on CUDA, the reference).

    Args:
        x: The input, (..., C), channels last.
        beta: (1,) or (C,), > 0.
        weight: gamma, (C,), or None (1).
        bias: beta, (C,), or None.
        scale: "C" for sqrt(C), "C-1" for sqrt(C-1).
        kernel: "auto" (the C++ op on CPU tensors, else the reference), "cpu" or "reference".
    """
    kernel = "reference" if kernel == "auto" and on_cuda(x) else kernel
    path, (be, w, b) = _route(kernel, "ELN", x, beta, weight, bias, min_fused=_isru_min_fused())
    if path == "cpu":
        return cpu.eln(x, be, w, b, scale=FN.channel_scale(x.shape[-1], scale))
    return FN.eln(x, beta, weight, bias, scale)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, *, kernel: str = "auto") -> torch.Tensor:
    """RMSNorm with a weight on the path ``kernel`` picks.

    Args:
        x: The input, (..., C), channels last.
        weight: gamma, (C,), or None (1).
        eps: Added to the mean square under the root.
        kernel: "auto" (Triton on CUDA tensors, the C++ op on CPU tensors, else the reference), "triton", "cpu" or
            "reference".
    """
    path, (w,) = _route(kernel, "RMSNorm", x, weight)
    if path == "triton":
        return fused.rms_norm(x, w, eps)
    if path == "cpu" and not torch.compiler.is_compiling():  # compiled, Inductor fuses the reference's RMSNorm
        return cpu.rms_norm(x, w, eps)
    return FN.rms_norm(x, weight, eps)
