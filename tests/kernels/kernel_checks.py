"""The comparison every fused path (Triton, CPU) passes: output and every gradient against the reference.

Tolerances, relative to the largest magnitude of each tensor:

| dtype    | output | gradients |
|----------|--------|-----------|
| float32  | 1e-5   | 1e-4      |
| float16  | 2e-3   | 4e-3      |
| bfloat16 | 1.6e-2 | 2e-2      |
"""

from __future__ import annotations

import torch

TOL = {torch.float32: (1e-5, 1e-4), torch.float16: (2e-3, 4e-3), torch.bfloat16: (1.6e-2, 2e-2)}
ROWS, CHANNELS = [1, 3, 37], [1, 7, 128, 1023]
VARIANTS, VARIANT_IDS = [(False, True), (True, True), (False, False)], ["scalar", "per_channel", "no_bias"]


def close(got, ref, tol, what, floor=1e-6):
    got, ref = got.detach().double(), ref.detach().double()
    scale = max(float(ref.abs().max()), floor)
    err = float((got - ref).abs().max()) / scale
    assert err <= tol, f"{what}: max error {err:.2e} (relative to {scale:.3g}) > {tol}"


def inputs(m, n, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, n, generator=g) * 2).to(device, dtype)
    dy = torch.randn(m, n, generator=g).to(device, dtype)
    w = (1 + 0.3 * torch.randn(n, generator=g)).to(device, dtype)
    b = (0.1 * torch.randn(n, generator=g)).to(device, dtype)
    return x, dy, w, b, g


def check(fused, reference, tensors, dy, dtype, name, grad_floor=1e-6):
    """Run both on leaf copies; compare outputs and the gradient of every tensor.

    ``grad_floor`` is the smallest scale an error is measured against: RMSNorm's dx is a difference of
    two terms of size |dy * w| / r, which cancel at C = 1, so its error is relative to that size.
    """
    out_tol, grad_tol = TOL[dtype]
    ours = [t.detach().clone().requires_grad_(True) for t in tensors]
    ref = [t.detach().double().clone().requires_grad_(True) for t in tensors]  # the same rounded values, in float64
    y = fused(*ours)
    y_ref = reference(*ref)
    assert y.dtype == dtype and y.shape == y_ref.shape
    close(y, y_ref, out_tol, f"{name} output")
    y.backward(dy)
    y_ref.backward(dy.double())
    for i, (a, b) in enumerate(zip(ours, ref)):
        assert a.grad is not None and a.grad.dtype == a.dtype, f"{name}: gradient {i} missing or of the wrong dtype"
        close(a.grad, b.grad, grad_tol, f"{name} gradient {i}", grad_floor)
