"""Every module works under torch.compile on CPU (default inductor backend), forward and backward."""

import pytest
import torch

from conftest import make_norm

pytestmark = pytest.mark.slow


def test_compiled_matches_eager(norm_name):
    torch._dynamo.reset()
    eager = make_norm(norm_name, 32, dtype=torch.float32).train()
    compiled_module = make_norm(norm_name, 32, dtype=torch.float32).train()  # identical twin
    compiled = torch.compile(compiled_module)
    x = torch.randn(4, 32)
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    for _ in range(2):  # twice: rms_ema's running average must update identically under compile
        y1, y2 = eager(x1), compiled(x2)
        torch.testing.assert_close(y2, y1, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(y1)
    y1.backward(g)
    y2.backward(g)
    torch.testing.assert_close(x2.grad, x1.grad, rtol=1e-4, atol=1e-5)
    for (n, p1), (_, p2) in zip(eager.named_parameters(), compiled_module.named_parameters()):
        torch.testing.assert_close(p2.grad, p1.grad, rtol=1e-4, atol=1e-5, msg=f"grad of {n}")
    for (n, b1), (_, b2) in zip(eager.named_buffers(), compiled_module.named_buffers()):
        torch.testing.assert_close(b2, b1, msg=f"buffer {n}")
