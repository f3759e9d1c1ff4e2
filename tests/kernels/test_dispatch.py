"""Which path a norm takes (NORMLAB_KERNEL, device and dtype, and whether autograd records the call)."""

from __future__ import annotations

import kernel_checks as KC
import pytest
import torch

import normlab
import normlab.kernels as K
from normlab.kernels import cpu


# 2: kernel="auto" on CUDA takes the reference for a dtype the Triton kernels do not take
@pytest.mark.parametrize("name", ["dyt", "dyisru", "derf", "scaled_dyt", "rms_norm"])
def test_auto_on_cuda_float64_takes_the_reference(monkeypatch, name):
    monkeypatch.setattr(K, "on_cuda", lambda x: True)  # the CUDA branch, taken on a CPU tensor
    monkeypatch.setattr(K, "triton_status", lambda: (True, ""))
    x = torch.randn(3, 16, dtype=torch.float64)
    assert K.select("auto", x, name) == "reference"
    assert K.select("auto", x.float(), name) == "triton"
    norm = normlab.create_norm(name, 16).double()
    ref = normlab.create_norm(name, 16, kernel="reference").double()
    torch.testing.assert_close(norm(x), ref(x), rtol=0, atol=0)


@pytest.mark.parametrize("op", ["dyt", "derf", "dyisru", "eln", "rms_norm"])
def test_a_call_autograd_does_not_record_skips_the_autograd_function_and_gives_the_same_bits(op, monkeypatch):
    """Inference (inference_mode, no_grad, or nothing requiring a gradient) calls the op directly: the same output,
    bit for bit, as the recorded call, and the autograd function never runs; a call that autograd records still goes
    through it, whichever single tensor requires the gradient."""
    x, _, w, b, _ = KC.inputs(1, 576, torch.float32, "cpu", 0)
    p = torch.full((1,), 0.6)
    call = {
        "dyt": lambda x, p, w, b: cpu.dyt(x, p, w, b),
        "derf": lambda x, p, w, b: cpu.derf(x, p, 0.1 * p.detach(), w, b),
        "dyisru": lambda x, p, w, b: cpu.dyisru(x, p, w, b),
        "eln": lambda x, p, w, b: cpu.eln(x, p, w, b),
        "rms_norm": lambda x, p, w, b: cpu.rms_norm(x, w, 1e-6),
    }[op]
    recorded = call(*(t.clone().requires_grad_(True) for t in (x, p, w, b)))
    fn = cpu._RMSNormFn if op == "rms_norm" else cpu._PointwiseFn
    applied = []
    real_apply = fn.apply
    monkeypatch.setattr(fn, "apply", lambda *a: applied.append(1) or real_apply(*a))
    for context in (torch.inference_mode, torch.no_grad):
        with context():
            assert torch.equal(call(x, p, w, b), recorded.detach())
    assert torch.equal(call(x, p, w, b), recorded.detach()) and not applied
    for i in (0, 2) if op == "rms_norm" else (0, 1, 2, 3):
        leaves = [t.clone().requires_grad_(j == i) for j, t in enumerate((x, p, w, b))]
        y = call(*leaves)
        y.sum().backward()
        assert leaves[i].grad is not None and torch.isfinite(leaves[i].grad).all(), (op, i)
    assert len(applied) == (2 if op == "rms_norm" else 4)
