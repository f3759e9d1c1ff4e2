"""Thin ``nn.Module`` wrappers, one per function of `normlab.functional`: the base class and the norms that
normalize (LayerNorm, RMSNorm and its variants). The element-wise ones are in `normlab.elementwise`.

Every module reads ``Name(dim, *, ..., device=None, dtype=None)``: it owns its
parameters, checks that the input's last dimension is ``dim``, and calls the
functional form. The math lives there; the one exception is RMSEMA, whose forward updates its
running mean of x^2 (a buffer) in training mode before it calls `normlab.functional.rms_ema`.

Parameter names follow PyTorch so that a converted ``nn.LayerNorm`` can copy
its affine: ``weight`` (gamma) and ``bias`` (beta of DyT). The papers' own
parameters are ``alpha`` (DyT family) and ``beta`` (DyISRU/ELN). ``beta`` is kept
positive by storing ``log_beta``; ``module.beta`` returns ``exp(log_beta)``.

Initial values: DyT's ``alpha_init`` defaults to 0.5 (Zhu et al.). DyISRU's and
ELN's ``beta_init`` defaults to ``4.0 = 1 / 0.5**2``, the slope-matching map
``beta0 = 1 / alpha0**2`` of the DyISRU paper (Fig. 2 caption): scaled DyT and DyISRU then
have the same slope ``sqrt(C) * alpha0 = sqrt(C / beta0)`` at x = 0. To match
RMSNorm's gain at an input std sigma0 instead, use ``beta_init = C * sigma0**2``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from normlab import functional as FN
from normlab import kernels as K
from normlab.arguments import check_dim, check_finite, check_flag, check_positive_finite, kernel_choice

__all__ = [
    "prime_running_stats",
    "LayerNorm",
    "RMSNorm",
    "L1Norm",
    "LMaxNorm",
    "GroupRMS",
    "RMSDetached",
    "RMSEMA",
    "RMSPartialCoupling",
    "NormModule",
]


class NormModule(nn.Module):
    """The base of every normlab norm: ``dim``, the input check, the optional channel affine. ``isinstance(m,
    NormModule)`` tells normlab's norms from a model's own.

    Args:
        dim: The number of channels C: the size of the normalized axis.
        weight: Whether the layer has the channel gain gamma (a learnable (C,) vector, initialised to 1).
        bias: Whether the layer has the channel shift beta (a learnable (C,) vector, initialised to 0).
        channel_dim: The axis of the channels: -1 (the last, as in a transformer) or another, e.g. 1 for NCHW
            images.
        device: Where the parameters are created.
        dtype: The parameters' dtype.
    """

    def __init__(
        self,
        dim: int,
        *,
        weight: bool,
        bias: bool,
        channel_dim: int = -1,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.dim = check_dim(dim, type(self).__name__)
        if isinstance(channel_dim, bool) or not isinstance(channel_dim, int):
            raise ValueError(
                f"{type(self).__name__}: expected channel_dim to be an int (the axis of the channels, "
                f"-1 for the last, 1 for NCHW), got {channel_dim!r}"
            )
        self.channel_dim = channel_dim
        check_flag(bias, "bias", type(self).__name__)
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(dim, **factory)) if weight else None
        self.bias = nn.Parameter(torch.empty(dim, **factory)) if bias else None

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: Tensor) -> Tensor:
        """The norm over ``channel_dim`` (default the last axis): another axis is moved last and back, so every
        path (reference, CPU, Triton) computes on channels-last data."""
        if self.channel_dim == -1 or (isinstance(x, Tensor) and self.channel_dim == x.dim() - 1):
            return self._forward(x)
        if not isinstance(x, Tensor) or not -x.dim() <= self.channel_dim < x.dim():
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(
                f"{type(self).__name__}(dim={self.dim}, channel_dim={self.channel_dim}): the input "
                f"{got} has no axis {self.channel_dim}"
            )
        return self._forward(x.movedim(self.channel_dim, -1)).movedim(-1, self.channel_dim)

    def _check(self, x: Tensor) -> None:
        if not isinstance(x, Tensor) or x.dim() == 0 or x.shape[-1] != self.dim:
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(
                f"{type(self).__name__}(dim={self.dim}): expected an input of shape (..., {self.dim}), got {got}; "
                f"the normalized channel axis must be last (build the layer with dim=<size of the last axis>)"
            )

    def extra_repr(self) -> str:
        return f"{self.dim}, weight={self.weight is not None}, bias={self.bias is not None}"


# --------------------------------------------------------------------------
# statistic norms
# --------------------------------------------------------------------------
class LayerNorm(NormModule):
    """LayerNorm; ``kernel="auto"`` runs PyTorch's fused op (``F.layer_norm``) on every device.

    Args:
        dim: The number of channels C: the size of the normalized axis.
        eps: Added to the variance under the root.
        bias: Whether the layer has the channel shift beta (a learnable (C,) vector, initialised to 0).
        kernel: "auto" runs PyTorch's fused op; "reference" runs `normlab.functional.layer_norm`.
        channel_dim: The axis of the channels: -1 (the last, as in a transformer) or another, e.g. 1 for NCHW
            images.
        device: Where the parameters are created.
        dtype: The parameters' dtype.
    """

    def __init__(
        self,
        dim: int,
        *,
        eps: float = 1e-5,
        bias: bool = True,
        kernel: str = "auto",
        channel_dim: int = -1,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.kernel = kernel_choice(kernel, "LayerNorm", ("auto", "reference"))
        super().__init__(dim, weight=True, bias=bias, channel_dim=channel_dim, device=device, dtype=dtype)
        self.eps = check_positive_finite(eps, "eps", "LayerNorm")
        self.reset_parameters()

    def _forward(self, x: Tensor) -> Tensor:
        self._check(x)
        weight, bias = K.autocast_params(x, self.weight, self.bias)
        same = x.is_floating_point() and all(p is None or p.dtype == x.dtype for p in (weight, bias))
        if self.kernel == "auto" and same and not torch.compiler.is_compiling():
            return F.layer_norm(x, (self.dim,), weight, bias, self.eps)
        return FN.layer_norm(x, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, eps={self.eps}"


class _ScaleNorm(NormModule):
    """x divided by a per-token statistic, times weight: RMSNorm and its dissection variants."""

    _fn = staticmethod(FN.rms_norm)

    def __init__(
        self,
        dim: int,
        *,
        eps: float = FN.EPS,
        channel_dim: int = -1,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(dim, weight=True, bias=False, channel_dim=channel_dim, device=device, dtype=dtype)
        self.eps = check_positive_finite(eps, "eps", type(self).__name__)
        self.reset_parameters()

    def _forward(self, x: Tensor) -> Tensor:
        self._check(x)
        return self._fn(x, self.weight, eps=self.eps)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"


class RMSNorm(_ScaleNorm):
    """RMSNorm; ``kernel="auto"`` runs the Triton kernel on CUDA tensors and the fused CPU path on CPU tensors.

    Args:
        dim: The number of channels C: the size of the normalized axis.
        eps: Added to the mean square under the root.
        kernel: "auto" runs Triton on CUDA tensors and the fused C++ op on CPU tensors; "triton", "cpu" or
            "reference" (`normlab.functional`) forces one path.
        channel_dim: The axis of the channels: -1 (the last, as in a transformer) or another, e.g. 1 for NCHW
            images.
        device: Where the parameters are created.
        dtype: The parameters' dtype.
    """

    def __init__(
        self,
        dim: int,
        *,
        eps: float = FN.EPS,
        kernel: str = "auto",
        channel_dim: int = -1,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.kernel = kernel_choice(kernel, "RMSNorm")
        super().__init__(dim, eps=eps, channel_dim=channel_dim, device=device, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        w = self._parameters["weight"]
        if K.direct(self, x, w):  # inference on the CPU: straight to the fused op (kernels.direct)
            return K.cpu.rms_forward(x, w, self.eps)
        return super().forward(x)

    def _forward(self, x: Tensor) -> Tensor:
        self._check(x)
        return K.rms_norm(x, self.weight, self.eps, kernel=self.kernel)


class L1Norm(_ScaleNorm):
    """L1Norm: x over its mean absolute value (`normlab.functional.l1_norm`).

    Args:
        dim: The number of channels C: the size of the normalized axis.
        eps: Added to the mean absolute value.
        channel_dim: The axis of the channels: -1 (the last, as in a transformer) or another, e.g. 1 for NCHW
            images.
        device: Where the parameters are created.
        dtype: The parameters' dtype.
    """

    _fn = staticmethod(FN.l1_norm)


class LMaxNorm(_ScaleNorm):
    """LMaxNorm: x over its largest absolute value (`normlab.functional.lmax_norm`).

    Args:
        dim: The number of channels C: the size of the normalized axis.
        eps: Added to the largest absolute value.
        channel_dim: The axis of the channels: -1 (the last, as in a transformer) or another, e.g. 1 for NCHW
            images.
        device: Where the parameters are created.
        dtype: The parameters' dtype.
    """

    _fn = staticmethod(FN.lmax_norm)


class RMSDetached(_ScaleNorm):
    """RMSNorm with no gradient through its denominator (`normlab.functional.rms_detached`).

    Args:
        dim: The number of channels C: the size of the normalized axis.
        eps: Added to the mean square under the root.
        channel_dim: The axis of the channels: -1 (the last, as in a transformer) or another, e.g. 1 for NCHW
            images.
        device: Where the parameters are created.
        dtype: The parameters' dtype.
    """

    _fn = staticmethod(FN.rms_detached)


class GroupRMS(_ScaleNorm):
    """RMSNorm over groups of consecutive channels (`normlab.functional.group_rms`).

    Args:
        dim: The number of channels C: the size of the normalized axis.
        group_size: Channels per group; the last group holds the remainder.
        eps: Added to the mean square under the root.
        channel_dim: The axis of the channels: -1 (the last, as in a transformer) or another, e.g. 1 for NCHW
            images.
        device: Where the parameters are created.
        dtype: The parameters' dtype.
    """

    def __init__(
        self,
        dim: int,
        *,
        group_size: int = 8,
        eps: float = FN.EPS,
        channel_dim: int = -1,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
            raise ValueError(f"GroupRMS: expected group_size to be an int >= 1, got {group_size!r}")
        self.group_size = group_size
        super().__init__(dim, eps=eps, channel_dim=channel_dim, device=device, dtype=dtype)

    def _forward(self, x: Tensor) -> Tensor:
        self._check(x)
        return FN.group_rms(x, self.weight, self.group_size, self.eps)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, group_size={self.group_size}"


class RMSPartialCoupling(_ScaleNorm):
    """RMSNorm whose backward keeps a fraction ``lam`` of the coupling term (``lam=1`` is exact).

    Args:
        dim: The number of channels C: the size of the normalized axis.
        lam: The coupling term's share of the backward (1: RMSNorm's exact gradient, 0: RMSDetached's).
        eps: Added to the mean square under the root.
        channel_dim: The axis of the channels: -1 (the last, as in a transformer) or another, e.g. 1 for NCHW
            images.
        device: Where the parameters are created.
        dtype: The parameters' dtype.
    """

    def __init__(
        self,
        dim: int,
        *,
        lam: float = 1.0,
        eps: float = FN.EPS,
        channel_dim: int = -1,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.lam = check_finite(lam, "lam", "RMSPartialCoupling")
        super().__init__(dim, eps=eps, channel_dim=channel_dim, device=device, dtype=dtype)

    def _forward(self, x: Tensor) -> Tensor:
        self._check(x)
        return FN.rms_partial_coupling(x, self.weight, self.lam, self.eps)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, lam={self.lam}"


class RMSEMA(_ScaleNorm):
    """RMSNorm whose denominator is a running mean of x^2 over training steps.

    In training mode every call updates ``running_ms`` with
    ``running_ms <- (1 - momentum) * running_ms + momentum * mean(x^2)`` (the mean
    over the whole batch, all tokens and channels) and then normalizes with it;
    the first call sets it. Eval mode only reads it. No gradient flows through it.
    The update is computed in float32 whatever the module's dtype, and a batch whose mean is not
    finite (a NaN or Inf token) leaves the running mean as it was.

    Args:
        dim: The number of channels C: the size of the normalized axis.
        momentum: The running mean's step, in (0, 1].
        eps: Added to the mean square under the root.
        channel_dim: The axis of the channels: -1 (the last, as in a transformer) or another, e.g. 1 for NCHW
            images.
        device: Where the parameters are created.
        dtype: The parameters' dtype.
    """

    def __init__(
        self,
        dim: int,
        *,
        momentum: float = 0.01,
        eps: float = FN.EPS,
        channel_dim: int = -1,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0.0 < momentum <= 1.0:
            raise ValueError(f"RMSEMA: expected momentum in (0, 1], got {momentum!r}")
        self.momentum = float(momentum)
        super().__init__(dim, eps=eps, channel_dim=channel_dim, device=device, dtype=dtype)
        self.register_buffer("running_ms", torch.ones((), device=device, dtype=torch.float32))
        self.register_buffer("initialized", torch.zeros((), device=device, dtype=torch.bool))

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if hasattr(self, "running_ms"):
            self.running_ms.fill_(1.0)
            self.initialized.fill_(False)

    def _forward(self, x: Tensor) -> Tensor:
        self._check(x)
        if self.training and x.numel() > 0:
            with torch.no_grad():
                ms = x.detach().float().pow(2).mean()
                old = self.running_ms.float()
                new = torch.where(self.initialized, torch.lerp(old, ms, self.momentum), ms)
                ok = torch.isfinite(ms)
                self.running_ms.copy_(torch.where(ok, new, old))  # no host sync: torch.where, not an if
                self.initialized.copy_(self.initialized | ok)
        return FN.rms_ema(x, self.running_ms, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, momentum={self.momentum}"


@torch.no_grad()
def prime_running_stats(model: nn.Module, *inputs: object, **kwargs: object) -> int:
    """Set every not yet initialised running statistic (RMSEMA's mean of x^2) from one forward of ``inputs``, as
    the first training step would, and leave the model's mode as it was; returns how many modules were primed.
    What reads a model at init (``normlab predict``, ``normlab jacobian``) must see what training sees, not the
    placeholder 1.0.

    Args:
        model: The model whose RMSEMA modules are primed.
        *inputs: Its forward's positional inputs.
        **kwargs: Its forward's keyword inputs.
    """
    fresh = [m for m in model.modules() if isinstance(m, RMSEMA) and not bool(m.initialized)]
    if not fresh:
        return 0
    modes = {m: m.training for m in model.modules()}
    model.eval()
    for m in fresh:
        m.train()
    try:
        model(*inputs, **kwargs)
    finally:
        for m, mode in modes.items():
            m.training = mode
    return len(fresh)


# --------------------------------------------------------------------------
# point-wise functions
# --------------------------------------------------------------------------
