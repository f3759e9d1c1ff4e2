"""The fused CPU paths (normlab.kernels.cpu) against the reference: output and every gradient.

The same table of shapes, dtypes and variants as the Triton kernels, and the same tolerances
(kernel_checks.py). Runs on every machine: the CPU path is TorchInductor, which needs only a C++ compiler.
"""

from __future__ import annotations

import math
import warnings

import kernel_checks as KC
import pytest
import torch

import normlab
import normlab.functional as FN
from normlab.kernels import cpu

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _inputs(m, n, dtype, seed=0):
    return KC.inputs(m, n, dtype, "cpu", seed)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", KC.CHANNELS)
@pytest.mark.parametrize("m", KC.ROWS)
@pytest.mark.parametrize("per_channel,bias", KC.VARIANTS, ids=KC.VARIANT_IDS)
@pytest.mark.parametrize("op", ["dyt", "scaled_dyt", "dyisru", "eln"])
def test_pointwise_family(op, m, n, dtype, per_channel, bias):
    if op == "eln" and n == 1:
        pytest.skip("ELN needs C >= 2 (sqrt(C - 1) = 0 at C = 1)")
    x, dy, w, b, g = _inputs(m, n, dtype)
    k = n if per_channel else 1
    p = (0.3 + torch.rand(k, generator=g)) if op in ("dyt", "scaled_dyt") else (0.5 + 3 * torch.rand(k, generator=g))
    p = p.to(dtype)
    fast = {
        "dyt": lambda x, p, w, b=None: cpu.dyt(x, p, w, b),
        "scaled_dyt": lambda x, p, w, b=None: cpu.dyt(x, p, w, b, scale=math.sqrt(n)),
        "dyisru": lambda x, p, w, b=None: cpu.dyisru(x, p, w, b, scale=math.sqrt(n)),
        "eln": lambda x, p, w, b=None: cpu.eln(x, p, w, b, scale=math.sqrt(n - 1)),
    }[op]
    ref = {"dyt": FN.dyt, "scaled_dyt": FN.scaled_dyt, "dyisru": FN.dyisru, "eln": FN.eln}[op]
    tensors = [x, p, w, b] if bias else [x, p, w]
    # ELN's dx is a centred difference (q - mean q): at C = 2 it cancels, so measure against |dy w| beta h^3
    floor = float((dy.double() * w.double()).abs().max()) * (1 / math.sqrt(float(p.min()))) if op == "eln" else 1e-6
    KC.check(fast, ref, tensors, dy, dtype, op, grad_floor=floor)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", KC.CHANNELS)
@pytest.mark.parametrize("m", KC.ROWS)
@pytest.mark.parametrize("per_channel,bias", KC.VARIANTS, ids=KC.VARIANT_IDS)
def test_derf(m, n, dtype, per_channel, bias):
    x, dy, w, b, g = _inputs(m, n, dtype)
    k = n if per_channel else 1
    alpha = (0.3 + torch.rand(k, generator=g)).to(dtype)
    shift = (0.3 * torch.randn(k, generator=g)).to(dtype)
    tensors = [x, alpha, shift, w, b] if bias else [x, alpha, shift, w]
    KC.check(cpu.derf, FN.derf, tensors, dy, dtype, "derf")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", KC.CHANNELS)
@pytest.mark.parametrize("m", KC.ROWS)
def test_rms_norm(m, n, dtype):
    x, dy, w, _, _ = _inputs(m, n, dtype)
    eps = 1e-6
    term = float((dy.double() * w.double()).abs().max() / x.double().pow(2).mean(-1).sqrt().min())  # |dy w| / r
    KC.check(
        lambda x, w: cpu.rms_norm(x, w, eps),
        lambda x, w: FN.rms_norm(x, w, eps),
        [x, w],
        dy,
        dtype,
        "rms_norm",
        grad_floor=term,
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_with_one_weight_for_every_channel(dtype):
    """The kernel's own entry takes a (1,) weight too (the element-wise ops share its parameter reader): it is
    read for every channel, and its gradient comes back summed, with its (1,) shape."""
    x, dy, _, _, g = _inputs(64, 37, dtype)
    w = (0.5 + torch.rand(1, generator=g)).to(dtype)
    term = float((dy.double() * w.double()).abs().max() / x.double().pow(2).mean(-1).sqrt().min())
    ref = lambda x, w: FN.rms_norm(x, w.expand(x.shape[-1]), 1e-6)  # noqa: E731  (the reference takes (C,))
    KC.check(lambda x, w: cpu.rms_norm(x, w, 1e-6), ref, [x, w], dy, dtype, "rms_norm", grad_floor=term)


@pytest.mark.parametrize("name", ["dyt", "scaled_dyt", "derf", "dyisru", "eln", "rms_norm"])
def test_public_kernels_without_a_weight_match_the_reference(name):
    """Issue 29, defect 3: `normlab.kernels.dyt(x, alpha, None, kernel="cpu")` returned zeros (the library read a
    missing weight as 0), so under "auto" the answer changed at 65,536 elements. No weight means 1, on every
    path, with the gradients of x and of the other parameters unchanged."""
    import normlab.kernels as K

    x = torch.randn(4, 8)
    calls = {
        "dyt": lambda x, k: K.dyt(x, torch.tensor([0.5]), None, kernel=k),
        "scaled_dyt": lambda x, k: K.scaled_dyt(x, torch.tensor([0.5]), None, kernel=k),
        "derf": lambda x, k: K.derf(x, torch.tensor([0.5]), torch.tensor([0.1]), None, kernel=k),
        "dyisru": lambda x, k: K.dyisru(x, torch.tensor([4.0]), None, kernel=k),
        "eln": lambda x, k: K.eln(x, torch.tensor([4.0]), None, kernel=k),
        "rms_norm": lambda x, k: K.rms_norm(x, None, 1e-6, kernel=k),
    }
    out = {}
    for k in ("cpu", "reference"):
        xk = x.clone().requires_grad_(True)
        y = calls[name](xk, k)
        y.backward(torch.ones_like(y))
        out[k] = (y.detach(), xk.grad)
    assert out["cpu"][0].abs().max() > 0
    torch.testing.assert_close(out["cpu"][0], out["reference"][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out["cpu"][1], out["reference"][1], rtol=1e-4, atol=1e-5)


def test_non_contiguous_batched_and_empty_inputs():
    base = torch.randn(16, 5, 3)
    x = base.transpose(0, 2).requires_grad_(True)  # (3, 5, 16), last axis strided
    alpha, w = torch.full((1,), 0.7, requires_grad=True), torch.ones(16, requires_grad=True)
    y = cpu.dyt(x, alpha, w)
    KC.close(y, FN.dyt(x.double(), 0.7), 1e-5, "non-contiguous dyt")
    y.sum().backward()
    assert x.grad.shape == x.shape
    m = normlab.create_norm("dyt", 16)
    assert m(torch.empty(0, 16)).shape == (0, 16)


@pytest.mark.parametrize("op", ["dyt", "derf", "dyisru", "eln", "rms_norm"])
def test_gradients_are_deterministic_at_one_and_two_threads(op):
    """The same bits on every run with the same thread count (each task owns its rows; partials added in order),
    and the same values within float32 rounding across thread counts."""
    x, dy, w, b, _ = _inputs(301, 1023, torch.float32)
    call = {
        "dyt": lambda x, p, w, b: cpu.dyt(x, p, w, b),
        "derf": lambda x, p, w, b: cpu.derf(x, p, 0.1 * p, w, b),
        "dyisru": lambda x, p, w, b: cpu.dyisru(x, p, w, b),
        "eln": lambda x, p, w, b: cpu.eln(x, p, w, b),
        "rms_norm": lambda x, p, w, b: cpu.rms_norm(x, w, 1e-6) * p + b,
    }[op]
    before = torch.get_num_threads()
    by_threads = {}
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            runs = []
            for _ in range(2):
                leaves = [t.clone().requires_grad_(True) for t in (x, torch.full((1,), 0.6), w, b)]
                call(*leaves).backward(dy)
                runs.append([t.grad for t in leaves])
            for g1, g2 in zip(*runs):
                assert torch.equal(g1, g2), f"{op}: two runs at {threads} threads differ"
            by_threads[threads] = runs[0]
    finally:
        torch.set_num_threads(before)
    for g1, g2 in zip(by_threads[1], by_threads[2]):
        KC.close(g2, g1, 1e-5, f"{op}: 2 threads against 1")


@pytest.mark.parametrize("op", ["dyt", "dyisru", "rms_norm"])
def test_saves_only_its_input(op):
    """Activation memory: the backward keeps x and per-channel (or per-row) vectors, no other (N, C) tensor."""
    n, c = 64, 256
    x = torch.randn(n, c, requires_grad=True)
    w = torch.ones(c, requires_grad=True)
    p = torch.full((1,), 0.5, requires_grad=True)
    call = {
        "dyt": lambda: cpu.dyt(x, p, w, w),
        "dyisru": lambda: cpu.dyisru(x, p, w, w),
        "rms_norm": lambda: cpu.rms_norm(x, w, 1e-6),
    }[op]
    call()  # compile first: the hooks must see the compiled graph's saved tensors
    sizes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
        call()
    assert sorted(sizes)[-1] == n * c and all(s <= max(n, c) for s in sorted(sizes)[:-1]), sizes


@pytest.mark.parametrize("name", ["layer_norm", "rms_norm", "dyt", "scaled_dyt", "derf", "dyisru", "eln"])
def test_modules_take_the_cpu_path_under_auto_and_match_the_reference(name, monkeypatch):
    calls = []  # the fused paths: the CPU functions, and the forward ops that an inference call runs directly
    for fn in ("dyt", "derf", "dyisru", "eln", "rms_norm", "pointwise_forward", "rms_forward"):
        real = getattr(cpu, fn)
        monkeypatch.setattr(cpu, fn, lambda *a, _real=real, **k: calls.append(1) or _real(*a, **k))
    torch.manual_seed(0)
    auto, ref = normlab.create_norm(name, 64), normlab.create_norm(name, 64, kernel="reference")
    x = torch.randn(cpu.MIN_FUSED // 64, 64, requires_grad=True)
    KC.close(auto(x), ref(x), 1e-5, f"{name} module")
    assert len(calls) == (0 if name == "layer_norm" else 1)  # LayerNorm: PyTorch's own fused op
    calls.clear()
    KC.close(auto(x[:5]), ref(x[:5]), 1e-5, f"{name} module, small input")
    # below MIN_FUSED elements the reference, cheaper there; DyISRU and ELN fuse every size (MIN_FUSED_ISRU)
    assert len(calls) == (1 if name in ("dyisru", "eln") else 0)
    calls.clear()
    with torch.no_grad():  # unrecorded (inference, a decode step): the op without the autograd function, any size
        KC.close(auto(x[:1, :64]), ref(x[:1, :64]), 1e-5, f"{name} module, one row, no grad")
    assert len(calls) == (0 if name == "layer_norm" else 1)
    calls.clear()
    auto.double()(x.double())  # float64 (the theory tools): the reference, exactly
    assert calls == []


def test_kernel_cpu_on_an_unsupported_dtype_is_a_clear_error():
    m = normlab.create_norm("dyt", 8, kernel="cpu").double()
    with pytest.raises(RuntimeError, match="kernel='cpu'.* float32, bfloat16 or float16; got torch.float64"):
        m(torch.randn(2, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="expected kernel in"):
        normlab.create_norm("layer_norm", 8, kernel="triton")


def test_a_machine_without_a_compiler_falls_back_with_one_warning(monkeypatch, tmp_path):
    """A real missing compiler (CXX names no program), an empty cache: one warning, the reference math."""
    from normlab.kernels import cpu_build

    monkeypatch.setattr(cpu_build, "_STATE", {"loaded": False, "failure": None, "thread": None})
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    monkeypatch.setenv("NORMLAB_CACHE", str(tmp_path / "cache"))
    x = torch.randn(3, 16)
    m = normlab.create_norm("dyisru", 16, kernel="cpu")
    with pytest.warns(RuntimeWarning, match="cannot be built on this machine .*no-such-c\\+\\+"):
        y = m(x)
    KC.close(y, normlab.create_norm("dyisru", 16, kernel="reference")(x), 1e-6, "fallback")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning, not one per call
        normlab.create_norm("dyt", 16)(x)
    assert not cpu.available() and not (tmp_path / "cache").exists()  # nothing written


def test_a_recorded_build_is_checked_before_it_is_loaded(tmp_path, monkeypatch):
    """Size and SHA-256 against build.json; a record of other inputs (a stale build) is not this build."""
    import json
    import shutil

    from normlab.kernels import cpu_build

    assert cpu.ready(wait=True)
    ident = cpu_build._identity(cpu_build._compiler())
    folder = tmp_path / "kernels" / f"cpu-{ident['key']}"
    shutil.copytree(cpu_build.build_dir(ident), folder)
    monkeypatch.setenv("NORMLAB_CACHE", str(tmp_path))
    assert cpu_build._intact(folder, ident) is None
    rec = json.loads((folder / "build.json").read_text())
    (folder / "build.json").write_text(json.dumps({**rec, "torch": "0.0.1"}))
    assert cpu_build._intact(folder, ident) == "built from other inputs"
    (folder / "build.json").write_text(json.dumps(rec))
    with open(folder / "normlab_cpu.so", "r+b") as f:
        f.truncate(rec["size"] // 2)
    assert "SHA-256" in cpu_build._intact(folder, ident)
    (folder / "build.json").write_text("{trunc")
    assert cpu_build._intact(folder, ident).startswith("unreadable")


@pytest.mark.slow
def test_a_fresh_process_never_waits_and_rebuilds_a_corrupt_library(tmp_path):
    """A fresh process with a corrupt cached library: kernel='auto' answers at once with the reference math while
    a background thread rebuilds (with a message); once built, the fused path serves, and nothing crashed."""
    import json
    import shutil
    import subprocess
    import sys

    from normlab.kernels import cpu_build

    assert cpu.ready(wait=True)
    ident = cpu_build._identity(cpu_build._compiler())
    folder = tmp_path / "kernels" / f"cpu-{ident['key']}"
    shutil.copytree(cpu_build.build_dir(ident), folder)
    (folder / "normlab_cpu.so").write_bytes(b"\x7fELF not a library")
    code = """
import json, torch, normlab
from normlab.kernels import cpu, cpu_build
x = torch.randn(2048, 32, requires_grad=True)  # cpu.MIN_FUSED elements: auto fuses it once built
m = normlab.create_norm("dyt", 32)
y = m(x); y.sum().backward()
first = cpu.ready()
cpu_build._STATE["thread"].join()
calls = []
real = cpu.dyt
cpu.dyt = lambda *a, **k: calls.append(1) or real(*a, **k)
y2 = m(x)
print(json.dumps({"first_ready": first, "ready": cpu.ready(), "fused_calls": len(calls),
                  "same": bool(torch.allclose(y, y2, atol=1e-6))}))
"""
    env = {**__import__("os").environ, "NORMLAB_CACHE": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"first_ready": False, "ready": True, "fused_calls": 1, "same": True}, out
    assert "corrupt or truncated" in proc.stderr and "rebuilding" in proc.stderr
    assert cpu_build._intact(folder, ident) is None
    assert json.loads((folder / "build.json").read_text())["sha256"] != "" and shutil.which("c++")


@pytest.mark.parametrize("name", ["dyt", "derf", "dyisru", "eln", "rms_norm"])
def test_torch_func_transforms_work_on_the_default_path(name):
    """vmap, grad and jacrev of a module on its default (auto) path equal the reference's (inputs large enough
    that auto would fuse them outside a transform)."""
    from torch.func import functional_call, grad, jacrev, vmap

    torch.manual_seed(0)
    auto = normlab.create_norm(name, 8)
    ref = normlab.create_norm(name, 8, kernel="reference")
    ref.load_state_dict(auto.state_dict())
    x = torch.randn(2, cpu.MIN_FUSED // 8, 8)
    KC.close(vmap(auto)(x), vmap(ref)(x), 1e-6, f"{name} vmap")
    KC.close(jacrev(auto)(x[0, 0]), jacrev(ref)(x[0, 0]), 1e-6, f"{name} jacrev")
    params = dict(auto.named_parameters())

    def loss(p, mod):
        return functional_call(mod, p, (x,)).square().sum()

    for k, g in grad(loss)(params, auto).items():
        KC.close(g, grad(loss)(params, ref)[k], 1e-5, f"{name} grad {k}")


def test_a_second_derivative_through_the_fused_path_names_the_reference():
    """issue 65: double backward through the default kernel worked at 4 rows (the reference, below MIN_FUSED) and
    failed at 8,192 with torch's "trying to differentiate twice", which does not name kernel="reference"."""
    import normlab
    from normlab.errors import NormlabError

    if not cpu.ready(wait=True):
        pytest.skip("no CPU kernels on this machine")
    x = torch.randn(8192, 64, requires_grad=True)
    for kernel, works in (("auto", False), ("reference", True)):
        y = normlab.DyT(64, kernel=kernel)(x).pow(2).sum()
        if works:
            (g,) = torch.autograd.grad(y, x, create_graph=True)
            g.sum().backward()
        else:
            with pytest.raises(NormlabError, match="kernel='reference'"):
                torch.autograd.grad(y, x, create_graph=True)
    y = normlab.DyT(64)(x).pow(2).sum()
    torch.autograd.grad(y, x)  # a first derivative takes the fused path as before


def test_a_number_for_alpha_or_beta_is_taken_as_the_reference_takes_it():
    """issue 65: a float alpha to normlab.kernels.dyt raised a raw AttributeError; the functional form takes one."""
    from normlab import functional as FN
    from normlab import kernels

    x = torch.randn(512, 64)
    torch.testing.assert_close(kernels.dyt(x, 0.5, None), FN.dyt(x, 0.5))
    torch.testing.assert_close(kernels.dyisru(x, 2.0, None), FN.dyisru(x, 2.0))
    with pytest.raises(TypeError, match="DyT: a parameter must be a tensor or a number, got str"):
        kernels.dyt(x, "0.5", None)
