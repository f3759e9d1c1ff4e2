"""Folded inference: each norm site's gamma (and beta) moved into the linear layers that read its output.

    import normlab
    report = normlab.fold(model)        # in place, checked on a probe batch; then save as usual
    print(report.table())

A site computes ``y = w * f(x) + b`` with a per-channel ``w`` (gamma) and ``b`` (beta). When every reader of ``y``
is a linear layer ``W y + c`` (a pre-norm block: attention's q, k, v; the MLP's gate and up; the head after the
final norm), then ``W (w * f + b) + c = (W diag(w)) f + (W b + c)``: the linear layers take ``W diag(w)`` and the
bias ``c + W b``, and the site keeps a unit weight and a zero bias, a bare ``f`` (``tanh(alpha x)``,
``erf(alpha x + s)``, DyISRU ...). This is the fold that jiachenzhu/DyT issue 15 asks for, and TaperNorm's main
point: the norm's parameters leave the hot path.

The readers are found, not assumed: one forward pass of a probe batch records which ``nn.Linear`` reads a view of
each site's output. A site whose output has no linear reader is left as it is, and said so. After folding, the
same probe must give the same logits (within float32 rounding); otherwise every change is undone and the fold
raises. A head tied to the input embedding is untied first (``config.tie_word_embeddings`` becomes False, so a
saved model loads untied). A site with a nonzero bias whose readers have no bias is left unfolded (adding a bias
to a Hugging Face projection would not survive a reload), with the reason.

The check is in the model's own dtype. A badly conditioned model can fail it in float32 without any error in the
fold: SmolLM2 converted to DyT without calibration moves its logits by 2.6% when one weight of its first layer
changes by 1e-7. Check such a model in float64 (``model.double()``), or pass a larger ``tolerance``.

A massive-token site (`normlab.conversion.calibrate.massive.MassiveTokens`) folds its main copy's ``w``; its massive
copy keeps ``w1 / w`` and ``(b1 - b) / w``, so both stay exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from normlab.conversion.calibrate.massive import MassiveTokens
from normlab.modules import NormModule
from normlab.table import format_table

__all__ = ["fold", "FoldReport"]


@dataclass
class FoldReport:
    """What `fold` did: per folded site, the linear layers that took its gamma; the sites left as they
    were, with the reason; the heads untied; the probe's largest logit difference, relative to the logits' scale."""

    folded: dict[str, list[str]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    untied: list[str] = field(default_factory=list)
    max_difference: float = 0.0

    def table(self) -> str:
        rows = [[name, "folded", ", ".join(readers)] for name, readers in self.folded.items()]
        rows += [[name, "left as it was", why] for name, why in self.skipped.items()]
        return format_table(["site", "", "readers / reason"], rows)


def _sites(model: nn.Module) -> dict[str, nn.Module]:
    """The foldable sites: normlab norms with a channel-last weight, and massive-token pairs of them."""
    out, inside = {}, set()
    for name, m in model.named_modules():
        if isinstance(m, MassiveTokens) and all(_affine(p) for p in (m.main, m.massive)):
            out[name] = m
            inside.update({f"{name}.main", f"{name}.massive"})
        elif name not in inside and _affine(m):
            out[name] = m
    return out


def _affine(m: nn.Module) -> bool:
    return isinstance(m, NormModule) and m.weight is not None and m.channel_dim in (-1,)


def _whole_channels(x: Tensor, y: Tensor) -> bool:
    """Whether ``x``, a view of ``y``, holds whole tokens of y's channels in their order (a reshape, or some of
    the tokens), so that a gamma folded into the columns of the layer reading x meets the right channels; a slice
    of the channels does not."""
    if not y.is_contiguous() or x.shape[-1] != y.shape[-1] or x.stride(-1) != 1:
        return False
    return (x.storage_offset() - y.storage_offset()) % y.shape[-1] == 0 and all(
        st % y.shape[-1] == 0 for st in x.stride()[:-1] if st
    )


def _readers(model: nn.Module, sites: dict[str, nn.Module], probe) -> dict[str, list[tuple[str, nn.Linear]]]:
    """Run ``probe`` once; for each site, the linear layers whose input is a view of the site's output."""
    outputs, readers, hooks = {}, {name: [] for name in sites}, []

    def keep(name):
        return lambda mod, args, out: outputs.__setitem__(name, out)

    def read(lname, linear):
        def hook(mod, args):
            x = args[0] if args else None
            if not isinstance(x, Tensor):
                return
            for name, y in outputs.items():
                if isinstance(y, Tensor) and x.untyped_storage().data_ptr() == y.untyped_storage().data_ptr():
                    readers[name].append((lname, linear if _whole_channels(x, y) else None))

        return hook

    for name, m in sites.items():
        hooks.append(m.register_forward_hook(keep(name)))
    for lname, m in model.named_modules():
        if isinstance(m, nn.Linear):
            hooks.append(m.register_forward_pre_hook(read(lname, m)))
    try:
        with torch.no_grad():
            _run(model, probe)
    finally:
        for h in hooks:
            h.remove()
    return readers


def _run(model: nn.Module, probe) -> Tensor:
    out = model(**probe) if isinstance(probe, dict) else model(probe)
    return out.logits if hasattr(out, "logits") else out


def _default_probe(model: nn.Module):
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if vocab is None:
        raise ValueError(
            "fold: pass probe= (an input the model takes); only a model with config.vocab_size has a default"
        )
    g = torch.Generator().manual_seed(0)
    device = next(model.parameters()).device
    return torch.randint(0, vocab, (2, 16), generator=g).to(device)


def _untie(model: nn.Module, linear: nn.Linear, lname: str, report: FoldReport, undo: list) -> None:
    shared = any(
        p is linear.weight for n, p in model.named_parameters(remove_duplicate=False) if n != f"{lname}.weight"
    )
    if not shared:
        return
    old = linear.weight
    linear.weight = nn.Parameter(old.detach().clone(), requires_grad=old.requires_grad)
    config = getattr(model, "config", None)
    tied = getattr(config, "tie_word_embeddings", None)
    if tied:
        config.tie_word_embeddings = False
    report.untied.append(lname)
    undo.append(lambda: (setattr(linear, "weight", old), tied and setattr(config, "tie_word_embeddings", tied)))


def _fold_site(site: nn.Module, readers: list[nn.Linear], undo: list) -> None:
    main = site.main if isinstance(site, MassiveTokens) else site
    w, b = main.weight.detach().clone(), None if main.bias is None else main.bias.detach().clone()
    for linear in readers:
        old_w, old_b = linear.weight.detach().clone(), None if linear.bias is None else linear.bias.detach().clone()
        if linear.bias is None and b is not None and bool(b.ne(0).any()):  # add_biases (_why_not let it through)
            linear.bias = nn.Parameter(torch.zeros(linear.out_features, dtype=old_w.dtype, device=old_w.device))
            undo.append(lambda lin=linear: lin.register_parameter("bias", None))
        with torch.no_grad():
            if b is not None and linear.bias is not None:
                linear.bias += old_w.to(torch.float64).matmul(b.to(torch.float64)).to(linear.bias.dtype)
            linear.weight.mul_(w.to(linear.weight.dtype))
        undo.append(lambda lin=linear, ow=old_w, ob=old_b: _restore(lin, ow, ob))
    if isinstance(site, MassiveTokens):
        f = site.massive
        old = (f.weight.detach().clone(), None if f.bias is None else f.bias.detach().clone())
        with torch.no_grad():
            if f.bias is not None:
                f.bias.copy_((f.bias - (0 if b is None else b)) / w)
            f.weight.div_(w)
        undo.append(lambda: _restore(f, *old))
    undo.append(lambda m=main, ow=w, ob=b: _restore(m, ow, ob))
    with torch.no_grad():
        main.weight.fill_(1.0)
        if main.bias is not None:
            main.bias.zero_()


def _restore(m: nn.Module, weight: Tensor, bias: Tensor | None) -> None:
    with torch.no_grad():
        m.weight.copy_(weight)
        if bias is not None:
            m.bias.copy_(bias)


def _why_not(site: nn.Module, readers: list, add_biases: bool) -> str | None:
    main = site.main if isinstance(site, MassiveTokens) else site
    if not readers:
        return "no linear layer reads its output"
    part = [lname for lname, lin in readers if lin is None]
    if part:
        return f"{part[0]} reads part of its channels (a slice), so the gamma cannot move into its columns"
    if isinstance(site, MassiveTokens) and bool((main.weight == 0).any()):
        return "a zero in its weight (the massive copy would divide by it)"
    nonzero = main.bias is not None and bool(main.bias.ne(0).any())
    if nonzero and not add_biases and any(lin.bias is None for _, lin in readers):
        return "a nonzero bias, and a reader without one (fold(..., add_biases=True) gives it one)"
    return None


def _moved(diff: float, tolerance: float, dtype: torch.dtype) -> str:
    """Why the fold was undone: in a 16-bit dtype, rounding alone moves the logits by more than the tolerance."""
    head = (
        f"fold: the probe's logits moved by {diff:.3g} of their scale (> {tolerance:g}) after folding; nothing was "
        "changed"
    )
    if dtype in (torch.float16, torch.bfloat16):
        eps = torch.finfo(dtype).eps
        return (
            f"{head}. The model is {dtype} (rounding step {eps:.1g}), so rounding alone can move them that much: "
            f"fold a float32 copy (model.float()) and cast back, or pass tolerance={max(10 * eps, tolerance):.2g}"
        )
    return (
        f"{head}. Some site's output is read by more than linear layers, or the model is badly conditioned in "
        f"{dtype}: check it in float64 (model.double()) or pass a larger tolerance"
    )


def fold(
    model: nn.Module, probe: Tensor | dict | None = None, *, tolerance: float = 1e-4, add_biases: bool = False
) -> FoldReport:
    """Fold every norm site's gamma (and beta) into the linear layers that read it, in place (see the module
    docstring).

    Args:
        model: a converted model; changed in place.
        probe: an input of the model (token ids, a dict of keyword inputs, or a tensor) whose forward pass finds
            each site's readers; default, two random sequences of 16 tokens for a model with
            ``config.vocab_size``.
        tolerance: the probe's logits must agree before and after to this, relative to their largest magnitude,
            or every change is undone and ValueError raised.
        add_biases: a site with a nonzero bias read by a linear layer without one gives that layer a bias (for a
            model to export, `normlab.export_onnx`); by default such a site is left as it is, since a Hugging Face
            projection given a bias would not survive a reload.

    Returns:
        A `FoldReport`: per site, the layers that took its gamma, or why it was left as it was.
    """
    probe = _default_probe(model) if probe is None else probe
    sites = _sites(model)
    if not sites:
        raise ValueError("fold: the model has no normlab norm sites (convert it first: normlab.convert_norms)")
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            before = _run(model, probe).detach().clone()
        readers = _readers(model, sites, probe)
        report, undo = FoldReport(), []
        try:
            for name, site in sites.items():
                why = _why_not(site, readers[name], add_biases)
                if why:
                    report.skipped[name] = why
                    continue
                for lname, linear in readers[name]:
                    _untie(model, linear, lname, report, undo)
                _fold_site(site, [lin for _, lin in readers[name]], undo)
                report.folded[name] = [lname for lname, _ in readers[name]]
            with torch.no_grad():
                after = _run(model, probe)
            scale = float(before.abs().max().clamp_min(1e-30))
            report.max_difference = float((after - before).abs().max()) / scale
            if not report.max_difference <= tolerance:
                raise ValueError(_moved(report.max_difference, tolerance, after.dtype))
        except BaseException:
            for step in reversed(undo):
                step()
            raise
    finally:
        model.train(was_training)
    return report
