"""Fused Derf in Triton: forward and backward in one pass over memory each.

Formula (reference: `normlab.functional.derf`), for x of shape (M, N):

    y[m, n] = w[n] * erf(a[n] * x[m, n] + s[n]) + b[n]        a and s scalar or per channel

VJP, with z = a x + s, e = erf(z) and g = dL/dy:

    dz[m, n] = g * w[n] * 2 / sqrt(pi) * exp(-z^2)
    dx[m, n] = dz * a[n]
    da[n]    = sum_m dz * x          ds[n] = sum_m dz          (summed over n too when scalar)
    dw[n]    = sum_m g * e           db[n] = sum_m g

As in the DyT kernel, the backward recomputes z from x (the forward saves only its input and the
parameters), and parameter gradients are reduced in two stages without atomics. All arithmetic is fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from normlab.kernels.common import as_rows, grid_2d, launch_config, partial_rows


@triton.jit
def _alpha_shift(A, S, cols, cmask, PER_CHANNEL: tl.constexpr):
    """alpha and shift as fp32, per channel or broadcast scalars."""
    if PER_CHANNEL:
        a = tl.load(A + cols, mask=cmask, other=0.0).to(tl.float32)
        s = tl.load(S + cols, mask=cmask, other=0.0).to(tl.float32)
    else:
        a = tl.load(A).to(tl.float32)
        s = tl.load(S).to(tl.float32)
    return a, s


@triton.jit
def _derf_fwd(
    X,
    Y,  # (M, N) input and output, row stride stride_x / stride_y, unit column stride
    A,
    S,
    W,
    B,  # alpha and shift: (1,) or (N,); weight (N,); bias (N,) or unused when HAS_BIAS is False
    M,
    N,
    stride_x,
    stride_y,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PER_CHANNEL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    a, s = _alpha_shift(A, S, cols, cmask, PER_CHANNEL)
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    b = tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32) if HAS_BIAS else 0.0
    for i in range(ROWS):
        row = pid_m * ROWS + i
        mask = cols < tl.where(row < M, N, 0)  # one comparison: the interpreter rejects mask & scalar-mask
        x = tl.load(X + row.to(tl.int64) * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        y = w * tl.math.erf(a * x + s) + b
        tl.store(Y + row.to(tl.int64) * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _derf_bwd(
    X,
    G,
    DX,  # (M, N) input, upstream gradient, input gradient
    A,
    S,
    W,  # alpha and shift (1,) or (N,), weight (N,)
    DA_P,
    DS_P,
    DW_P,
    DB_P,  # (programs_m, N) fp32 partial sums of the parameter gradients
    M,
    N,
    stride_x,
    stride_g,
    stride_dx,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PER_CHANNEL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    a, s = _alpha_shift(A, S, cols, cmask, PER_CHANNEL)
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    da = tl.zeros((BLOCK_N,), tl.float32)
    ds = tl.zeros((BLOCK_N,), tl.float32)
    dw = tl.zeros((BLOCK_N,), tl.float32)
    db = tl.zeros((BLOCK_N,), tl.float32)
    for i in range(ROWS):
        row = pid_m * ROWS + i
        mask = cols < tl.where(row < M, N, 0)
        x = tl.load(X + row.to(tl.int64) * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(G + row.to(tl.int64) * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
        z = a * x + s
        dz = g * w * 1.1283791670955126 * tl.exp(-z * z)  # 2 / sqrt(pi) exp(-z^2) = erf'(z)
        tl.store(DX + row.to(tl.int64) * stride_dx + cols, (dz * a).to(DX.dtype.element_ty), mask=mask)
        da += dz * x
        ds += dz
        dw += g * tl.math.erf(z)
        db += g
    out = pid_m.to(tl.int64) * N + cols
    tl.store(DA_P + out, da, mask=cmask)
    tl.store(DS_P + out, ds, mask=cmask)
    tl.store(DW_P + out, dw, mask=cmask)
    if HAS_BIAS:
        tl.store(DB_P + out, db, mask=cmask)


def _reduce(partials: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    total = partials.sum(0)  # second stage: a deterministic reduction over programs
    return (total if p.numel() > 1 else total.sum().reshape(p.shape)).to(p.dtype)


class DerfFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, alpha, shift, weight, bias):
        if alpha.shape != shift.shape:
            raise ValueError(
                f"derf (fused): alpha {tuple(alpha.shape)} and shift {tuple(shift.shape)} must have "
                "one shape, (1,) or (C,)"
            )
        shape = x.shape
        x2 = as_rows(x, shape[-1])
        m, n = x2.shape
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
        cfg = launch_config(m, n, elementwise=True)
        if m:
            _derf_fwd[grid_2d(m, n, cfg)](
                x2,
                y,
                alpha,
                shift,
                weight,
                bias if bias is not None else weight,
                m,
                n,
                x2.stride(0),
                y.stride(0),
                ROWS=cfg.rows,
                BLOCK_N=cfg.block_n,
                PER_CHANNEL=alpha.numel() > 1,
                HAS_BIAS=bias is not None,
                num_warps=cfg.num_warps,
            )
        ctx.save_for_backward(x2, alpha, shift, weight)  # the input only: z is recomputed in the backward
        ctx.has_bias, ctx.shape = bias is not None, shape
        return y.view(shape)

    @staticmethod
    def backward(ctx, grad):
        x2, alpha, shift, weight = ctx.saved_tensors
        m, n = x2.shape
        g2 = as_rows(grad, n)
        dx = torch.empty_like(x2)
        cfg = launch_config(m, n, elementwise=True)
        pm = partial_rows(m, cfg)
        da_p, ds_p, dw_p, db_p = (torch.zeros((pm, n), dtype=torch.float32, device=x2.device) for _ in range(4))
        if m:
            _derf_bwd[grid_2d(m, n, cfg)](
                x2,
                g2,
                dx,
                alpha,
                shift,
                weight,
                da_p,
                ds_p,
                dw_p,
                db_p,
                m,
                n,
                x2.stride(0),
                g2.stride(0),
                dx.stride(0),
                ROWS=cfg.rows,
                BLOCK_N=cfg.block_n,
                PER_CHANNEL=alpha.numel() > 1,
                HAS_BIAS=ctx.has_bias,
                num_warps=cfg.num_warps,
            )
        db = db_p.sum(0).to(weight.dtype) if ctx.has_bias else None
        return dx.view(ctx.shape), _reduce(da_p, alpha), _reduce(ds_p, shift), dw_p.sum(0).to(weight.dtype), db


def derf(
    x: torch.Tensor, alpha: torch.Tensor, shift: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Fused Derf; same contract as `normlab.functional.derf` with a weight."""
    return DerfFunction.apply(x, alpha, shift, weight, bias)
