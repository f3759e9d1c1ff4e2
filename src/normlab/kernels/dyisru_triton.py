"""Fused DyISRU in Triton (no public kernel existed before this one).

Formula (reference: `normlab.functional.dyisru`), for x of shape (M, N) and s = sqrt(N)
(or sqrt(N-1) for scale "C-1"):

    y[m, n] = w[n] * s * x * r + b[n],   r = 1 / sqrt(beta[n] + x^2)       beta scalar or per channel

VJP, with g = dL/dy:

    dx[m, n]  = g * w[n] * s * beta[n] * r^3
    dw[n]     = sum_m g * s * x * r
    db[n]     = sum_m g
    dbeta[n]  = sum_m g * w[n] * s * (-x r^3 / 2)        (summed over n too for a scalar beta)

x^2 is formed in fp32, so float16 inputs up to 65504 cannot overflow (x^2 would in fp16
above 256). Beyond |x| = 1e18 (and at +-inf) y saturates to w s sign(x) + b with every derivative 0,
as the reference's hypot form does; a NaN stays NaN. The forward saves only its input; the parameter
gradients are reduced in two stages (fp32 partials per program, summed on the host), deterministically.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from normlab.kernels.common import as_rows, grid_2d, launch_config, partial_rows


@triton.jit
def _dyisru_fwd(
    X,
    Y,  # (M, N) input and output, unit column stride
    BETA,
    W,
    B,  # beta: (1,) or (N,), > 0; weight (N,); bias (N,) or unused
    M,
    N,
    stride_x,
    stride_y,
    scale,  # scale: sqrt(N) or sqrt(N - 1)
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BETA_PER_CHANNEL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    if BETA_PER_CHANNEL:
        beta = tl.load(BETA + cols, mask=cmask, other=1.0).to(tl.float32)
    else:
        beta = tl.load(BETA).to(tl.float32)
    ws = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32) * scale
    b = tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32) if HAS_BIAS else 0.0
    for i in range(ROWS):
        row = pid_m * ROWS + i
        mask = cols < tl.where(row < M, N, 0)  # one comparison: the interpreter rejects mask & scalar-mask
        x = tl.load(X + row.to(tl.int64) * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        big = tl.abs(x) > 1e18  # x^2 would overflow: the limit sign(x), as the reference (hypot; +-inf too)
        f = tl.where(big, tl.where(x < 0, -1.0, 1.0), x * tl.rsqrt(beta + x * x))
        y = ws * f + b
        tl.store(Y + row.to(tl.int64) * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _dyisru_bwd(
    X,
    G,
    DX,  # (M, N) input, upstream gradient, input gradient
    BETA,
    W,
    DBETA_P,
    DW_P,
    DB_P,  # (programs_m, N) fp32 partial sums
    M,
    N,
    stride_x,
    stride_g,
    stride_dx,
    scale,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BETA_PER_CHANNEL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    if BETA_PER_CHANNEL:
        beta = tl.load(BETA + cols, mask=cmask, other=1.0).to(tl.float32)
    else:
        beta = tl.load(BETA).to(tl.float32)
    ws = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32) * scale
    dbeta = tl.zeros((BLOCK_N,), tl.float32)
    dw = tl.zeros((BLOCK_N,), tl.float32)
    db = tl.zeros((BLOCK_N,), tl.float32)
    for i in range(ROWS):
        row = pid_m * ROWS + i
        mask = cols < tl.where(row < M, N, 0)  # one comparison: the interpreter rejects mask & scalar-mask
        x = tl.load(X + row.to(tl.int64) * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(G + row.to(tl.int64) * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
        big = tl.abs(x) > 1e18  # saturated: f = sign(x), every derivative 0 (and no inf * 0 below)
        xs = tl.where(big, 0.0, x)
        r = tl.rsqrt(beta + xs * xs)
        r3 = tl.where(big, 0.0, r * r * r)
        f = tl.where(big, tl.where(x < 0, -1.0, 1.0), xs * r)
        gws = g * ws
        tl.store(DX + row.to(tl.int64) * stride_dx + cols, (gws * beta * r3).to(DX.dtype.element_ty), mask=mask)
        dbeta += -0.5 * gws * xs * r3
        dw += g * scale * f
        db += g
    out = pid_m.to(tl.int64) * N + cols
    tl.store(DBETA_P + out, dbeta, mask=cmask)
    tl.store(DW_P + out, dw, mask=cmask)
    if HAS_BIAS:
        tl.store(DB_P + out, db, mask=cmask)


class DyISRUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, beta, weight, bias, scale: float):
        shape = x.shape
        x2 = as_rows(x, shape[-1])
        m, n = x2.shape
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
        cfg = launch_config(m, n, elementwise=True)
        if m:
            _dyisru_fwd[grid_2d(m, n, cfg)](
                x2,
                y,
                beta,
                weight,
                bias if bias is not None else weight,
                m,
                n,
                x2.stride(0),
                y.stride(0),
                scale,
                ROWS=cfg.rows,
                BLOCK_N=cfg.block_n,
                BETA_PER_CHANNEL=beta.numel() > 1,
                HAS_BIAS=bias is not None,
                num_warps=cfg.num_warps,
            )
        ctx.save_for_backward(x2, beta, weight)
        ctx.has_bias, ctx.shape, ctx.scale = bias is not None, shape, scale
        return y.view(shape)

    @staticmethod
    def backward(ctx, grad):
        x2, beta, weight = ctx.saved_tensors
        m, n = x2.shape
        g2 = as_rows(grad, n)
        dx = torch.empty_like(x2)
        cfg = launch_config(m, n, elementwise=True)
        pm = partial_rows(m, cfg)
        dbeta_p, dw_p, db_p = (torch.zeros((pm, n), dtype=torch.float32, device=x2.device) for _ in range(3))
        if m:
            _dyisru_bwd[grid_2d(m, n, cfg)](
                x2,
                g2,
                dx,
                beta,
                weight,
                dbeta_p,
                dw_p,
                db_p,
                m,
                n,
                x2.stride(0),
                g2.stride(0),
                dx.stride(0),
                ctx.scale,
                ROWS=cfg.rows,
                BLOCK_N=cfg.block_n,
                BETA_PER_CHANNEL=beta.numel() > 1,
                HAS_BIAS=ctx.has_bias,
                num_warps=cfg.num_warps,
            )
        dbeta = dbeta_p.sum(0)
        dbeta = (dbeta if beta.numel() > 1 else dbeta.sum().reshape(beta.shape)).to(beta.dtype)
        dw = dw_p.sum(0).to(weight.dtype)
        db = db_p.sum(0).to(weight.dtype) if ctx.has_bias else None
        return dx.view(ctx.shape), dbeta, dw, db, None


def dyisru(x, beta, weight, bias=None, scale: float | None = None):
    """Fused DyISRU; ``scale`` defaults to sqrt(C) as in `normlab.functional.dyisru`."""
    return DyISRUFunction.apply(x, beta, weight, bias, float(scale if scale is not None else x.shape[-1] ** 0.5))
