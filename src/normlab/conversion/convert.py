"""Swap the norms of any PyTorch or Hugging Face model for a registered norm, fitted to the model's own activations.

    import normlab
    record = normlab.convert_norms(model, to="dyisru", calibrate=batches)   # in place; returns what it did
    print(record.table())
    report = normlab.fidelity(original, model, held_out)                     # how close the converted model is

What it finds (``KNOWN_NORMS``): ``nn.LayerNorm``, ``nn.RMSNorm``, normlab's own LayerNorm/RMSNorm, and the
RMSNorm classes of Hugging Face models (Llama, Qwen2/3, Mistral, Mixtral, Phi3, T5LayerNorm, and Gemma's, whose
scale is 1 + weight). Add a class with ``extra_classes={MyNorm: "rms_norm"}`` or restrict sites with
``include=lambda name, module: ...``. Any other module whose class name contains "Norm" is reported as skipped,
with the reason; nothing is skipped silently.

Calibration (``calibrate=`` sample inputs or a dataloader) fits each replacement, site by site in the order the
model runs them, on the activations of the model as converted so far, so that its output after the affine
matches the original norm's; the first token can get its own replacement (:mod:`normlab.conversion.calibrate`). Every
target is fitted with the same two degrees of freedom, its parameter (DyISRU/ELN beta, DyT alpha) and an
amplitude folded into the copied weight. ``per="channel"`` fits one of each per channel.

Conversion is all-or-nothing: every replacement is built before the first module is swapped, and a calibration
that fails part-way puts every original norm back.
"""

from __future__ import annotations

import fnmatch
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from normlab.conversion.calibrate import _batches, _run, calibrate_sites, per_channel_kwargs
from normlab.registry import create_norm, init_kwargs, list_norms, norm_spec

__all__ = ["KNOWN_NORMS", "ConversionRecord", "convert_norms", "apply_record", "fidelity", "save_converted",
           "load_converted", "CALIBRATABLE"]  # fmt: skip

# class name -> how it normalizes ("layer_norm", "rms_norm", or "rms_norm_offset": scale is 1 + weight)
KNOWN_NORMS: dict[str, str] = {
    "LayerNorm": "layer_norm",  # torch.nn.LayerNorm (GPT-2, BERT, ...) and normlab's
    "RMSNorm": "rms_norm",  # torch.nn.RMSNorm and normlab's
    "LlamaRMSNorm": "rms_norm",
    "Qwen2RMSNorm": "rms_norm",
    "Qwen3RMSNorm": "rms_norm",
    "MistralRMSNorm": "rms_norm",
    "MixtralRMSNorm": "rms_norm",
    "Phi3RMSNorm": "rms_norm",
    "T5LayerNorm": "rms_norm",
    "GemmaRMSNorm": "rms_norm_offset",
    "Gemma2RMSNorm": "rms_norm_offset",
    "Gemma3RMSNorm": "rms_norm_offset",
}
CALIBRATABLE = tuple(n for n in list_norms() if norm_spec(n).fits)  # the registry says what a fit sets


@dataclass
class Site:
    name: str
    source: str  # class name of the module replaced
    kind: str  # layer_norm | rms_norm | rms_norm_offset
    dim: int
    eps: float
    kwargs: dict  # what the replacement was built with
    copied: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    fit: dict | None = None
    first_token: bool = False  # the first token has its own replacement (normlab.conversion.calibrate.FirstToken)


@dataclass
class ConversionRecord:
    target: str
    per: str
    sites: list[Site]
    skipped: list[dict]
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"format": "normlab-conversion-1", "target": self.target, "per": self.per,
                "sites": [asdict(s) for s in self.sites], "skipped": self.skipped, "notes": self.notes}  # fmt: skip

    @classmethod
    def from_dict(cls, d: dict) -> ConversionRecord:
        if d.get("format") != "normlab-conversion-1":
            raise ValueError("not a normlab conversion record (format normlab-conversion-1)")
        return cls(d["target"], d["per"], [Site(**s) for s in d["sites"]], d["skipped"], d.get("notes", []))

    def table(self, markdown: bool = False) -> str:
        from normlab._table import format_table

        rows = []
        for s in self.sites:
            f = s.fit or {}
            param = f.get("param_name", "-")
            value = f.get("value", "-")
            status = "ok" if f.get("converged", True) else "FLAGGED"
            rows.append([s.name, s.source, self.target, param, value, f.get("rel_error", "-"),
                         "; ".join([status] + s.notes)])
        out = format_table(["site", "replaced", "with", "param", "value", "fit rel. error", "notes"], rows, markdown)
        if self.notes:
            out += "\n" + "\n".join(self.notes)
        if self.skipped:
            out += "\nnot converted: " + "; ".join(f"{s['name']} ({s['class']}): {s['reason']}" for s in self.skipped)
        return out


# --------------------------------------------------------------------------
# finding and building
# --------------------------------------------------------------------------
def _kind(module: nn.Module, extra: dict) -> str | None:
    for cls, kind in extra.items():
        if isinstance(module, cls):
            return kind
    name = type(module).__name__
    if name in KNOWN_NORMS:
        return KNOWN_NORMS[name]
    if name.endswith("RMSNorm") and hasattr(module, "weight"):  # an RMSNorm of a model not in the table
        return "rms_norm_offset" if name.startswith("Gemma") else "rms_norm"
    return None


def _source_eps(module: nn.Module) -> float:
    for attr in ("eps", "variance_epsilon"):
        v = getattr(module, attr, None)
        if isinstance(v, (int, float)):
            return float(v)
    w = getattr(module, "weight", None)
    return float(torch.finfo(w.dtype if w is not None else torch.float32).eps)  # nn.RMSNorm(eps=None)


def _source_dim(module: nn.Module) -> int | None:
    shape = getattr(module, "normalized_shape", None)
    if shape is not None:
        return int(shape[0]) if len(shape) == 1 else None
    w = getattr(module, "weight", None)
    return int(w.shape[-1]) if w is not None and w.dim() == 1 else None


def _find(model: nn.Module, extra: dict, include) -> tuple[list[tuple[str, nn.Module, str]], list[dict]]:
    found, skipped = [], []
    for name, m in model.named_modules():
        if not name:
            continue
        kind = _kind(m, extra)
        if kind is None:
            if "Norm" in type(m).__name__ and not any(name.startswith(f[0] + ".") for f in found):
                skipped.append({"name": name, "class": type(m).__name__,
                                "reason": "not a known per-token norm (add it with extra_classes=)"})  # fmt: skip
            continue
        if include is not None and not include(name, m):
            skipped.append({"name": name, "class": type(m).__name__, "reason": "excluded by include="})
            continue
        if _source_dim(m) is None:
            shape = getattr(m, "normalized_shape", None)
            why = ("normalizes over more than one dimension" if shape is not None else
                   "its channel count is unknown: no normalized_shape and no 1-d weight")  # fmt: skip
            if type(m) in extra:  # the user asked for this class: say so, do not skip it quietly
                raise ValueError(f"extra_classes[{type(m).__name__}]: cannot convert {name}: {why}")
            skipped.append({"name": name, "class": type(m).__name__, "reason": why})
            continue
        found.append((name, m, kind))
    return found, skipped


def _site_kwargs(name: str, init: dict, site_init: dict) -> dict:
    kw = dict(init)
    for pattern, extra in site_init.items():
        if fnmatch.fnmatch(name, pattern):
            kw.update(extra)
    return kw


def _build(name: str, m: nn.Module, kind: str, to: str, kwargs: dict) -> tuple[nn.Module, Site]:
    dim, eps = _source_dim(m), _source_eps(m)
    if "eps" in init_kwargs(to) and "eps" not in kwargs:
        kwargs = {**kwargs, "eps": eps}  # keep the source's eps where the target has one
    try:
        new = create_norm(to, dim, **kwargs)
    except TypeError as e:  # an init argument the target does not take: say which site asked for it
        raise ValueError(f"site {name}: {e}") from None
    site = Site(name, type(m).__name__, kind, dim, eps, kwargs)
    w = getattr(m, "weight", None)
    b = getattr(m, "bias", None)
    with torch.no_grad():
        if getattr(new, "weight", None) is not None:
            if w is not None:
                new.weight.copy_(w.detach() + 1.0 if kind == "rms_norm_offset" else w.detach())
                site.copied.append("weight (1 + weight)" if kind == "rms_norm_offset" else "weight")
        elif w is not None:
            site.notes.append("weight dropped: the target has none")
        if isinstance(b, torch.Tensor):
            if getattr(new, "bias", None) is not None:
                new.bias.copy_(b.detach())
                site.copied.append("bias")
            else:
                site.notes.append("bias dropped: the target has none")
    ref = w if w is not None else next(iter(m.parameters()), None)
    if ref is not None:
        new = new.to(device=ref.device, dtype=ref.dtype)
    new.train(m.training)
    return new, site


# --------------------------------------------------------------------------
def convert_norms(
    model: nn.Module,
    to: str = "dyisru",
    *,
    calibrate=None,
    per: str = "global",
    init: dict | None = None,
    site_init: dict[str, dict] | None = None,
    extra_classes: dict[type, str] | None = None,
    include: Callable[[str, nn.Module], bool] | None = None,
    max_tokens: int = 4096,
    fit_amplitude: bool = True,
    first_token: str = "auto",
    massive: float = 10.0,
    target: str = "original",
    progress: bool | None = None,
) -> ConversionRecord:
    """Replace the model's norms with ``to`` in place; return the record of what was done.

    init:       kwargs for every replacement (e.g. {"alpha_init": 0.5});
    site_init:  {fnmatch pattern on the module name: kwargs}, e.g. DyT's LLaMA recipe
                {"*input_layernorm": {"alpha_init": 0.8}, "*post_attention_layernorm": {"alpha_init": 0.2}};
    calibrate:  sample inputs (tensor, dict of kwargs, list, or dataloader) to fit the new parameters, site by
                site in the order the model runs them (:mod:`normlab.conversion.calibrate`);
    per:        "global" or "channel" (one fitted parameter per channel);
    fit_amplitude: also fit an amplitude, folded into the weight (default); False keeps the module's own
                (sqrt(C) for DyISRU and scaled DyT, as in the papers; 1 for DyT);
    first_token: "own" gives the first token of each sequence its own replacement (:class:`FirstToken`),
                "shared" does not, "auto" (default) does when its RMS is a massive outlier (> ``massive`` x the
                median token's) at some site, as in real LLMs;
    massive:    tokens with an RMS above this multiple of the median are left out of the shared fit;
    target:     what each site is fitted to reproduce: "original" (default), the original model's output at that
                site, which also corrects the drift inherited from earlier sites; or "local", the original norm
                applied to the site's input in the model converted so far;
    max_tokens: calibration tokens kept per site (besides every first token);
    progress:   a progress bar over the sites (None: only on a terminal).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert_norms: expected an nn.Module, got {type(model).__name__}")
    norm_spec(to)  # an unknown target lists the valid names
    if per not in ("global", "channel"):
        raise ValueError(f"per must be 'global' or 'channel', got {per!r}")
    if target not in ("original", "local"):
        raise ValueError(f"target must be 'original' or 'local', got {target!r}")
    if first_token not in ("auto", "own", "shared"):
        raise ValueError(f"first_token must be 'auto', 'own' or 'shared', got {first_token!r}")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 16:
        raise ValueError(f"max_tokens: expected an int >= 16 (calibration tokens per site), got {max_tokens!r}")
    if isinstance(massive, bool) or not isinstance(massive, (int, float)) or not massive > 1:
        raise ValueError(f"massive: expected a number > 1 (a multiple of the median token RMS), got {massive!r}")
    if calibrate is not None and to not in CALIBRATABLE:
        raise ValueError(f"calibration fits the parameter of {', '.join(CALIBRATABLE)}; {to!r} has none to fit "
                         "(convert without calibrate=)")  # fmt: skip
    extra = dict(extra_classes or {})
    for cls, kind in extra.items():
        if kind not in ("layer_norm", "rms_norm", "rms_norm_offset"):
            raise ValueError(f"extra_classes[{cls.__name__}]: kind must be layer_norm, rms_norm or rms_norm_offset")
    found, skipped = _find(model, extra, include)
    if not found:
        raise ValueError(f"convert_norms: found no normalization module to convert in {type(model).__name__} "
                         f"(known: {', '.join(sorted(KNOWN_NORMS))}; add yours with extra_classes=)")  # fmt: skip
    unused = [pat for pat in (site_init or {}) if not any(fnmatch.fnmatch(name, pat) for name, _, _ in found)]
    if unused:
        names = ", ".join(name for name, _, _ in found[:4]) + (", ..." if len(found) > 4 else "")
        raise ValueError(f"site_init: pattern {unused[0]!r} matches no converted site; the sites are {names}")

    per_kw = per_channel_kwargs(to) if per == "channel" else {}
    replacements, sites = {}, []
    for name, m, kind in found:  # build everything first: an error here leaves the model untouched
        new, site = _build(name, m, kind, to, {**per_kw, **_site_kwargs(name, init or {}, site_init or {})})
        replacements[name] = new
        sites.append(site)
    notes = []
    if calibrate is not None:  # fits and swaps site by site; puts every original back if anything fails
        notes.append(calibrate_sites(model, sites, replacements, calibrate, to=to, per=per,
                                     fit_amplitude=fit_amplitude, first_token=first_token, massive=float(massive),
                                     max_tokens=max_tokens, target=target, progress=progress))  # fmt: skip
    else:
        for name, new in replacements.items():  # the swap itself
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
    return ConversionRecord(to, per, sites, skipped, notes)


def apply_record(model: nn.Module, record: ConversionRecord) -> nn.Module:
    """Rebuild a recorded conversion's structure on a fresh model (no calibration); load the weights after."""
    names = {name for name, _ in model.named_modules()}
    missing = [s.name for s in record.sites if s.name not in names]
    if missing:
        raise ValueError(f"the model has no module {missing[0]!r} from the conversion record; is it the same model?")
    from normlab.conversion.calibrate import FirstToken

    for s in record.sites:
        new = create_norm(record.target, s.dim, **s.kwargs)
        if s.first_token:
            first_kwargs = {**s.kwargs, **per_channel_kwargs(record.target)}
            new = FirstToken(new, create_norm(record.target, s.dim, **first_kwargs))
        old = model.get_submodule(s.name)
        ref = next(iter(old.parameters()), None)
        if ref is not None:
            new = new.to(device=ref.device, dtype=ref.dtype)
        parent_name, _, child = s.name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
    return model


# --------------------------------------------------------------------------
# fidelity
# --------------------------------------------------------------------------
def _logits(out, lm: bool | None):
    """The final output tensor, and whether it holds next-token logits (auto: a ModelOutput with .logits)."""
    for attr in ("logits", "last_hidden_state"):
        if hasattr(out, attr):
            return getattr(out, attr), attr == "logits" if lm is None else lm
    if isinstance(out, (tuple, list)):
        out = out[0]
    return out, bool(lm)


@torch.no_grad()
def fidelity(original: nn.Module, converted: nn.Module, inputs, record: ConversionRecord | None = None,
             *, lm: bool | None = None) -> dict:  # fmt: skip
    """How close ``converted`` is to ``original`` on held-out ``inputs``.

    Per site: the relative error of the norm's output, ||y_conv - y_orig|| / ||y_orig||, both models fed the
    same inputs. Final output: mean per-token cosine similarity, and for language models (outputs with
    logits) the mean KL(original || converted) of the next-token distributions and, when the inputs are token
    ids, the next-token cross-entropy of both models (``ce_original``, ``ce_converted``, nats/token).
    ``lm=True`` says that a plain tensor or tuple output (its first element) holds logits; by default only a
    ``.logits`` attribute does.
    """
    sites = [s.name for s in record.sites] if record else []
    outs: dict[str, dict[str, list]] = {"orig": {n: [] for n in sites}, "conv": {n: [] for n in sites}}
    handles = []
    for tag, model in (("orig", original), ("conv", converted)):
        for n in sites:
            handles.append(model.get_submodule(n).register_forward_hook(
                lambda mod, a, y, n=n, tag=tag: outs[tag][n].append(y.detach().float().cpu())))  # fmt: skip
    cos, kl, n_tok = 0.0, 0.0, 0
    ce, n_ce = [0.0, 0.0], 0
    has_logits = False
    modes = (original.training, converted.training)
    original.eval()
    converted.eval()
    try:
        for i, batch in enumerate(_batches(inputs)):
            a, is_lm = _logits(_run(original, batch, i), lm)
            b, _ = _logits(_run(converted, batch, i), lm)
            a, b = a.float().reshape(-1, a.shape[-1]), b.float().reshape(-1, b.shape[-1])
            cos += float(torch.nn.functional.cosine_similarity(a, b, dim=-1).sum())
            if is_lm:
                has_logits = True
                kl += float(torch.nn.functional.kl_div(b.log_softmax(-1), a.log_softmax(-1), log_target=True,
                                                       reduction="sum"))  # fmt: skip
                ids = _token_ids(batch)
                if ids is not None and ids.shape[-1] > 1 and ids.numel() == a.shape[0]:  # next-token cross-entropy
                    nxt = ids.reshape(-1, ids.shape[-1])[:, 1:].reshape(-1).to(a.device)
                    keep = torch.ones(ids.shape, dtype=torch.bool).reshape(-1, ids.shape[-1])
                    keep[:, -1] = False
                    keep = keep.reshape(-1).to(a.device)
                    for j, logits in enumerate((a, b)):
                        ce[j] += float(torch.nn.functional.cross_entropy(logits[keep], nxt, reduction="sum"))
                    n_ce += nxt.numel()
            n_tok += a.shape[0]
    finally:
        for h in handles:
            h.remove()
        original.train(modes[0])
        converted.train(modes[1])
    if n_tok == 0:
        raise ValueError("fidelity: the held-out inputs are empty")
    per_site = {}
    for n in sites:
        ya = torch.cat([t.reshape(-1) for t in outs["orig"][n]])
        yb = torch.cat([t.reshape(-1) for t in outs["conv"][n]])
        per_site[n] = float((yb - ya).norm() / ya.norm().clamp_min(1e-30))
    result = {"output_cosine": cos / n_tok, "sites": per_site,
              "mean_site_error": sum(per_site.values()) / len(per_site) if per_site else math.nan}  # fmt: skip
    if has_logits:
        result["kl"] = kl / n_tok
    if n_ce:
        result["ce_original"], result["ce_converted"] = ce[0] / n_ce, ce[1] / n_ce
    return result


def _token_ids(batch) -> torch.Tensor | None:
    ids = batch.get("input_ids") if isinstance(batch, dict) else batch
    return ids if isinstance(ids, torch.Tensor) and not ids.is_floating_point() else None


# --------------------------------------------------------------------------
# saving and loading
# --------------------------------------------------------------------------
RECORD_FILE = "normlab_conversion.json"


def save_converted(model: nn.Module, record: ConversionRecord, path: str | Path) -> Path:
    """Weights plus the conversion record. A Hugging Face model is saved with its own save_pretrained."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if hasattr(model, "save_pretrained"):
        model.save_pretrained(path)
    else:
        torch.save(model.state_dict(), path / "model.pt")
    d = record.to_dict()
    d["model_class"] = type(model).__name__
    (path / RECORD_FILE).write_text(json.dumps(d, indent=2) + "\n")
    return path


def _load_state(path: Path) -> dict:
    if (path / "model.pt").exists():
        return torch.load(path / "model.pt", map_location="cpu", weights_only=True)
    from safetensors.torch import load_file

    if (path / "model.safetensors").exists():
        return load_file(path / "model.safetensors")
    index = path / "model.safetensors.index.json"
    if index.exists():
        state = {}
        for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
            state.update(load_file(path / shard))
        return state
    raise FileNotFoundError(f"{path}: no model.pt, model.safetensors or sharded safetensors index")


def load_converted(path: str | Path, model: nn.Module | None = None) -> tuple[nn.Module, ConversionRecord]:
    """Load a model saved by :func:`save_converted`.

    For a Hugging Face model, ``model`` may be omitted: it is rebuilt from the saved config. For a plain
    PyTorch model pass a freshly constructed instance of the original architecture.
    """
    path = Path(path)
    if not (path / RECORD_FILE).exists():
        raise FileNotFoundError(f"{path} holds no {RECORD_FILE}: not a model saved by normlab.save_converted")
    d = json.loads((path / RECORD_FILE).read_text())
    record = ConversionRecord.from_dict(d)
    if model is None:
        if not (path / "config.json").exists():
            raise ValueError(f"{path} has no config.json: pass the model to load into (load_converted(path, model))")
        import transformers

        config = transformers.AutoConfig.from_pretrained(path)
        cls = getattr(transformers, d.get("model_class") or config.architectures[0])
        model = cls(config)
    apply_record(model, record)
    state = _load_state(path)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    missing = [k for k in missing if k not in tied and not any(fnmatch.fnmatch(k, t) for t in tied)]
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    if unexpected or missing:
        raise ValueError(f"{path}: weights do not match the converted model (missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]})")  # fmt: skip
    return model.eval(), record
