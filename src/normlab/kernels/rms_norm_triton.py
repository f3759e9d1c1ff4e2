"""Fused RMSNorm in Triton.

Formula (reference: `normlab.functional.rms_norm`), per row x of length N:

    rstd = 1 / sqrt(mean(x^2) + eps),   y = x * rstd * w

VJP, with g = dL/dy (the dissection: the diagonal term minus the rank-1 coupling term):

    dx = rstd * (g * w) - rstd^3 / N * x * sum_n(g * w * x)
    dw = sum_m g * x * rstd

The forward saves the input and the fp32 rstd (M floats). A row that fits one block
(N <= 8192 here) is read once; a longer row is streamed in chunks, read twice. dw is
reduced in two stages: fp32 partials per program, summed on the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from normlab.kernels.common import as_rows

MAX_BLOCK = 8192


@triton.jit
def _rms_fwd(
    X,
    Y,
    W,
    RSTD,  # (M, N) input, output; weight (N,); rstd (M,) fp32
    M,
    N,
    stride_x,
    stride_y,
    eps,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SINGLE: tl.constexpr,  # SINGLE: the row fits one block
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    for i in range(ROWS):
        row = pid * ROWS + i
        if row < M:
            xr = X + row.to(tl.int64) * stride_x
            yr = Y + row.to(tl.int64) * stride_y
            if SINGLE:
                mask = cols < N
                x = tl.load(xr + cols, mask=mask, other=0.0).to(tl.float32)
                rstd = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
                w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
                tl.store(yr + cols, (x * rstd * w).to(Y.dtype.element_ty), mask=mask)
            else:
                acc = tl.zeros((BLOCK_N,), tl.float32)
                for start in range(0, N, BLOCK_N):
                    c = start + cols
                    x = tl.load(xr + c, mask=c < N, other=0.0).to(tl.float32)
                    acc += x * x
                rstd = tl.rsqrt(tl.sum(acc, axis=0) / N + eps)
                for start in range(0, N, BLOCK_N):
                    c = start + cols
                    x = tl.load(xr + c, mask=c < N, other=0.0).to(tl.float32)
                    w = tl.load(W + c, mask=c < N, other=0.0).to(tl.float32)
                    tl.store(yr + c, (x * rstd * w).to(Y.dtype.element_ty), mask=c < N)
            tl.store(RSTD + row, rstd)


@triton.jit
def _rms_bwd(
    X,
    G,
    DX,
    W,
    RSTD,
    DW_P,  # DW_P: (programs, N) fp32 partial sums of dw
    M,
    N,
    stride_x,
    stride_g,
    stride_dx,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SINGLE: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    if SINGLE:
        mask = cols < N
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        dw = tl.zeros((BLOCK_N,), tl.float32)
        for i in range(ROWS):
            row = pid * ROWS + i
            if row < M:
                x = tl.load(X + row.to(tl.int64) * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
                g = tl.load(G + row.to(tl.int64) * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
                rstd = tl.load(RSTD + row)
                gw = g * w
                dot = tl.sum(gw * x, axis=0)
                dx = rstd * gw - (rstd * rstd * rstd / N) * dot * x
                tl.store(DX + row.to(tl.int64) * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)
                dw += g * x * rstd
        tl.store(DW_P + pid.to(tl.int64) * N + cols, dw, mask=mask)
    else:
        for i in range(ROWS):
            row = pid * ROWS + i
            if row < M:
                rstd = tl.load(RSTD + row)
                acc = tl.zeros((BLOCK_N,), tl.float32)
                for start in range(0, N, BLOCK_N):
                    c = start + cols
                    x = tl.load(X + row.to(tl.int64) * stride_x + c, mask=c < N, other=0.0).to(tl.float32)
                    g = tl.load(G + row.to(tl.int64) * stride_g + c, mask=c < N, other=0.0).to(tl.float32)
                    w = tl.load(W + c, mask=c < N, other=0.0).to(tl.float32)
                    acc += g * w * x
                dot = tl.sum(acc, axis=0)
                for start in range(0, N, BLOCK_N):
                    c = start + cols
                    x = tl.load(X + row.to(tl.int64) * stride_x + c, mask=c < N, other=0.0).to(tl.float32)
                    g = tl.load(G + row.to(tl.int64) * stride_g + c, mask=c < N, other=0.0).to(tl.float32)
                    w = tl.load(W + c, mask=c < N, other=0.0).to(tl.float32)
                    dx = rstd * g * w - (rstd * rstd * rstd / N) * dot * x
                    tl.store(DX + row.to(tl.int64) * stride_dx + c, dx.to(DX.dtype.element_ty), mask=c < N)
                    p = DW_P + pid.to(tl.int64) * N + c
                    tl.store(p, tl.load(p, mask=c < N, other=0.0) + g * x * rstd, mask=c < N)


def _config(m: int, n: int) -> tuple[int, int, bool, int]:
    block = min(triton.next_power_of_2(max(n, 1)), MAX_BLOCK)
    rows = 8 if m >= 8192 else 4 if m >= 1024 else 1
    warps = 4 if block <= 1024 else 8 if block <= 4096 else 16
    return rows, block, n <= block, warps


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps: float):
        shape = x.shape
        x2 = as_rows(x, shape[-1])
        m, n = x2.shape
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
        rstd = torch.empty(m, dtype=torch.float32, device=x.device)
        rows, block, single, warps = _config(m, n)
        if m:
            _rms_fwd[(triton.cdiv(m, rows),)](
                x2,
                y,
                weight,
                rstd,
                m,
                n,
                x2.stride(0),
                y.stride(0),
                eps,
                ROWS=rows,
                BLOCK_N=block,
                SINGLE=single,
                num_warps=warps,
            )
        ctx.save_for_backward(x2, weight, rstd)
        ctx.shape = shape
        return y.view(shape)

    @staticmethod
    def backward(ctx, grad):
        x2, weight, rstd = ctx.saved_tensors
        m, n = x2.shape
        g2 = as_rows(grad, n)
        dx = torch.empty_like(x2)
        rows, block, single, warps = _config(m, n)
        programs = max(1, triton.cdiv(m, rows))
        dw_p = torch.zeros((programs, n), dtype=torch.float32, device=x2.device)
        if m:
            _rms_bwd[(programs,)](
                x2,
                g2,
                dx,
                weight,
                rstd,
                dw_p,
                m,
                n,
                x2.stride(0),
                g2.stride(0),
                dx.stride(0),
                ROWS=rows,
                BLOCK_N=block,
                SINGLE=single,
                num_warps=warps,
            )
        return dx.view(ctx.shape), dw_p.sum(0).to(weight.dtype), None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Fused RMSNorm; same contract as `normlab.functional.rms_norm` with a weight."""
    return RMSNormFunction.apply(x, weight, float(eps))
