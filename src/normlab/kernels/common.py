"""Launch configuration and the checks every fused op makes before it touches a kernel."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton


@dataclass(frozen=True)
class LaunchConfig:
    rows: int  # rows per program
    block_n: int  # columns per program
    num_warps: int


def launch_config(m: int, n: int, *, elementwise: bool) -> LaunchConfig:
    """Tiles of ``rows`` x ``block_n``: wide enough for 16-byte accesses, enough programs to fill a GPU.

    For element-wise ops the column tile is at most 1024 wide (a 2-D grid covers any N);
    each program walks ``rows`` rows, so the fp32 partial sums of the parameter
    gradients have cdiv(M, rows) rows: small against M x N.
    """
    block_n = min(triton.next_power_of_2(max(n, 1)), 1024 if elementwise else 65536)
    rows = 16 if m >= 4096 else 4 if m >= 256 else 1
    num_warps = 4 if block_n <= 1024 else 8 if block_n <= 4096 else 16
    return LaunchConfig(rows, block_n, num_warps)


def grid_2d(m: int, n: int, cfg: LaunchConfig) -> tuple[int, int]:
    return (triton.cdiv(m, cfg.rows), triton.cdiv(n, cfg.block_n))


def partial_rows(m: int, cfg: LaunchConfig) -> int:
    return max(1, triton.cdiv(m, cfg.rows))


def as_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """(..., N) -> (M, N) with unit column stride (a view when possible, else a contiguous copy)."""
    t2 = t.reshape(-1, n)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()
