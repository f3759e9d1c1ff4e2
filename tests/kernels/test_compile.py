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


@pytest.mark.parametrize("norm_name", ["dyt", "derf", "dyisru", "eln", "scaled_dyt"])
def test_compiled_point_wise_norms_run_the_fused_op_in_one_graph(norm_name):
    """issue 97: under torch.compile a point-wise norm ran the reference (Inductor's code, 37 ms against the fused
    op's 15 ms for DyT forward and backward at 4 x 256 x 512); now the fused op is one node of the graph
    (``fullgraph=True`` holds: a fake implementation and an autograd formula, `kernels.cpu._register_for_compile`),
    and its output and every gradient equal the eager module's, which runs the same op."""
    import copy

    from normlab.kernels import cpu

    if not cpu.ready(wait=True):
        pytest.skip("the CPU kernels did not build here")
    torch.manual_seed(0)
    eager = make_norm(norm_name, 256, dtype=torch.float32).train()
    with torch.no_grad():
        for p in eager.parameters():
            p.add_(torch.rand_like(p) * 0.1)
    twin = copy.deepcopy(eager)
    compiled = torch.compile(twin, fullgraph=True)
    x1 = torch.randn(4, 64, 256, requires_grad=True)  # 65,536 elements: the size the fused CPU path takes
    x2 = x1.detach().clone().requires_grad_(True)
    y1 = eager(x1)
    y1.square().sum().backward()
    with torch.profiler.profile() as prof:
        y2 = compiled(x2)
        y2.square().sum().backward()
    ran = {e.key for e in prof.key_averages()}
    assert {"normlab_cpu::pointwise_fwd", "normlab_cpu::pointwise_bwd"} <= ran, sorted(k for k in ran if "::" in k)
    torch.testing.assert_close(y2, y1, rtol=0, atol=0)
    torch.testing.assert_close(x2.grad, x1.grad, rtol=0, atol=0)
    for (n, p), q in zip(eager.named_parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0, msg=n)
