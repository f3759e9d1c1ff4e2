"""Fused DyT in Triton: forward and backward in one pass over memory each.

Formula (reference: `normlab.functional.dyt`), for x of shape (M, N):

    y[m, n] = w[n] * tanh(a[n] * x[m, n]) + b[n]        a scalar or per channel

VJP, with t = tanh(a x) and g = dL/dy:

    dx[m, n] = g * w[n] * a[n] * (1 - t^2)
    dw[n]    = sum_m g * t
    db[n]    = sum_m g
    da[n]    = sum_m g * w[n] * x * (1 - t^2)           (summed over n too for a scalar alpha)

The backward recomputes t from x, so the forward saves only its input (and the
parameters). Parameter gradients are reduced in two stages without atomics:
each program writes fp32 partial sums over its rows, and the host sums the
partials, so the result is deterministic. All arithmetic is fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from normlab.kernels.common import as_rows, grid_2d, launch_config, partial_rows


@triton.jit
def _tanh(z):
    # tanh(z) = 1 - 2 / (exp(2z) + 1): exact at both ends in fp32 (exp overflow gives 1, underflow -1)
    return 1.0 - 2.0 / (tl.exp(2.0 * z) + 1.0)


@triton.jit
def _dyt_fwd(
    X,
    Y,  # (M, N) input and output, row stride stride_x / stride_y, unit column stride
    A,
    W,
    B,  # alpha: (1,) or (N,); weight (N,); bias (N,) or unused when HAS_BIAS is False
    M,
    N,
    stride_x,
    stride_y,
    ROWS: tl.constexpr,  # rows handled by one program
    BLOCK_N: tl.constexpr,  # columns handled by one program
    ALPHA_PER_CHANNEL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    a = tl.load(A + cols, mask=cmask, other=0.0).to(tl.float32) if ALPHA_PER_CHANNEL else tl.load(A).to(tl.float32)
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    b = tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32) if HAS_BIAS else 0.0
    for i in range(ROWS):
        row = pid_m * ROWS + i
        mask = cols < tl.where(row < M, N, 0)  # one comparison: the interpreter rejects mask & scalar-mask
        x = tl.load(X + row.to(tl.int64) * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        y = w * _tanh(a * x) + b
        tl.store(Y + row.to(tl.int64) * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _dyt_bwd(
    X,
    G,
    DX,  # (M, N) input, upstream gradient, input gradient
    A,
    W,  # alpha (1,) or (N,), weight (N,)
    DA_P,
    DW_P,
    DB_P,  # (programs_m, N) fp32 partial sums of the parameter gradients
    M,
    N,
    stride_x,
    stride_g,
    stride_dx,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ALPHA_PER_CHANNEL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    a = tl.load(A + cols, mask=cmask, other=0.0).to(tl.float32) if ALPHA_PER_CHANNEL else tl.load(A).to(tl.float32)
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    da = tl.zeros((BLOCK_N,), tl.float32)
    dw = tl.zeros((BLOCK_N,), tl.float32)
    db = tl.zeros((BLOCK_N,), tl.float32)
    for i in range(ROWS):
        row = pid_m * ROWS + i
        mask = cols < tl.where(row < M, N, 0)  # one comparison: the interpreter rejects mask & scalar-mask
        x = tl.load(X + row.to(tl.int64) * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(G + row.to(tl.int64) * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
        t = _tanh(a * x)
        dt = g * w * (1.0 - t * t)  # dL/d(a x)
        tl.store(DX + row.to(tl.int64) * stride_dx + cols, (dt * a).to(DX.dtype.element_ty), mask=mask)
        da += dt * x
        dw += g * t
        db += g
    out = pid_m.to(tl.int64) * N + cols
    tl.store(DA_P + out, da, mask=cmask)
    tl.store(DW_P + out, dw, mask=cmask)
    if HAS_BIAS:
        tl.store(DB_P + out, db, mask=cmask)


class DyTFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, alpha: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        shape = x.shape
        x2 = as_rows(x, shape[-1])
        m, n = x2.shape
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
        cfg = launch_config(m, n, elementwise=True)
        if m:
            _dyt_fwd[grid_2d(m, n, cfg)](
                x2,
                y,
                alpha,
                weight,
                bias if bias is not None else weight,
                m,
                n,
                x2.stride(0),
                y.stride(0),
                ROWS=cfg.rows,
                BLOCK_N=cfg.block_n,
                ALPHA_PER_CHANNEL=alpha.numel() > 1,
                HAS_BIAS=bias is not None,
                num_warps=cfg.num_warps,
            )
        ctx.save_for_backward(x2, alpha, weight)  # the input only: t is recomputed in the backward
        ctx.has_bias, ctx.shape = bias is not None, shape
        return y.view(shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x2, alpha, weight = ctx.saved_tensors
        m, n = x2.shape
        g2 = as_rows(grad, n)
        dx = torch.empty_like(x2)
        cfg = launch_config(m, n, elementwise=True)
        pm = partial_rows(m, cfg)
        da_p, dw_p, db_p = (torch.zeros((pm, n), dtype=torch.float32, device=x2.device) for _ in range(3))
        if m:
            _dyt_bwd[grid_2d(m, n, cfg)](
                x2,
                g2,
                dx,
                alpha,
                weight,
                da_p,
                dw_p,
                db_p,
                m,
                n,
                x2.stride(0),
                g2.stride(0),
                dx.stride(0),
                ROWS=cfg.rows,
                BLOCK_N=cfg.block_n,
                ALPHA_PER_CHANNEL=alpha.numel() > 1,
                HAS_BIAS=ctx.has_bias,
                num_warps=cfg.num_warps,
            )
        da = da_p.sum(0)  # second stage: a deterministic reduction over programs
        da = (da if alpha.numel() > 1 else da.sum().reshape(alpha.shape)).to(alpha.dtype)
        dw = dw_p.sum(0).to(weight.dtype)
        db = db_p.sum(0).to(weight.dtype) if ctx.has_bias else None
        return dx.view(ctx.shape), da, dw, db


def dyt(x: torch.Tensor, alpha: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Fused DyT; same contract as `normlab.functional.dyt` with a weight."""
    return DyTFunction.apply(x, alpha, weight, bias)
