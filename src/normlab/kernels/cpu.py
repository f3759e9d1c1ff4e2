"""Fused CPU paths for the element-wise norms (DyT, Derf, DyISRU, ELN) and RMSNorm: C++ kernels built once
per machine (``csrc/cpu_norms.cpp``, built and cached by `normlab.kernels.cpu_build`).

Each op is an ``autograd.Function`` over two kernels written with ATen's vector types and
``at::parallel_for``, as PyTorch's own CPU LayerNorm is. The forward reads x once and writes y once. The
backward is one pass: it reads x and dy once, writes dx, and adds the parameter-gradient terms into
per-task partial sums in the same sweep (each task owns a block of rows; the partials are added in task
order, so a result is the same on every run with the same thread count). Only x is saved (RMSNorm also
keeps its fp32 per-row rstd); tanh(alpha x) and the like are recomputed (measured better than
saving f for DyT and Derf: slower in float32, 5x DyT's gradient error in bfloat16; the saving path was retired in
0.10.0). Arithmetic is float32 for every input dtype (float32, bfloat16, float16).

The mechanism was chosen by measurement (``scripts/bench_kernels.py --cpu``, docs/kernels.md): the
TorchInductor paths it replaces ran at the same or lower speed, wrote the parameter-gradient column sums
as a second pass over x and dy, and compiled every op again in every fresh process (4-18 s for the first
call). The C++ library is compiled once per machine (about 25 s) and loads in milliseconds.

Formulas, with s the channel scale folded into the weight (w' = s * w) and g = dL/dy:
    DyT / scaled DyT   y = w' tanh(a x) + b;          dx = g w' (1 - t^2) a,  da = sum g w' (1 - t^2) x
    Derf               y = w erf(a x + s) + b;  dz = g w 2/sqrt(pi) exp(-(a x + s)^2),  dx = dz a,  ds = sum dz
    DyISRU             y = w' x h + b, h = (beta + x^2)^(-1/2);  dx = g w' beta h^3,  dbeta = -sum g w' x h^3 / 2
    ELN                u = x - mean(x), y = w' u h(u) + b;  q = g w' beta h^3,  dx = q - mean(q)
    RMSNorm            y = w x r, r = (mean x^2 + eps)^(-1/2);  dx = r (g w) - x r^3 mean(g w x)
and dw = sum over rows of g times the normalized value, db = sum over rows of g.

Under ``kernel="auto"`` no call waits for the build: until the library is loaded, calls take the reference
math while a background thread builds it (`ready`). Long jobs (``train``, ``convert``,
``reproduce``) and ``kernel="cpu"`` wait for it instead, so that a run uses one path from its first step.
A machine without a C++ compiler falls back to the reference, with one warning. Double backward is not
supported (``kernel="reference"`` supports it); under ``torch.func`` transforms (vmap, grad, jacrev) the
modules take the reference math, which those transforms differentiate and batch (the functions here are
not transformable themselves: see ``_PointwiseFn``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from normlab.errors import NormlabError
from normlab.kernels import cpu_build
from normlab.kernels.fused import unit_weight  # a missing weight means 1: the library reads it as zeros

__all__ = ["available", "ready", "usable", "records_grad", "transformed", "dyt", "derf", "dyisru", "eln", "rms_norm",
           "pointwise_forward", "rms_forward", "FAST_DTYPES"]  # fmt: skip

FAST_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# kernel="auto" fuses inputs of at least this many elements when autograd records the call. Below it a call's fixed
# cost (about 0.1 ms when measured: the module, the autograd function, and then the parameters' float32 copies,
# which the kernels no longer make) exceeds what fusing saves: forward + backward of DyT took 314 against 201 us at
# 2 x 8 x 64 (2 threads) and 486 against 620 us at 16 x 64 x 64 (1 thread, as a sweep worker runs)
# (docs/kernels.md). A call autograd does not record (inference, a decode step) calls the op without the autograd
# function and fuses at every size: the DyT op takes 4-6 us at 1 x 576, against about 9 us for the reference.
MIN_FUSED = 1 << 16
# DyISRU and ELN fuse at every size: their reference is a chain of small ops whose fixed cost exceeds the fused
# call's (forward + backward at 2 x 8 x 64: 122 against 184 us for DyISRU, 122 against 236 us for ELN; one
# decode step of SmolLM2, 1 x 576, inference: 32 against 48 and 64 us; Xeon, 2 threads, docs/kernels.md).
MIN_FUSED_ISRU = 0
_KIND = {"dyt": 0, "derf": 1, "dyisru": 2, "eln": 3}


def ready(wait: bool = False) -> bool:
    """Whether the kernels are loaded. With ``wait``, build them first if needed (about 25 s, once per
    machine); without, start that build in the background and answer at once.

    Args:
        wait: Build them first if needed (else the build starts in the background).
    """
    loaded = cpu_build.load(wait=wait)
    if loaded and not _COMPILED["registered"]:
        _register_for_compile()
    return loaded


# --------------------------------------------------------------------------
# torch.compile: the fused op as one node of the graph
# --------------------------------------------------------------------------
_COMPILED = {"registered": False}


def _register_for_compile() -> None:
    """Shape-only ("fake") implementations of the point-wise ops and an autograd formula for the forward, registered
    once when the library loads (``torch.library``): under torch.compile the point-wise norms then call the fused op,
    one node of the graph that ``fullgraph=True`` traces, where Inductor would otherwise generate the reference's
    code. Measured on DyT's forward and backward at 4 x 256 x 512 float32, 2 AVX2 cores: 15 ms against 37 ms for the
    compiled reference (CHANGELOG, 0.8.0)."""
    _COMPILED["registered"] = True
    lib = "normlab_cpu::"

    @torch.library.register_fake(lib + "pointwise_fwd")
    def _fwd(x, p0, p1, w, b, scale, kind, log_p0=False):
        return torch.empty_like(x)

    @torch.library.register_fake(lib + "pointwise_bwd")
    def _bwd(g, x, p0, p1, w, b, scale, kind):
        none = x.new_empty((0,), dtype=torch.float32)
        like = [torch.empty_like(t) if t is not None else none for t in (p0, p1, w, b)]
        return [torch.empty_like(x), *like]

    def setup(ctx, inputs, output):
        x, p0, p1, w, b, scale, kind, log_p0 = inputs
        if log_p0:
            raise NormlabError("normlab_cpu.pointwise_fwd with log_p0 has no backward; pass p0 = exp(log p0)")
        ctx.save_for_backward(x, p0, p1, w, b)
        ctx.scale, ctx.kind = scale, kind

    def backward(ctx, grad):
        x, p0, p1, w, b = ctx.saved_tensors
        dx, dp0, dp1, dw, db = torch.ops.normlab_cpu.pointwise_bwd(grad, x, p0, p1, w, b, ctx.scale, ctx.kind)
        return dx, dp0, None if p1 is None else dp1, dw, None if b is None else db, None, None, None

    torch.library.register_autograd(lib + "pointwise_fwd", backward, setup_context=setup)


def available() -> bool:
    """False once the kernels have failed to build on this machine."""
    return cpu_build.failure() is None


def transformed() -> bool:
    """Whether a torch.func transform (vmap, grad, jacrev, ...) is active."""
    return torch._C._functorch.maybe_current_level() is not None


def usable(x: Tensor, *params: Tensor | None, wait: bool = False) -> bool:
    """Whether the fused CPU path applies now: a CPU float tensor of a fast dtype, outside torch.compile and
    torch.func, with parameters of the input's dtype (under autocast the module casts them first), and the
    kernels loaded (``wait``: build them first if needed). A decode step asks this for every norm: ``is_cpu`` and
    a plain loop, not ``device.type`` and a generator (2.8 against 1.2 us for four tensors).

    Args:
        x: The input.
        *params: The parameters (None where absent).
        wait: Wait for the kernels' build.
    """
    if not (x.is_cpu and x.dtype in FAST_DTYPES and x.numel() > 0):
        return False
    for p in params:
        if p is not None and not (p.is_cpu and p.dtype == x.dtype):
            return False
    return not transformed() and ready(wait) and (not torch.compiler.is_compiling() or compiled_op())


def compiled_op() -> bool:
    """Whether a trace takes the fused op: under torch.compile once its fake and autograd are registered, never under
    torch.export (an exported graph, and the ONNX file made from it, holds the formulas, so it runs without normlab)."""
    return _COMPILED["registered"] and not torch.compiler.is_exporting()


# --------------------------------------------------------------------------
# autograd functions: one call into the library each way (it reshapes, casts and reduces the parameters)
# --------------------------------------------------------------------------
SECOND_DERIVATIVE = (
    "normlab's fused CPU kernels have a first-order backward: a second derivative (backward with "
    "create_graph=True) needs the reference path, kernel='reference' on the module or the call, or "
    "NORMLAB_KERNEL=reference for the process"
)


def first_order(backward):
    """``torch.autograd.function.once_differentiable``, but a backward asked to build a graph (``create_graph=True``,
    for a second derivative) is refused at once, naming the reference path, rather than failing later with torch's
    "trying to differentiate twice"."""
    once = torch.autograd.function.once_differentiable(backward)

    def run(ctx, *grads):
        if torch.is_grad_enabled():  # the engine runs a backward in grad mode only under create_graph=True
            raise NormlabError(SECOND_DERIVATIVE)
        return once(ctx, *grads)

    return run


class _PointwiseFn(torch.autograd.Function):
    """y = scale w f(x; p0, p1) + b: DyT (alpha), Derf (alpha, shift), DyISRU and ELN (beta).

    The forward takes ``ctx`` (the older style): with a separate ``setup_context``, ``Function.apply`` binds
    the signature with ``inspect`` on every call, which cost more than the kernel on small inputs (measured:
    120 against 40 us for RMSNorm on 16 x 64 x 64). torch.func transforms take the reference instead
    (`usable`)."""

    @staticmethod
    def forward(ctx, x, weight, bias, scale: float, kind: str, p0, p1):
        ctx.scale, ctx.kind = scale, kind
        ctx.save_for_backward(x, weight, bias, p0, p1)  # only x is (N, C); the rest are (C,) or (1,)
        return torch.ops.normlab_cpu.pointwise_fwd(x, p0, p1, weight, bias, scale, _KIND[kind])

    @staticmethod
    @first_order
    def backward(ctx, grad):
        x, weight, bias, p0, p1 = ctx.saved_tensors
        dx, dp0, dp1, dw, db = torch.ops.normlab_cpu.pointwise_bwd(
            grad, x, p0, p1, weight, bias, ctx.scale, _KIND[ctx.kind]
        )
        return dx, dw, None if bias is None else db, None, None, dp0, None if p1 is None else dp1


class _RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps: float):
        y, rstd = torch.ops.normlab_cpu.rms_fwd(x, weight, eps)
        ctx.save_for_backward(x, rstd, weight)
        return y

    @staticmethod
    @first_order
    def backward(ctx, grad):
        x, rstd, weight = ctx.saved_tensors
        dx, dw = torch.ops.normlab_cpu.rms_bwd(grad, x, rstd, weight)
        return dx, dw, None


def records_grad(*tensors: Tensor | None) -> bool:
    """Whether autograd records this call; when it does not (inference, ``torch.no_grad``, frozen parameters and
    input), the ops are called directly: the autograd function's own cost is most of a small call's (a decode
    step's norm is one row)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _pointwise(x: Tensor, weight: Tensor, bias: Tensor | None, scale: float, kind: str, p0: Tensor, p1: Tensor | None):
    if torch.compiler.is_compiling():  # the op, its fake and autograd formula (`usable` sent export elsewhere)
        return torch.ops.normlab_cpu.pointwise_fwd(x, p0, p1, weight, bias, scale, _KIND[kind])
    if records_grad(x, weight, bias, p0, p1):
        return _PointwiseFn.apply(x, weight, bias, scale, kind, p0, p1)
    return pointwise_forward(x, kind, p0, p1, weight, bias, scale)


# The forward ops alone, for a call autograd does not record with the library loaded: what the functions here run
# then, and what a module's inference call runs after `normlab.kernels.direct` has checked the rest. Their callers'
# checks cost about 2% of a decoding SmolLM2's step (docs/folding.md), so these add none.
def pointwise_forward(
    x: Tensor,
    kind: str,
    p0: Tensor,
    p1: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    scale: float = 1.0,
    log_p0: bool = False,
) -> Tensor:
    """``kind`` 'dyt', 'derf', 'dyisru' or 'eln'; p0 alpha (DyT, Derf) or beta (DyISRU, ELN), p1 Derf's shift.
    ``log_p0``: p0 is log(beta), and the op takes its exp (the same ATen exp as ``torch.exp``).

    Args:
        x: The input, (..., C), channels last.
        kind: 'dyt', 'derf', 'dyisru' or 'eln'.
        p0: alpha (DyT, Derf) or beta (DyISRU, ELN), (1,) or (C,).
        p1: Derf's shift, else None.
        weight: gamma, (C,), or None (1).
        bias: beta, (C,), or None.
        scale: A multiple of the output before the bias (sqrt(C) for scaled DyT and DyISRU).
        log_p0: ``p0`` holds log(beta).
    """
    return torch.ops.normlab_cpu.pointwise_fwd(x, p0, p1, unit_weight(weight, x), bias, scale, _KIND[kind], log_p0)


def rms_forward(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """RMSNorm's forward op alone: weight * x / sqrt(mean(x^2) + eps), no autograd record.

    Args:
        x: The input, (..., C), channels last.
        weight: gamma, (C,), or None (1).
        eps: Added to the mean square under the root.
    """

    return torch.ops.normlab_cpu.rms_fwd(x, unit_weight(weight, x), float(eps))[0]


def _need() -> None:
    if not ready(wait=True):
        raise RuntimeError(f"normlab's CPU kernels are not available on this machine ({cpu_build.failure()})")


# --------------------------------------------------------------------------
# the ops: same signatures as normlab.functional
# --------------------------------------------------------------------------
def dyt(x: Tensor, alpha: Tensor, weight: Tensor | None, bias: Tensor | None = None, scale: float = 1.0) -> Tensor:
    """scale * weight * tanh(alpha x) + bias (scale sqrt(C) gives scaled DyT); alpha of shape (1,) or (C,).

    Args:
        x: The input, (..., C), channels last.
        alpha: (1,) or (C,).
        weight: gamma, (C,), or None (1).
        bias: beta, (C,), or None.
        scale: A multiple of the output before the bias (sqrt(C) for scaled DyT and DyISRU).
    """
    _need()
    return _pointwise(x, unit_weight(weight, x), bias, float(scale), "dyt", alpha, None)


def derf(x: Tensor, alpha: Tensor, shift: Tensor, weight: Tensor | None, bias: Tensor | None = None) -> Tensor:
    """weight * erf(alpha x + shift) + bias; alpha and shift of shape (1,) or (C,).

    Args:
        x: The input, (..., C), channels last.
        alpha: (1,) or (C,).
        shift: (1,) or (C,).
        weight: gamma, (C,), or None (1).
        bias: beta, (C,), or None.
    """
    _need()
    return _pointwise(x, unit_weight(weight, x), bias, 1.0, "derf", alpha, shift)


def dyisru(x: Tensor, beta: Tensor, weight: Tensor | None, bias: Tensor | None = None, scale: float = 1.0) -> Tensor:
    """scale * weight * x / sqrt(beta + x^2) + bias; beta of shape (1,) or (C,).

    Args:
        x: The input, (..., C), channels last.
        beta: (1,) or (C,), > 0.
        weight: gamma, (C,), or None (1).
        bias: beta, (C,), or None.
        scale: A multiple of the output before the bias (sqrt(C) for scaled DyT and DyISRU).
    """
    _need()
    return _pointwise(x, unit_weight(weight, x), bias, float(scale), "dyisru", beta, None)


def eln(x: Tensor, beta: Tensor, weight: Tensor | None, bias: Tensor | None = None, scale: float = 1.0) -> Tensor:
    """scale * weight * u / sqrt(beta + u^2) + bias with u = x - mean(x); beta of shape (1,) or (C,).

    Args:
        x: The input, (..., C), channels last.
        beta: (1,) or (C,), > 0.
        weight: gamma, (C,), or None (1).
        bias: beta, (C,), or None.
        scale: A multiple of the output before the bias (sqrt(C) for scaled DyT and DyISRU).
    """
    _need()
    return _pointwise(x, unit_weight(weight, x), bias, float(scale), "eln", beta, None)


def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """weight * x / sqrt(mean(x^2) + eps), fp32 statistics.

    Args:
        x: The input, (..., C), channels last.
        weight: gamma, (C,), or None (1).
        eps: Added to the mean square under the root.
    """
    _need()
    weight = unit_weight(weight, x)
    if records_grad(x, weight):
        return _RMSNormFn.apply(x, weight, float(eps))
    return rms_forward(x, weight, eps)
