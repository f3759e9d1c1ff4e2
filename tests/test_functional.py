"""Exact identities between the norms (the DyISRU paper Theorem 3, the dissection Results 4-5)."""

from __future__ import annotations

import torch

import normlab.functional as FN

torch.manual_seed(0)


def _grads(fn, x, w, g):
    x = x.clone().requires_grad_(True)
    w = w.clone().requires_grad_(True)
    fn(x, w).backward(g)
    return x.grad, w.grad


def _coupling(x, w, g, eps):
    """The dissection's coupling term: x_i / (C r^3) * sum_j w_j x_j g_j."""
    r = torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x / (x.shape[-1] * r**3) * (w * x * g).sum(-1, keepdim=True)


def test_rms_detached_same_forward_grads_differ_by_coupling():
    x, g = torch.randn(2, 9, 64, dtype=torch.float64), torch.randn(2, 9, 64, dtype=torch.float64)
    w = 1 + 0.3 * torch.randn(64, dtype=torch.float64)
    assert torch.equal(FN.rms_norm(x, w), FN.rms_detached(x, w))
    gx_full, gw_full = _grads(FN.rms_norm, x, w, g)
    gx_det, gw_det = _grads(FN.rms_detached, x, w, g)
    torch.testing.assert_close(gx_det - gx_full, _coupling(x, w, g, FN.EPS), rtol=0, atol=1e-13)
    torch.testing.assert_close(gw_det, gw_full, rtol=1e-14, atol=1e-14)
    # the coupling is not negligible, so the identity is not trivially satisfied
    assert _coupling(x, w, g, FN.EPS).abs().max() > 1e-3


def test_partial_coupling_endpoints():
    x, g = torch.randn(5, 33, dtype=torch.float64), torch.randn(5, 33, dtype=torch.float64)
    w = 1 + 0.3 * torch.randn(33, dtype=torch.float64)
    full = _grads(FN.rms_norm, x, w, g)
    det = _grads(FN.rms_detached, x, w, g)
    lam1 = _grads(lambda x, w: FN.rms_partial_coupling(x, w, lam=1.0), x, w, g)
    lam0 = _grads(lambda x, w: FN.rms_partial_coupling(x, w, lam=0.0), x, w, g)
    for a, b in zip(lam1, full):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)
    for a, b in zip(lam0, det):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)
    # in between, the coupling is scaled linearly
    half = _grads(lambda x, w: FN.rms_partial_coupling(x, w, lam=0.5), x, w, g)
    torch.testing.assert_close(half[0], 0.5 * (full[0] + det[0]), rtol=1e-12, atol=1e-13)


def test_rms_norm_input_gradient_is_orthogonal_to_x():
    x = torch.randn(8, 256, dtype=torch.float64, requires_grad=True)
    w = 1 + 0.3 * torch.randn(256, dtype=torch.float64)
    FN.rms_norm(x, w, eps=0.0).backward(torch.randn(8, 256, dtype=torch.float64))
    cos = torch.nn.functional.cosine_similarity(x.grad, x.detach(), dim=-1)
    assert cos.abs().max() < 1e-13
    # with eps > 0 the orthogonality is broken by a relative eps / r^2, no more
    x2 = x.detach().clone().requires_grad_(True)
    FN.rms_norm(x2, w, eps=1e-6).backward(torch.randn(8, 256, dtype=torch.float64))
    assert torch.nn.functional.cosine_similarity(x2.grad, x2.detach(), dim=-1).abs().max() < 1e-5
    # and the detached variant is not orthogonal at all
    x3 = x.detach().clone().requires_grad_(True)
    FN.rms_detached(x3, w, eps=0.0).backward(torch.randn(8, 256, dtype=torch.float64))
    assert torch.nn.functional.cosine_similarity(x3.grad, x3.detach(), dim=-1).abs().max() > 1e-3


def test_dyisru_with_per_channel_beta_is_rms_norm():
    """The DyISRU paper Theorem 3: beta_i = ||x without i||^2 turns DyISRU (eq. 16) into RMSNorm (eq. 13)."""
    for c in (1, 2, 7, 100, 1024):
        x = torch.randn(3, c, dtype=torch.float64)
        beta_i = x.pow(2).sum(-1, keepdim=True) - x.pow(2)  # (3, C): per token and channel
        torch.testing.assert_close(FN.dyisru(x, beta_i), FN.rms_norm(x, eps=0.0), rtol=1e-13, atol=1e-13)


def test_eln_with_theorem4_beta_is_layer_norm():
    """The ELN paper Theorem 4: beta_i = (C-1) sigma_{!=i}^2 - sigma^2 turns ELN (eq. 13) into LayerNorm."""
    c = 50
    x = torch.randn(4, c, dtype=torch.float64) * 2 + 0.7
    xc = x - x.mean(-1, keepdim=True)
    var = xc.pow(2).mean(-1, keepdim=True)
    var_not_i = (xc.pow(2).sum(-1, keepdim=True) - xc.pow(2)) / (c - 1)
    beta_i = (c - 1) * var_not_i - var
    torch.testing.assert_close(FN.eln(x, beta_i), FN.layer_norm(x, eps=0.0), rtol=1e-12, atol=1e-12)


def test_slope_matching_map():
    """The DyISRU paper Fig. 2: beta = 1/alpha^2 gives scaled DyT and DyISRU the same slope at 0."""
    c, alpha = 100, 0.05
    x = torch.tensor([0.0], dtype=torch.float64)
    xs = torch.zeros(c, dtype=torch.float64, requires_grad=True)
    FN.scaled_dyt(xs, alpha).sum().backward()
    d_dyt = xs.grad[0].item()
    xs.grad = None
    FN.dyisru(xs, 1 / alpha**2).sum().backward()
    assert abs(d_dyt - xs.grad[0].item()) < 1e-12
    assert abs(d_dyt - c**0.5 * alpha) < 1e-12
    del x
