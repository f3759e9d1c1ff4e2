"""The dissection's instruments (the dissection), measured on a live model.

* effective rank of a weight matrix: exp of the entropy of its normalized
  singular values (Roy & Vetterli), the dissection's "Rank and alignment" table;
* cos(dL/dx, x) at each norm's input, per token, with dL/dx the gradient that flows back through
  the norm (not the skip path): exactly 0 for RMSNorm with eps = 0;
* residual-stream std after each block;
* each norm site's learned alpha / beta;
* the Jacobian's diagonal and coupling norms at one site (the dissection's Jacobian table);
* the mechanism of the dissection's attractor argument, per site: the RMS of the norm's input and output,
  alpha * RMS(input) (with alpha the slope that sets where f saturates: alpha for the tanh/erf family,
  1/sqrt(beta) for DyISRU/ELN), the fraction of inputs out of the linear region (|alpha x| > 1), and
  block 0's attention entropy relative to uniform (1 when attention is uniform, as when the model is stuck).

``Probe`` attaches hooks only for the step it measures, so training steps in
between pay nothing.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from normlab.theory.jacobian import autograd_jacobian, decompose, rms_norm_terms

__all__ = ["effective_rank", "norm_parameters", "projection_ranks", "Probe", "saturation_slope", "site_telemetry",
           "attention_entropy", "init_telemetry"]  # fmt: skip


@torch.no_grad()
def effective_rank(w: torch.Tensor) -> float:
    """exp(H(p)), p = s / sum(s) over the singular values s of w: between 1 and min(w.shape).

    Args:
        w: A matrix.
    """
    s = torch.linalg.svdvals(w.detach().float())
    p = s / s.sum()
    p = p[p > 0]
    return float(torch.exp(-(p * p.log()).sum()))


def projection_ranks(model: nn.Module) -> dict[str, float]:
    """Mean effective rank of the attention and MLP output projections ("c_proj") over layers.

    Args:
        model: The GPT.
    """
    attn = [effective_rank(b.attn.proj.weight) for b in model.blocks]
    mlp = [effective_rank(b.mlp.proj.weight) for b in model.blocks]
    return {"erank_attn_proj": sum(attn) / len(attn), "erank_mlp_proj": sum(mlp) / len(mlp)}


@torch.no_grad()
def norm_parameters(model: nn.Module) -> dict[str, float]:
    """Mean learned alpha and beta of every norm site that has them.

    Args:
        model: The GPT.
    """
    out = {}
    for name, m in model.norm_modules().items():
        if hasattr(m, "alpha"):
            out[f"alpha/{name}"] = float(m.alpha.float().mean())
        if hasattr(m, "log_beta"):
            out[f"beta/{name}"] = float(m.beta.float().mean())
    return out


def saturation_slope(m: nn.Module) -> float | None:
    """The slope alpha whose |alpha x| = 1 marks where a point-wise f leaves its linear region: alpha for the
    tanh / erf family (mean |alpha| when per channel), 1/sqrt(beta) for DyISRU and ELN; None otherwise.

    Args:
        m: A norm module.
    """
    if hasattr(m, "alpha"):
        return float(m.alpha.detach().float().abs().mean())
    if hasattr(m, "log_beta"):
        return float(m.beta.detach().float().rsqrt().mean())
    return None


@torch.no_grad()
def site_telemetry(m: nn.Module, x: torch.Tensor, y: torch.Tensor, name: str) -> dict[str, float]:
    """At one norm site with input x and output y (..., C): rms_in, rms_out, and where the norm has a
    saturation slope, alpha_rms = alpha * rms_in, sat_frac = the fraction of entries with |alpha x| > 1 and
    gain = alpha * mean |gamma| (the site's slope at 0, up to DyISRU's sqrt(C)).

    Args:
        m: The norm module.
        x: Its input.
        y: Its output.
        name: The site's name, the keys' suffix.
    """
    x, y = x.detach().float(), y.detach().float()
    out = {f"rms_in/{name}": float(x.pow(2).mean().sqrt()), f"rms_out/{name}": float(y.pow(2).mean().sqrt())}
    alpha = saturation_slope(m)
    if alpha is not None:
        out[f"alpha_rms/{name}"] = alpha * out[f"rms_in/{name}"]
        out[f"sat_frac/{name}"] = float((x.abs() * alpha > 1).float().mean())
        weight = getattr(m, "weight", None)
        out[f"gain/{name}"] = alpha * (1.0 if weight is None else float(weight.detach().float().abs().mean()))
    return out


@torch.no_grad()
def attention_entropy(attn: nn.Module, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> float:
    """Mean entropy of causal attention weights relative to uniform, over heads and query positions t >= 1:
    H(p_t) / log(t + 1), in [0, 1]; 1 means every query attends uniformly to its past. ``h``: (B, T, C);
    ``rope``: the llama block's (cos, sin) tables, applied to q and k as the model does.

    Args:
        attn: A block's attention module.
        h: Its input, (B, T, C).
        rope: The (cos, sin) tables of a LLaMA block; None for GPT-2.
    """
    h = h.detach().float()
    b, t, c = h.shape
    q, k, _ = attn.qk(h.to(attn.qkv.weight.dtype), rope)
    q, k = q.float(), k.float()  # (B, nh, T, hs)
    logits = q @ k.transpose(-1, -2) / math.sqrt(c // attn.heads)  # (B, nh, T, T)
    causal = torch.ones(t, t, dtype=torch.bool, device=h.device).tril()
    p = logits.masked_fill(~causal, float("-inf")).softmax(-1)
    ent = -(p * p.clamp_min(1e-30).log()).sum(-1)  # (B, nh, T)
    uniform = torch.arange(1, t + 1, device=h.device, dtype=torch.float32).log()  # log(t + 1) for row t
    return float((ent[..., 1:] / uniform[1:]).mean()) if t > 1 else 1.0


@torch.no_grad()
def init_telemetry(model: nn.Module, idx: torch.Tensor) -> dict[str, float]:
    """The mechanism's numbers on a forward pass of ``idx`` (no training step): what a run logs at step 0.

    Args:
        model: The GPT.
        idx: Token ids, (B, T).
    """
    was_training = model.training
    model.eval()
    with Probe(model) as probe:
        model(idx)
    model.train(was_training)
    return probe.mechanism()


class Probe:
    """Hooks for one measured step: norm inputs and their gradients, block outputs.

    Args:
        model: The GPT.
        jacobian_site: A norm site whose Jacobian's coupling part is measured; None for none.
    """

    def __init__(self, model: nn.Module, jacobian_site: str | None = None) -> None:
        self.model = model
        self.sites = model.norm_modules()
        if jacobian_site is not None and jacobian_site not in self.sites:
            raise ValueError(f"jacobian_site {jacobian_site!r} is not a norm site; sites: {', '.join(self.sites)}")
        self.jacobian_site = jacobian_site
        self.inputs: dict[str, torch.Tensor] = {}
        self.grads: dict[str, torch.Tensor] = {}
        self.outputs: dict[str, torch.Tensor] = {}
        self.block_std: list[float] = []
        self.attn_input: torch.Tensor | None = None  # block 0's attention input, for its entropy
        self.attn_rope = None  # and the RoPE tables it was given (llama block)
        self.logits: torch.Tensor | None = None
        self._handles: list = []

    def __enter__(self) -> Probe:
        for name, m in self.sites.items():
            self._handles.append(m.register_forward_pre_hook(self._norm_hook(name)))
            self._handles.append(m.register_forward_hook(self._output_hook(name)))
        for block in self.model.blocks:
            self._handles.append(block.register_forward_hook(self._block_hook))
        self._handles.append(self.model.blocks[0].attn.register_forward_pre_hook(self._attn_hook))
        self._handles.append(self.model.head.register_forward_hook(self._head_hook))
        return self

    def _head_hook(self, module, args, y) -> None:
        self.logits = y.detach()

    def _output_hook(self, name: str):
        return lambda module, args, y: self.outputs.__setitem__(name, y.detach())

    def _attn_hook(self, module, args) -> None:
        self.attn_input = args[0].detach()
        self.attn_rope = args[1] if len(args) > 1 else None

    def mechanism(self) -> dict[str, float]:
        """Per site: rms_in, rms_out, alpha_rms, sat_frac, gain (see ``site_telemetry``); block 0's attention
        entropy relative to uniform; the logits' std."""
        out: dict[str, float] = {}
        for name, x in self.inputs.items():
            out.update(site_telemetry(self.sites[name], x, self.outputs[name], name))
        if self.attn_input is not None:
            out["attn_entropy/0"] = attention_entropy(self.model.blocks[0].attn, self.attn_input, self.attn_rope)
        if self.logits is not None:
            out["logit_std"] = float(self.logits.float().std())
        return out

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
        out.update(self.mechanism())
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
