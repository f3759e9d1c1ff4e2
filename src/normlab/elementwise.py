"""The element-wise replacements as ``nn.Module`` s: the DyT family (DyT, Derf, scaled DyT and variants), the ISRU
family (DyISRU, ELN), and the other point-wise forms the dissection trains. Conventions as in `normlab.modules`
(its docstring gives the parameter names and initial values); the math is in `normlab.functional`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from normlab import functional as FN
from normlab import kernels as K
from normlab.arguments import check_dim, check_finite, check_flag, check_positive_finite, kernel_choice
from normlab.kernels import cpu
from normlab.modules import NormModule

__all__ = [
    "DyT",
    "Derf",
    "DyTHardtanh",
    "DyTSigmoid",
    "DyTRMSDenominator",
    "TanhFixed",
    "LayerScale",
    "FixedScale",
    "SignSqrt",
    "ScaledDyT",
    "DyISRU",
    "ELN",
]


ALPHA_INIT = 0.5  # DyT's alpha at init (Zhu et al.; Derf keeps it)
BETA_INIT = 4.0  # DyISRU's and ELN's beta at init: 1 / ALPHA_INIT**2, so the slope at 0 is DyT's


class _DyTFamily(NormModule):
    """gamma * f(alpha * x) + beta with a learnable alpha (scalar or per channel)."""

    _fn = staticmethod(FN.dyt)

    def __init__(
        self,
        dim: int,
        *,
        alpha_init: float = ALPHA_INIT,
        per_channel_alpha: bool = False,
        bias: bool = True,
        channel_dim: int = -1,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(dim, weight=True, bias=bias, channel_dim=channel_dim, device=device, dtype=dtype)
        self.alpha_init = check_finite(alpha_init, "alpha_init", type(self).__name__)
        self.per_channel_alpha = check_flag(per_channel_alpha, "per_channel_alpha", type(self).__name__)
        self.alpha = nn.Parameter(torch.empty(dim if per_channel_alpha else 1, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        super().reset_parameters()
        nn.init.constant_(self.alpha, self.alpha_init)

    def _forward(self, x: Tensor) -> Tensor:
        self._check(x)
        return self._fn(x, self.alpha, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, alpha_init={self.alpha_init}, per_channel_alpha={self.per_channel_alpha}"


class DyT(_DyTFamily):
    """Dynamic Tanh, weight * tanh(alpha * x) + bias: the DyT paper's drop-in for LayerNorm and RMSNorm (Zhu, Chen,
    He, LeCun, Liu, "Transformers without Normalization", arXiv 2503.10622). ``kernel="auto"`` runs the Triton
    kernel on CUDA tensors and the fused CPU path on CPU tensors.

    Args:
        dim: The number of channels C: the size of the normalized axis.
        alpha_init: alpha at init (0.5, Zhu et al.).
        per_channel_alpha: One alpha per channel instead of one for all.
        scalar_gain: gamma one learnable scalar for all channels instead of one per channel: the "single-scale" norm
            of OSP (arXiv 2506.19697), which names per-channel gamma an outlier amplifier. The weight is then (1,);
            a conversion, which copies a model's per-channel gamma into it, refuses it.
        bias: Learn beta, the channel shift (False: none).
        channel_dim: The axis of the channels: -1 (the last, as in a transformer) or another, e.g. 1 for NCHW.
        kernel: "auto" runs Triton on CUDA tensors and the fused C++ op on CPU tensors; "triton", "cpu" or
            "reference" (`normlab.functional`) forces one path.
        device: Where the parameters are created.
        dtype: The parameters' dtype.
    """

    def __init__(
        self,
        dim: int,
        *,
        alpha_init: float = ALPHA_INIT,
        per_channel_alpha: bool = False,
        scalar_gain: bool = False,
        bias: bool = True,
        channel_dim: int = -1,
        kernel: str = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.kernel = kernel_choice(kernel, "DyT")
        super().__init__(
            dim,
            alpha_init=alpha_init,
            per_channel_alpha=per_channel_alpha,
            bias=bias,
            channel_dim=channel_dim,
            device=device,
            dtype=dtype,
        )
        self.scalar_gain = check_flag(scalar_gain, "scalar_gain", "DyT")
        if scalar_gain:  # one gamma for every channel, given to the kernels as a (C,) view of it
            self.weight = nn.Parameter(torch.ones(1, device=device, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        p = self._parameters  # not self.alpha: nn.Module's attribute lookup costs about 0.6 us a parameter
        a, w, b = p["alpha"], p["weight"], p.get("bias")
        if self.scalar_gain:
            w = w.expand(self.dim).contiguous()
        if K.direct(self, x, a, w, b):  # inference on the CPU: straight to the fused op (kernels.direct)
            return cpu.pointwise_forward(x, "dyt", a, None, w, b)
        return super().forward(x)

    def _forward(self, x: Tensor) -> Tensor:
        self._check(x)
        w = self.weight.expand(self.dim).contiguous() if self.scalar_gain else self.weight
        return K.dyt(x, self.alpha, w, self.bias, kernel=self.kernel)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, scalar_gain=True" if self.scalar_gain else super().extra_repr()


class Derf(_DyTFamily):
    """Derf: weight * erf(alpha * x + shift) + bias (arXiv 2512.10938), a learnable scalar shift (per channel
    with ``per_channel_alpha``); alpha0 = 0.5 and shift0 = 0 as published. ``kernel="auto"`` runs the Triton
    kernel on CUDA tensors and the fused CPU path on CPU tensors.

    Args:
        dim: The number of channels C: the size of the normalized axis.
        shift_init: The initial shift inside erf.
        kernel: "auto" runs Triton on CUDA tensors and the fused C++ op on CPU tensors; "triton", "cpu" or
            "reference" (`normlab.functional`) forces one path.
        **kwargs: The DyT family's keywords: ``alpha_init`` (0.5, Zhu et al.), ``per_channel_alpha`` (False: one
            alpha; True: one per channel), ``bias`` (True), ``channel_dim`` (-1), ``device``, ``dtype``.
    """

    def __init__(self, dim: int, *, shift_init: float = 0.0, kernel: str = "auto", **kwargs: object) -> None:
        self.shift_init = check_finite(shift_init, "shift_init", "Derf")
        self.kernel = kernel_choice(kernel, "Derf")
        super().__init__(dim, **kwargs)
        self.shift = nn.Parameter(torch.full_like(self.alpha, self.shift_init))

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if hasattr(self, "shift"):
            nn.init.constant_(self.shift, self.shift_init)

    def forward(self, x: Tensor) -> Tensor:
        p = self._parameters
        a, s, w, b = p["alpha"], p["shift"], p["weight"], p.get("bias")
        if K.direct(self, x, a, s, w, b):
            return cpu.pointwise_forward(x, "derf", a, s, w, b)
        return super().forward(x)

    def _forward(self, x: Tensor) -> Tensor:
        self._check(x)
        return K.derf(x, self.alpha, self.shift, self.weight, self.bias, kernel=self.kernel)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, shift_init={self.shift_init}"


class DyTHardtanh(_DyTFamily):
    """DyT with hardtanh for tanh (`normlab.functional.dyt_hardtanh`).

    Args:
        dim: The number of channels C: the size of the normalized axis.
        alpha_init: The initial alpha, a finite number.
        per_channel_alpha: One alpha per channel instead of one for the layer.
        bias: Whether the layer has the channel shift beta (a learnable (C,) vector, initialised to 0).
        channel_dim: The axis of the channels: -1 (the last, as in a transformer) or another, e.g. 1 for NCHW
            images.
        device: Where the parameters are created.
        dtype: The parameters' dtype.
    """

    _fn = staticmethod(FN.dyt_hardtanh)


class DyTSigmoid(_DyTFamily):
    """DyT with 2 sigmoid - 1 for tanh (`normlab.functional.dyt_sigmoid`).

    Args:
        dim: The number of channels C: the size of the normalized axis.
        alpha_init: The initial alpha, a finite number.
        per_channel_alpha: One alpha per channel instead of one for the layer.
        bias: Whether the layer has the channel shift beta (a learnable (C,) vector, initialised to 0).
        channel_dim: The axis of the channels: -1 (the last, as in a transformer) or another, e.g. 1 for NCHW
            images.
        device: Where the parameters are created.
        dtype: The parameters' dtype.
    """

    _fn = staticmethod(FN.dyt_sigmoid)


class DyTRMSDenominator(_DyTFamily):
    """DyT of the RMS-normalized input (`normlab.functional.dyt_rms_denominator`).

    Args:
        dim: The number of channels C: the size of the normalized axis.
        eps: Added to the mean square under the root.
        **kwargs: The DyT family's keywords: ``alpha_init`` (0.5, Zhu et al.), ``per_channel_alpha`` (False: one
            alpha; True: one per channel), ``bias`` (True), ``channel_dim`` (-1), ``device``, ``dtype``.
    """

    def __init__(self, dim: int, *, eps: float = FN.EPS, **kwargs: object) -> None:
        self.eps = check_positive_finite(eps, "eps", "DyTRMSDenominator")
        super().__init__(dim, **kwargs)

    def _forward(self, x: Tensor) -> Tensor:
        self._check(x)
        return FN.dyt_rms_denominator(x, self.alpha, self.weight, self.bias, self.eps)


class ScaledDyT(_DyTFamily):
    """sqrt(C) * tanh(alpha * x) (the DyISRU paper eq. 12), or sqrt(C-1) with ``scale="C-1"``.

    Args:
        dim: The number of channels C: the size of the normalized axis.
        scale: "C" for sqrt(C), "C-1" for sqrt(C-1).
        kernel: "auto" runs Triton on CUDA tensors and the fused C++ op on CPU tensors; "triton", "cpu" or
            "reference" (`normlab.functional`) forces one path.
        **kwargs: The DyT family's keywords: ``alpha_init`` (0.5, Zhu et al.), ``per_channel_alpha`` (False: one
            alpha; True: one per channel), ``bias`` (True), ``channel_dim`` (-1), ``device``, ``dtype``.
    """

    def __init__(self, dim: int, *, scale: FN.Scale = "C", kernel: str = "auto", **kwargs: object) -> None:
        FN.channel_scale(max(check_dim(dim, "ScaledDyT"), 2), scale)  # validates the name
        self.scale = scale
        self.kernel = kernel_choice(kernel, "ScaledDyT")
        super().__init__(dim, **kwargs)

    def forward(self, x: Tensor) -> Tensor:
        p = self._parameters
        a, w, b = p["alpha"], p["weight"], p.get("bias")
        if K.direct(self, x, a, w, b):
            return cpu.pointwise_forward(x, "dyt", a, None, w, b, FN.channel_scale(x.shape[-1], self.scale))
        return super().forward(x)

    def _forward(self, x: Tensor) -> Tensor:
        self._check(x)
        return K.scaled_dyt(x, self.alpha, self.weight, self.bias, scale=self.scale, kernel=self.kernel)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, scale={self.scale!r}"


class FixedScale(_DyTFamily):
    """A fixed scale, weight * (alpha * x) + bias (`normlab.functional.fixed_scale`): the linear target of a
    conversion, alpha calibrated to a site's 1 / RMS (per channel with ``per_channel_alpha``), and a separate one at
    the massive tokens. Linear in x, so direct logit attribution through it is exact.

    Args:
        dim: The number of channels C: the size of the normalized axis.
        alpha_init: alpha at init.
        per_channel_alpha: One alpha per channel instead of one for all.
        bias: Learn beta, the channel shift (False: none).
        channel_dim: The axis of the channels: -1 (the last, as in a transformer) or another, e.g. 1 for NCHW.
        device: Where the parameters are created.
        dtype: The parameters' dtype.
    """

    _fn = staticmethod(FN.fixed_scale)


class TanhFixed(NormModule):
    """tanh(x) times a channel gain, no alpha (`normlab.functional.tanh_fixed`).

    Args:
        dim: The number of channels C: the size of the normalized axis.
        channel_dim: The axis of the channels: -1 (the last, as in a transformer) or another, e.g. 1 for NCHW
            images.
        device: Where the parameters are created.
        dtype: The parameters' dtype.
    """

    def __init__(
        self,
        dim: int,
        *,
        channel_dim: int = -1,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(dim, weight=True, bias=False, channel_dim=channel_dim, device=device, dtype=dtype)
        self.reset_parameters()

    def _forward(self, x: Tensor) -> Tensor:
        self._check(x)
        return FN.tanh_fixed(x, self.weight)


class LayerScale(NormModule):
    """The channel affine alone, weight * x + bias (`normlab.functional.layer_scale`).

    Args:
        dim: The number of channels C: the size of the normalized axis.
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
        bias: bool = True,
        channel_dim: int = -1,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(dim, weight=True, bias=bias, channel_dim=channel_dim, device=device, dtype=dtype)
        self.reset_parameters()

    def _forward(self, x: Tensor) -> Tensor:
        self._check(x)
        return FN.layer_scale(x, self.weight, self.bias)


class SignSqrt(NormModule):
    """sign(x) sqrt(|x| + eps), then the affine (`normlab.functional.sign_sqrt`).

    Args:
        dim: The number of channels C: the size of the normalized axis.
        eps: Added to |x| under the root.
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
        eps: float = 1e-6,
        bias: bool = True,
        channel_dim: int = -1,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(dim, weight=True, bias=bias, channel_dim=channel_dim, device=device, dtype=dtype)
        self.eps = check_positive_finite(eps, "eps", "SignSqrt")
        self.reset_parameters()

    def _forward(self, x: Tensor) -> Tensor:
        self._check(x)
        return FN.sign_sqrt(x, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, eps={self.eps}"


class _ISRUFamily(NormModule):
    """scale * z / sqrt(beta + z^2) with a learnable beta > 0, stored as log_beta. ``_op``: the kind of the fused CPU
    op (`normlab.kernels.cpu.pointwise_forward`) that an inference call takes directly (`normlab.kernels.direct`)."""

    _default_scale: FN.Scale = "C"
    _op: str

    def __init__(
        self,
        dim: int,
        *,
        beta_init: float = BETA_INIT,
        per_channel_beta: bool = False,
        scale: FN.Scale | None = None,
        bias: bool = True,
        channel_dim: int = -1,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(dim, weight=True, bias=bias, channel_dim=channel_dim, device=device, dtype=dtype)
        self.beta_init = check_positive_finite(beta_init, "beta_init", type(self).__name__)
        self.scale = scale or self._default_scale
        FN.channel_scale(max(dim, 2), self.scale)  # validates the name
        self.per_channel_beta = check_flag(per_channel_beta, "per_channel_beta", type(self).__name__)
        self.log_beta = nn.Parameter(torch.empty(dim if per_channel_beta else 1, device=device, dtype=dtype))
        self.reset_parameters()

    @property
    def beta(self) -> Tensor:
        return self.log_beta.exp()

    def forward(self, x: Tensor) -> Tensor:
        p = self._parameters
        w, b = p["weight"], p.get("bias")
        if K.direct(self, x, p["log_beta"], w, b):
            scale = FN.channel_scale(x.shape[-1], self.scale)
            return cpu.pointwise_forward(x, self._op, p["log_beta"], None, w, b, scale, log_p0=True)
        return super().forward(x)

    def reset_parameters(self) -> None:
        super().reset_parameters()
        nn.init.constant_(self.log_beta, math.log(self.beta_init))

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, beta_init={self.beta_init}, per_channel_beta={self.per_channel_beta}, "
            f"scale={self.scale!r}"
        )


class DyISRU(_ISRUFamily):
    """DyISRU, sqrt(C) * x / sqrt(beta + x^2), then the affine: the exact element-wise counterpart of RMSNorm (the
    DyISRU paper eq. 16: Stollenwerk, "On the Mathematical Relationship Between Layer Normalization and Dynamic
    Activation Functions", arXiv 2503.21708). ``kernel="auto"`` fuses it on CUDA and CPU tensors.

    Args:
        dim: The number of channels C: the size of the normalized axis.
        beta_init: beta at init (``4.0 = 1 / 0.5**2``: DyT's slope at 0).
        per_channel_beta: One beta per channel instead of one for all.
        scale: "C" for sqrt(C) (the DyISRU paper, the default), "C-1" for sqrt(C-1).
        bias: Learn the channel shift (False: none).
        channel_dim: The axis of the channels: -1 (the last, as in a transformer) or another, e.g. 1 for NCHW.
        kernel: "auto" runs Triton on CUDA tensors and the fused C++ op on CPU tensors; "triton", "cpu" or
            "reference" (`normlab.functional`) forces one path.
        device: Where the parameters are created.
        dtype: The parameters' dtype.
    """

    _default_scale, _op = "C", "dyisru"

    def __init__(
        self,
        dim: int,
        *,
        beta_init: float = BETA_INIT,
        per_channel_beta: bool = False,
        scale: FN.Scale | None = None,
        bias: bool = True,
        channel_dim: int = -1,
        kernel: str = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.kernel = kernel_choice(kernel, "DyISRU")
        super().__init__(
            dim,
            beta_init=beta_init,
            per_channel_beta=per_channel_beta,
            scale=scale,
            bias=bias,
            channel_dim=channel_dim,
            device=device,
            dtype=dtype,
        )

    def _forward(self, x: Tensor) -> Tensor:
        self._check(x)
        return K.dyisru(x, self.beta, self.weight, self.bias, scale=self.scale, kernel=self.kernel)


class ELN(_ISRUFamily):
    """sqrt(C-1) * (x - mu) / sqrt(beta + (x - mu)^2) (the ELN paper eq. 13); not point-wise: mu couples channels.

    ``kernel="auto"`` runs the fused CPU path on CPU tensors (there is no Triton kernel for ELN).

    Args:
        dim: The number of channels C: the size of the normalized axis.
        kernel: "auto" runs the fused C++ op on CPU tensors; "cpu" or "reference" forces one path.
        **kwargs: The ISRU family's keywords: ``beta_init`` (``4.0 = 1 / 0.5**2``, DyT's slope at 0),
            ``per_channel_beta`` (False), ``scale`` ("C" for sqrt(C), "C-1" for sqrt(C-1)), ``bias`` (True),
            ``channel_dim`` (-1), ``device``, ``dtype``.
    """

    _default_scale, _op = "C-1", "eln"

    def __init__(self, dim: int, *, kernel: str = "auto", **kwargs: object) -> None:
        self.kernel = kernel_choice(kernel, "ELN", ("auto", "cpu", "reference"))
        super().__init__(dim, **kwargs)

    def _forward(self, x: Tensor) -> Tensor:
        self._check(x)
        return K.eln(x, self.beta, self.weight, self.bias, scale=self.scale, kernel=self.kernel)
