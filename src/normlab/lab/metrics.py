"""The dissection's instruments (seed 003), measured on a live model.

* effective rank of a weight matrix: exp of the entropy of its normalized
  singular values (Roy & Vetterli), seed 003's "Rank and alignment" table;
* cos(dL/dx, x) at each norm's input, per token, with dL/dx the gradient that flows back through
  the norm (not the skip path): exactly 0 for RMSNorm with eps = 0;
* residual-stream std after each block;
* each norm site's learned alpha / beta;
* the Jacobian's diagonal and coupling norms at one site (seed 003's Jacobian table).

``Probe`` attaches hooks only for the step it measures, so training steps in
between pay nothing.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from normlab.theory.jacobian import autograd_jacobian, decompose, rms_norm_terms

__all__ = ["effective_rank", "norm_parameters", "projection_ranks", "Probe"]


@torch.no_grad()
def effective_rank(w: torch.Tensor) -> float:
    """exp(H(p)), p = s / sum(s) over the singular values s of w: between 1 and min(w.shape)."""
    s = torch.linalg.svdvals(w.detach().float())
    p = s / s.sum()
    p = p[p > 0]
    return float(torch.exp(-(p * p.log()).sum()))


def projection_ranks(model: nn.Module) -> dict[str, float]:
    """Mean effective rank of the attention and MLP output projections ("c_proj") over layers."""
    attn = [effective_rank(b.attn.proj.weight) for b in model.blocks]
    mlp = [effective_rank(b.mlp.proj.weight) for b in model.blocks]
    return {"erank_attn_proj": sum(attn) / len(attn), "erank_mlp_proj": sum(mlp) / len(mlp)}


@torch.no_grad()
def norm_parameters(model: nn.Module) -> dict[str, float]:
    """Mean learned alpha and beta of every norm site that has them."""
    out = {}
    for name, m in model.norm_modules().items():
        if hasattr(m, "alpha"):
            out[f"alpha/{name}"] = float(m.alpha.float().mean())
        if hasattr(m, "log_beta"):
            out[f"beta/{name}"] = float(m.beta.float().mean())
    return out


class Probe:
    """Hooks for one measured step: norm inputs and their gradients, block outputs."""

    def __init__(self, model: nn.Module, jacobian_site: str | None = None) -> None:
        self.model = model
        self.sites = model.norm_modules()
        if jacobian_site is not None and jacobian_site not in self.sites:
            raise ValueError(f"jacobian_site {jacobian_site!r} is not a norm site; sites: {', '.join(self.sites)}")
        self.jacobian_site = jacobian_site
        self.inputs: dict[str, torch.Tensor] = {}
        self.grads: dict[str, torch.Tensor] = {}
        self.block_std: list[float] = []
        self._handles: list = []

    def __enter__(self) -> Probe:
        for name, m in self.sites.items():
            self._handles.append(m.register_forward_pre_hook(self._norm_hook(name)))
        for block in self.model.blocks:
            self._handles.append(block.register_forward_hook(self._block_hook))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _norm_hook(self, name: str):
        # The norm's input is also the residual stream, whose gradient includes the skip path. An alias
        # (a view) that only the norm consumes receives exactly the gradient that flows back through the norm.
        def hook(module, args):
            x = args[0]
            self.inputs[name] = x.detach()
            if not x.requires_grad:
                return None
            alias = x.view_as(x)
            alias.register_hook(lambda g: self.grads.__setitem__(name, g.detach()))
            return (alias, *args[1:])

        return hook

    def _block_hook(self, module, args, output) -> None:
        self.block_std.append(float(output.detach().float().std()))

    def results(self) -> dict[str, float]:
        """Call after backward. Alignment per site (mean cos and mean |cos| over tokens), stds, Jacobian."""
        out: dict[str, float] = {}
        cos_all, abs_all = [], []
        for name, x in self.inputs.items():
            if name not in self.grads:
                continue
            cos = torch.nn.functional.cosine_similarity(self.grads[name].float(), x.float(), dim=-1)  # (B, T)
            out[f"align_cos/{name}"] = float(cos.mean())
            cos_all.append(float(cos.mean()))
            abs_all.append(float(cos.abs().mean()))
        if cos_all:
            out["align_cos"] = sum(cos_all) / len(cos_all)
            out["align_abs_cos"] = sum(abs_all) / len(abs_all)
        for i, s in enumerate(self.block_std):
            out[f"resid_std/{i}"] = s
        if self.jacobian_site is not None and self.jacobian_site in self.inputs:
            out.update(self._jacobian(self.jacobian_site))
        return out

    def _jacobian(self, site: str) -> dict[str, float]:
        module = copy.deepcopy(self.sites[site]).double().eval()  # eval: rms_ema's buffer must not move
        x = self.inputs[site].reshape(-1, self.inputs[site].shape[-1])[0].double()  # one token, (C,)
        jac = autograd_jacobian(module, x)
        terms = rms_norm_terms(x, module.weight.detach(), module.eps) if module.registry_name == "rms_norm" else None
        parts = decompose(jac, terms=terms)
        return {"jac_diag": parts.diag, "jac_coupling": parts.coupling, "jac_total": parts.total}
