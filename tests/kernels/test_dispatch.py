"""Which path a norm takes (NORMLAB_KERNEL, device and dtype)."""

from __future__ import annotations

import pytest
import torch

import normlab
import normlab.kernels as K


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
