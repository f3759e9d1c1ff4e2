"""Per-token Jacobians of normalizations: by autograd, by finite differences, and in closed form.

A norm acts on one token x in R^C at a time, so its Jacobian J_ij = dy_i / dx_j
is a C x C matrix. The dissection splits RMSNorm's into a diagonal gain term and a
rank-1 coupling term:

    J_ij = gamma_i / r * delta_ij  -  gamma_i x_i x_j / (C r^3),   r = sqrt(mean x^2 + eps).

For any registered norm, `decompose` splits J into its diagonal and its
off-diagonal part; for RMSNorm, `rms_norm_terms` gives the dissection's split.
The two agree up to the C diagonal entries of the rank-1 term (O(1/sqrt(C))).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

import normlab.functional as FN

__all__ = [
    "autograd_jacobian",
    "numerical_jacobian",
    "rms_norm_jacobian",
    "rms_norm_jacobian_eq6",
    "rms_norm_terms",
    "layer_norm_jacobian",
    "dyt_jacobian",
    "scaled_dyt_jacobian",
    "derf_jacobian",
    "dyisru_jacobian",
    "JacobianNorms",
    "decompose",
    "jacobian_table",
]


def _check_token(x: Tensor) -> None:
    if not isinstance(x, Tensor) or x.dim() != 1 or not x.is_floating_point():
        got = f"shape {tuple(x.shape)} dtype {x.dtype}" if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"expected one token: a 1-d floating tensor of shape (C,), got {got}")


def autograd_jacobian(fn: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """J = dy/dx of a per-token map ``fn`` at the token ``x`` (C,), by one backward pass.

    The token is repeated C times as a batch and the backward is seeded with the
    identity, so row i of the input gradient is row i of J. This uses the
    gradient the layer really defines (for ``rms_detached`` that is the
    surrogate, not the derivative of the forward), and works for custom
    ``autograd.Function``s. Layers with running statistics should be in eval mode.

    Args:
        fn: A per-token map (..., C) -> (..., C).
        x: One token, (C,).
    """
    _check_token(x)
    c = x.shape[0]
    xs = x.detach().expand(c, c).clone().requires_grad_(True)  # (C copies, C)
    y = fn(xs)
    (grad,) = torch.autograd.grad(y, xs, torch.eye(c, dtype=y.dtype, device=y.device))
    return grad


@torch.no_grad()
def numerical_jacobian(fn: Callable[[Tensor], Tensor], x: Tensor, h: float = 1e-7) -> Tensor:
    """J by central differences, (f(x + h e_j) - f(x - h e_j)) / 2h, all columns in one batch.

    Args:
        fn: A per-token map (..., C) -> (..., C).
        x: One token, (C,).
        h: The difference step.
    """
    _check_token(x)
    c = x.shape[0]
    step = h * torch.eye(c, dtype=x.dtype, device=x.device)
    return ((fn(x + step) - fn(x - step)) / (2 * h)).T


# --------------------------------------------------------------------------
# closed forms
# --------------------------------------------------------------------------
def _gamma(weight: Tensor | None, x: Tensor) -> Tensor:
    return torch.ones_like(x) if weight is None else weight.to(x)


def rms_norm_terms(x: Tensor, weight: Tensor | None = None, eps: float = FN.EPS) -> tuple[Tensor, Tensor]:
    """The dissection's split of RMSNorm's Jacobian: (diagonal gain term, rank-1 coupling term), J = D + K.

    D = diag(gamma) / r,  K = -(gamma * x) x^T / (C r^3).

    Args:
        x: One token, (C,).
        weight: gamma, (C,), or None (1).
        eps: Added to the mean square under the root.
    """
    _check_token(x)
    g = _gamma(weight, x)
    c = x.shape[0]
    r = torch.sqrt(x.pow(2).mean() + eps)
    return torch.diag(g / r), -torch.outer(g * x, x) / (c * r**3)


def rms_norm_jacobian(x: Tensor, weight: Tensor | None = None, eps: float = FN.EPS) -> Tensor:
    """RMSNorm's Jacobian, D + K of `rms_norm_terms`.

    Args:
        x: One token, (C,).
        weight: gamma, (C,), or None (1).
        eps: Added to the mean square under the root.
    """
    d, k = rms_norm_terms(x, weight, eps)
    return d + k


def rms_norm_jacobian_eq6(x: Tensor) -> Tensor:
    """The DyISRU paper eq. (6), RMSNorm with eps = 0 and no affine: sqrt(C)/||x|| (delta_ij - y_i y_j / C).

    Args:
        x: One token, (C,).
    """
    _check_token(x)
    c = x.shape[0]
    y = FN.rms_norm(x, eps=0.0)
    return math.sqrt(c) / x.norm() * (torch.eye(c, dtype=x.dtype, device=x.device) - torch.outer(y, y) / c)


def layer_norm_jacobian(x: Tensor, weight: Tensor | None = None, eps: float = 1e-5) -> Tensor:
    """LayerNorm: J_ij = gamma_i / s (delta_ij - 1/C - xhat_i xhat_j / C), s = sqrt(var + eps).

    Args:
        x: One token, (C,).
        weight: gamma, (C,), or None (1).
        eps: Added to the variance under the root.
    """
    _check_token(x)
    c = x.shape[0]
    xc = x - x.mean()
    s = torch.sqrt(xc.pow(2).mean() + eps)
    xhat = xc / s
    eye = torch.eye(c, dtype=x.dtype, device=x.device)
    return _gamma(weight, x)[:, None] / s * (eye - 1.0 / c - torch.outer(xhat, xhat) / c)


def dyt_jacobian(x: Tensor, alpha: Tensor | float, weight: Tensor | None = None) -> Tensor:
    """DyT is point-wise: J = diag(gamma * alpha * sech^2(alpha x)) (the dissection).

    Args:
        x: One token, (C,).
        alpha: A number or (C,).
        weight: gamma, (C,), or None (1).
    """
    _check_token(x)
    a = torch.as_tensor(alpha, dtype=x.dtype, device=x.device)
    return torch.diag(_gamma(weight, x) * a / torch.cosh(a * x).pow(2))


def scaled_dyt_jacobian(
    x: Tensor, alpha: Tensor | float, weight: Tensor | None = None, scale: FN.Scale = "C"
) -> Tensor:
    """Scaled DyT (the DyISRU paper eq. 12): J = diag(gamma * s * alpha * sech^2(alpha x)), s = sqrt(C) or sqrt(C-1).

    Args:
        x: One token, (C,).
        alpha: A number or (C,).
        weight: gamma, (C,), or None (1).
        scale: "C" for sqrt(C), "C-1" for sqrt(C-1).
    """
    return FN.channel_scale(x.shape[0], scale) * dyt_jacobian(x, alpha, weight)


def derf_jacobian(
    x: Tensor, alpha: Tensor | float, shift: Tensor | float = 0.0, weight: Tensor | None = None
) -> Tensor:
    """Derf is point-wise: J = diag(gamma * alpha * 2 / sqrt(pi) * exp(-(alpha x + s)^2)).

    Args:
        x: One token, (C,).
        alpha: A number or (C,).
        shift: A number or (C,).
        weight: gamma, (C,), or None (1).
    """
    _check_token(x)
    a = torch.as_tensor(alpha, dtype=x.dtype, device=x.device)
    z = a * x + torch.as_tensor(shift, dtype=x.dtype, device=x.device)
    return torch.diag(_gamma(weight, x) * a * (2 / math.sqrt(math.pi)) * torch.exp(-z * z))


def dyisru_jacobian(x: Tensor, beta: Tensor | float, weight: Tensor | None = None, scale: FN.Scale = "C") -> Tensor:
    """DyISRU (the DyISRU paper eq. 16): J = diag(gamma * s * beta / (beta + x^2)^(3/2)).

    Args:
        x: One token, (C,).
        beta: A number or (C,).
        weight: gamma, (C,), or None (1).
        scale: "C" for sqrt(C), "C-1" for sqrt(C-1).
    """
    _check_token(x)
    b = torch.as_tensor(beta, dtype=x.dtype, device=x.device)
    s = FN.channel_scale(x.shape[0], scale)
    return torch.diag(_gamma(weight, x) * s * b / (b + x.pow(2)).pow(1.5))


# --------------------------------------------------------------------------
# decomposition
# --------------------------------------------------------------------------
@dataclass(frozen=True)
class JacobianNorms:
    """Frobenius norms of a Jacobian and of its two parts."""

    diag: float
    coupling: float
    total: float
    split: str  # "gain+rank-1" (the dissection's split, RMSNorm) or "diagonal+off-diagonal"


def decompose(jac: Tensor, *, terms: tuple[Tensor, Tensor] | None = None) -> JacobianNorms:
    """Frobenius norms of J, its diagonal part and its coupling part.

    With ``terms=(D, K)`` (e.g. from `rms_norm_terms`) the split is the
    dissection's; otherwise D = diag(J) and K = J - diag(J), which is exactly zero for
    a point-wise norm.

    Args:
        jac: A Jacobian, (C, C).
        terms: (D, K), the diagonal and coupling terms; None: the diagonal of ``jac`` and the rest.
    """
    if terms is not None:
        d, k = terms
        split = "gain+rank-1"
    else:
        d = torch.diag(torch.diagonal(jac))
        k = jac - d
        split = "diagonal+off-diagonal"
    fro = lambda m: float(torch.linalg.matrix_norm(m.detach(), "fro"))  # noqa: E731
    return JacobianNorms(fro(d), fro(k), fro(jac), split)


MAX_JACOBIAN_BYTES = 4 * 2**30


def jacobian_table(
    norms: list[str],
    widths: list[int],
    *,
    std: float = 0.02,
    init: dict | None = None,
    tokens: int = 4,
    seed: int = 0,
) -> list[dict]:
    """The dissection's Jacobian table: Frobenius norms of J, its diagonal and coupling parts, averaged over tokens.

    Each norm is built at default init (gamma = 1) plus the keys of ``init`` it
    accepts, in float64, and evaluated at ``tokens`` tokens x ~ N(0, std^2 I). A key that no selected norm takes
    is an error.
    RMSNorm uses the dissection's gain/rank-1 split; other norms the diagonal/off-diagonal split.

    Args:
        norms: Registry names.
        widths: Token widths C.
        std: The tokens' standard deviation.
        init: Init keywords, each given to the norms that take it.
        tokens: Tokens averaged per norm and width.
        seed: Of the tokens.
    """
    from normlab.modules import prime_running_stats
    from normlab.registry import accepted_kwargs, create_norm, init_kwargs

    if not math.isfinite(std) or std <= 0:
        raise ValueError(f"expected an input std > 0, got {std}")
    if tokens < 1:
        raise ValueError(f"expected tokens >= 1, got {tokens}")
    init = init or {}
    unused = set(init) - {k for n in norms for k in init_kwargs(n)}
    if unused:
        raise ValueError(f"no selected norm takes {', '.join(sorted(unused))}")
    for width in widths:
        if not isinstance(width, int) or isinstance(width, bool) or width < 1:
            raise ValueError(f"expected widths >= 1, got {width!r}")
        need = 4 * 8 * width**2  # the C x C float64 Jacobian and its parts, a few at a time
        if need > MAX_JACOBIAN_BYTES:
            raise ValueError(
                f"width {width}: the Jacobian needs about {need / 2**30:.0f} GiB "
                f"(limit {MAX_JACOBIAN_BYTES / 2**30:.0f} GiB); use a width <= "
                f"{int((MAX_JACOBIAN_BYTES / 32) ** 0.5)}"
            )
    rows = []
    for width in widths:
        xs = torch.randn(tokens, width, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * std
        for name in norms:
            kwargs = accepted_kwargs(name, init)
            m = create_norm(name, width, **kwargs).double().eval()
            prime_running_stats(m, xs)  # rms_ema: its running mean from these tokens, as training would set it
            parts = []
            for x in xs:
                jac = autograd_jacobian(m, x)
                terms = rms_norm_terms(x, m.weight, m.eps) if name == "rms_norm" else None
                parts.append(decompose(jac, terms=terms))
            rows.append(
                {
                    "width": width,
                    "norm": name,
                    "init": kwargs,
                    "diag": sum(p.diag for p in parts) / tokens,
                    "coupling": sum(p.coupling for p in parts) / tokens,
                    "total": sum(p.total for p in parts) / tokens,
                    "split": parts[0].split,
                }
            )
    return rows
