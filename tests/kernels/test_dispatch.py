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


FUSED_MODULES = ["dyt", "scaled_dyt", "derf", "dyisru", "eln", "rms_norm"]


def _module(name, c=48, **kw):
    torch.manual_seed(0)
    m = normlab.create_norm(name, c, **kw)
    with torch.no_grad():  # parameters away from their inits, so that a wrong argument order shows
        for p in m.parameters():
            p.mul_(1 + 0.2 * torch.rand_like(p)).add_(0.05)
    return m


@pytest.mark.parametrize("name", FUSED_MODULES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inference_goes_straight_to_the_op_with_the_routed_paths_bits(name, dtype, monkeypatch):
    """With autograd off, a fused module on a CPU tensor calls its op without the routing (K.select never runs), and
    gives the routed call's output bit for bit (the routed call: the same module, autograd recording), the edges
    included: huge, denormal, inf and NaN inputs."""
    assert cpu.ready(wait=True)
    m = _module(name, kernel="cpu").to(dtype)
    x = torch.randn(2, 3, 48) * 2
    x[1, 0, :6] = torch.tensor([1e30, -1e30, 1e-40, float("inf"), float("-inf"), float("nan")])
    x[1, 1] = 3e-39  # a row of denormals (RMSNorm's and ELN's statistics)
    x = x.to(dtype)
    routed = m(x).detach()  # parameters require grad: autograd records, K.select routes
    same = dict(rtol=0, atol=0, equal_nan=True)
    real = K.select
    monkeypatch.setattr(K, "select", lambda *a, **k: pytest.fail("the routing ran in inference"))
    for context in (torch.inference_mode, torch.no_grad):
        with context():
            torch.testing.assert_close(m(x), routed, **same)
    monkeypatch.setattr(K, "select", real)
    m_auto = _module(name).to(dtype)  # kernel="auto": the same
    with torch.inference_mode():
        torch.testing.assert_close(m_auto(x), routed, **same)


@pytest.mark.parametrize("kind", ["dyisru", "eln"])
def test_the_forward_op_takes_beta_as_its_log_for_dyisru_and_eln_only(kind):
    """``log_p0``: the op takes exp of the stored log(beta) itself, with torch.exp's bits; DyT and Derf refuse it."""
    assert cpu.ready(wait=True)
    x, w = torch.randn(3, 40) * 2, torch.rand(40) + 0.5
    for log_beta in (torch.tensor([1.3]), torch.randn(40)):
        direct = cpu.pointwise_forward(x, kind, log_beta, None, w, None, 2.0, log_p0=True)
        assert torch.equal(direct, cpu.pointwise_forward(x, kind, log_beta.exp(), None, w, None, 2.0))
    for other in ("dyt", "derf"):
        with pytest.raises(RuntimeError, match="log_p0 is for DyISRU and ELN"):
            cpu.pointwise_forward(x, other, torch.ones(1), torch.zeros(1), w, None, log_p0=True)


def _refuse_ops(monkeypatch):
    for op in ("dyt", "derf", "dyisru", "eln", "rms_norm", "pointwise_forward", "rms_forward"):
        monkeypatch.setattr(cpu, op, lambda *a, op=op, **k: pytest.fail(f"cpu.{op} was called"))


@pytest.mark.parametrize("name", FUSED_MODULES)
def test_inference_keeps_the_routing_where_it_decides_otherwise(name, monkeypatch):
    """NORMLAB_KERNEL=reference, kernel="reference", float64: no fused op; an input of the wrong width still gets the
    module's own error; under autocast, float32 parameters and a bfloat16 input, the routed path's answer."""
    assert cpu.ready(wait=True)
    x = torch.randn(2, 48) * 2
    expected = _module(name, kernel="reference")(x).detach()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        routed = _module(name, kernel="cpu")(x.bfloat16()).detach()  # autograd records: the routed path
        with torch.inference_mode():
            assert torch.equal(_module(name, kernel="cpu")(x.bfloat16()), routed)
    _refuse_ops(monkeypatch)
    with torch.inference_mode():
        torch.testing.assert_close(_module(name, kernel="reference")(x), expected, rtol=0, atol=0)
        monkeypatch.setenv("NORMLAB_KERNEL", "reference")
        torch.testing.assert_close(_module(name)(x), expected, rtol=0, atol=0)
        monkeypatch.delenv("NORMLAB_KERNEL")
        assert _module(name).double()(x.double()).dtype == torch.float64
        with pytest.raises(ValueError, match=r"expected an input of shape \(\.\.\., 48\)"):
            _module(name)(torch.randn(2, 47))
