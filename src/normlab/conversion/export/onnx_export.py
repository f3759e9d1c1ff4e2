"""A converted causal LM as one ONNX file that ONNX Runtime runs, KV cache included.

    import normlab
    report = normlab.export_onnx(model, "model.onnx")   # folds, exports, checks in ONNX Runtime
    print(report.summary())

The element-wise norms are short chains of standard ONNX operators (Mul, Tanh, Erf, Add, Div, Sqrt), so the
file needs nothing custom. What the export does, in order, on a copy of the model:

1. ``normlab.fold`` moves each site's gamma (and beta) into the linear layers that read it, where it can; a
   folded site's unit weight and zero bias are then dropped, so the graph holds the bare ``f(x)``.
2. Every norm takes its reference path (`normlab.functional`): the fused CPU kernels are not ONNX operators.
   The reference's ``torch.hypot`` (DyISRU, ELN), which ONNX lacks, is translated as ``m * sqrt(1 + (n/m)^2)``
   (m, n the larger and smaller magnitude), which overflows no more than hypot does, with its NaN and inf cases.
3. ``torch.export`` traces one decoding step with dynamic batch, length and cache length, and the dynamo
   exporter of ``torch.onnx`` writes it. Inputs: ``input_ids`` (B, T) and ``past.{i}.key`` / ``past.{i}.value``
   (B, heads, P, head_dim) per layer (P = 0 for a prompt); outputs: ``logits`` (B, T, V) and
   ``present.{i}.key`` / ``present.{i}.value``. A massive-token copy is routed by the token's own channels, as in
   PyTorch, wherever the token sits.
4. The check, in ONNX Runtime on the CPU: the logits of ``probe`` sequences against the model as given, and
   greedy tokens decoded with the cache against the model's own ``generate``.

Beside ``OUT.onnx``, ``OUT.onnx.json`` says what it is: its inputs and outputs, the opset, what was folded, the
check's numbers and what it was exported from.
"""

from __future__ import annotations

import copy
import importlib
import json
import math
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from normlab.conversion.batches import cache_kwarg
from normlab.conversion.calibrate.massive import MassiveTokens
from normlab.conversion.export.fold import fold
from normlab.conversion.stages import Stages, library_noise
from normlab.owner import beside, check_writable, hold, publish

__all__ = [
    "MIN_OPSET",
    "check_target",
    "OnnxCheck",
    "OnnxExport",
    "OnnxLM",
    "export_onnx",
    "export_program",
    "export_refusal",
    "onnx_hypot",
    "onnx_missing",
    "output_files",
]

MIN_OPSET = 18  # the oldest opset torch.onnx's exporter writes without a version conversion that may fail
_EXTRA = "pip install 'normlab[onnx]' (onnx, onnxscript, onnxruntime)"
GRAPH_BYTES = 1 << 20  # the graph an export writes beside the weights, a decoder block (a tiny 2-block Llama: 1.8 MB)


def output_files(path: str | Path) -> list[Path]:
    """The files an export to ``path`` writes: the graph, its weights (external data) and what it is.

    Args:
        path: The ``.onnx`` file an export writes.
    """
    path = Path(path)
    return [path, Path(f"{path}.data"), Path(f"{path}.json")]


def onnx_missing() -> str | None:
    """The sentence saying which ONNX package is missing and how to install it; None when all are there."""
    missing = []
    for name in ("onnx", "onnxscript", "onnxruntime"):
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    return f"ONNX export needs {', '.join(missing)}: {_EXTRA}" if missing else None


def onnx_hypot(a: Any, b: Any) -> Any:
    """``aten.hypot`` as ONNX operators, for the exporter's translation table (ONNX has no Hypot):
    m * sqrt(1 + (n / m)^2), m = max(|a|, |b|), n = min(|a|, |b|), so that it overflows no sooner than hypot;
    hypot(inf, anything) = inf and otherwise NaN in, NaN out, as IEEE hypot. Translating the op where the exporter
    meets it, rather than decomposing the traced program first, spares the whole graph a second trace (an export
    of a converted SmolLM2 spent a fifth of its time there).

    Args:
        a: An ONNX value (the exporter's tracer passes it).
        b: An ONNX value broadcastable with ``a``.
    """
    from onnxscript import opset18 as op

    aa, bb = op.Abs(a), op.Abs(b)
    m, n = op.Max(aa, bb), op.Min(aa, bb)
    zero, one, inf = op.CastLike(0.0, m), op.CastLike(1.0, m), op.CastLike(math.inf, m)
    r = op.Div(n, op.Where(op.Equal(m, zero), one, m))
    out = op.Mul(m, op.Sqrt(op.Add(one, op.Mul(r, r))))
    out = op.Where(op.Or(op.IsNaN(a), op.IsNaN(b)), op.Add(a, b), out)
    return op.Where(op.Or(op.IsInf(a), op.IsInf(b)), inf, out)


@dataclass(frozen=True)
class OnnxCheck:
    """How `export_onnx` checks the file in ONNX Runtime against the model: the logits on ``probe`` (token ids
    (B, T); random ones when None), and ``new_tokens`` greedy tokens decoded with the cache against ``generate``'s."""

    probe: torch.Tensor | None = None
    new_tokens: int = 32


@dataclass
class OnnxExport:
    """What `export_onnx` wrote and how it checked: the largest logit difference from the model as given (its
    scale: the largest logit), and whether ``greedy_tokens`` decoded with the cache equal ``generate``'s."""

    path: str
    opset: int
    layers: int
    folded: list[str] = field(default_factory=list)
    fold_note: str = ""
    max_logit_difference: float | None = None
    logit_scale: float | None = None
    greedy_tokens: int = 0
    greedy_equal: bool | None = None
    seconds: float = 0.0
    made_from: dict | None = None

    def summary(self) -> str:
        lines = [f"ONNX: {self.path} (opset {self.opset}, {self.layers} layers with a KV cache, {self.seconds:.1f} s)"]
        lines.append(f"  folded {len(self.folded)} sites" + (f"; {self.fold_note}" if self.fold_note else ""))
        if self.max_logit_difference is not None:
            lines.append(
                f"  ONNX Runtime: logits within {self.max_logit_difference:.2e} of PyTorch's (largest logit "
                f"{self.logit_scale:.3g}); {self.greedy_tokens} greedy tokens with the cache "
                f"{'identical to' if self.greedy_equal else 'DIFFERENT from'} generate's"
            )
        return "\n".join(lines)


class _Step(nn.Module):
    """One decoding step with the cache as plain tensors: (input_ids, *past) -> (logits, *present)."""

    def __init__(self, model: nn.Module, layers: int) -> None:
        super().__init__()
        self.model = model
        self.layers = layers

    def forward(self, input_ids: torch.Tensor, *past: torch.Tensor) -> tuple[torch.Tensor, ...]:
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        for i in range(self.layers):
            cache.update(past[2 * i], past[2 * i + 1], i)
        key = cache_kwarg(self.model)
        out = self.model(input_ids=input_ids, use_cache=True, **{key: cache})
        return (out.logits, *[t for layer in out[key].layers for t in (layer.keys, layer.values)])


def _names(layers: int) -> tuple[list[str], list[str]]:
    kv = [f"{{}}.{i}.{k}" for i in range(layers) for k in ("key", "value")]
    return ["input_ids", *[n.format("past") for n in kv]], ["logits", *[n.format("present") for n in kv]]


def export_refusal(model: nn.Module) -> str | None:
    """Why `export_onnx` refuses ``model`` (not a causal LM, or a cache it cannot keep dynamic), or None: the same
    checks it runs before any work.

    Args:
        model: The model an export would take.
    """
    try:
        _check_model(model)
        _check_cache(model)
    except ValueError as e:
        return str(e)
    return None


def _check_model(model: nn.Module) -> None:
    from normlab.conversion.export.portable import auto_classes

    if "AutoModelForCausalLM" not in auto_classes(model):
        raise ValueError(
            f"export_onnx exports causal language models (what AutoModelForCausalLM builds: Llama, Mistral, Qwen2/3, "
            f"Gemma, GPT-2, ...); {type(model).__name__} is not one"
        )


def _check_cache(model: nn.Module) -> None:
    """A sliding-window layer's cache branches on the length (torch.export fixes the graph to 2-4092 tokens,
    which a decoding step of 1 token breaks): such a model is refused before any work."""
    from transformers import DynamicCache

    try:
        layers = DynamicCache(config=model.config).layers
    except TypeError:  # an older DynamicCache without config
        raise ValueError("export_onnx needs transformers >= 4.56 (a DynamicCache built from the config)") from None
    sliding = sorted({type(layer).__name__ for layer in layers if "Sliding" in type(layer).__name__})
    if sliding:
        raise ValueError(
            f"{type(model).__name__} has sliding-window attention layers ({', '.join(sliding)}; "
            f"config.sliding_window={getattr(model.config, 'sliding_window', None)}), whose cache the export cannot "
            "keep dynamic; export_onnx covers models whose every layer attends to the whole cache"
        )


def _check_opset(opset: int) -> int:
    import onnx

    newest = onnx.defs.onnx_opset_version()
    if isinstance(opset, bool) or not isinstance(opset, int) or not MIN_OPSET <= opset <= newest:
        raise ValueError(
            f"opset must be an int from {MIN_OPSET} to {newest} (this onnx package's newest), got {opset!r}: "
            f"torch.onnx writes opset {MIN_OPSET} and later (Erf, which Derf needs, is in every one of them)"
        )
    return opset


def _float32_copy(model: nn.Module) -> nn.Module:
    """A float32 CPU copy in eval mode (tensor by tensor: transformers refuses .float() on a model read from
    GGUF, which it counts as quantized)."""
    net = copy.deepcopy(model).eval()
    for t in [*net.parameters(), *net.buffers()]:
        t.data = t.data.to("cpu", torch.float32 if t.is_floating_point() else t.dtype)
    return net


def _prepare(model: nn.Module, do_fold: bool, report: OnnxExport) -> nn.Module:
    """A float32 copy on the CPU, folded where it can be, every norm on its reference path."""
    net = _float32_copy(model)
    if do_fold:
        try:
            folded = fold(net, add_biases=True)  # the copy is exported, never reloaded by transformers
            report.folded = list(folded.folded)
            report.fold_note = "; ".join(f"{k}: {v}" for k, v in list(folded.skipped.items())[:3])
        except ValueError as e:  # the fold's own check refused: exported unfolded, and said so
            net = _float32_copy(model)
            report.fold_note = f"not folded ({e})"
        for name in report.folded:
            site = net.get_submodule(name)
            site = site.main if isinstance(site, MassiveTokens) else site
            for p in ("weight", "bias"):
                t = site._parameters.get(p)
                if t is not None and bool(torch.all(t == (1 if p == "weight" else 0))):
                    site._parameters[p] = None  # the formula skips a None affine: no Mul by ones in the graph
    for m in net.modules():
        if hasattr(m, "kernel"):
            m.kernel = "reference"
    return net


def _example(net: nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Example inputs whose sizes are none 0 or 1 (torch.export would fix those): 2 sequences of 3 tokens after
    a cache of 2, the cache taken from the model's own pass."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, net.config.vocab_size, (2, 5), generator=g)
    with torch.no_grad():
        cache = net(input_ids=ids[:, :2], use_cache=True)[cache_kwarg(net)]
    if not hasattr(cache, "layers"):
        raise ValueError("export_onnx needs transformers >= 4.56 (a DynamicCache with .layers)")
    past = [t.clone() for layer in cache.layers for t in (layer.keys, layer.values)]
    return ids[:, 2:].clone(), past  # own storage: a view's strides would tie the traced sizes together


def _export(net: nn.Module, path: Path, opset: int) -> int:
    ids, past = _example(net)
    layers = len(past) // 2
    batch = torch.export.Dim("batch", min=1, max=4096)
    length = torch.export.Dim("length", min=1, max=65536)
    cached = torch.export.Dim("cached", min=0, max=65536)
    shapes = ({0: batch, 1: length}, tuple({0: batch, 2: cached} for _ in past))
    inputs, outputs = _names(layers)
    export_program(_Step(net, layers).eval(), (ids, *past), path, opset, shapes, (inputs, outputs))
    return layers


def export_program(
    module: nn.Module,
    args: tuple,
    path: str | Path,
    opset: int = MIN_OPSET,
    dynamic_shapes: dict | tuple | None = None,
    names: tuple[list[str], list[str]] | None = None,
) -> None:
    """``torch.export`` then ``torch.onnx``, with `onnx_hypot` for ``torch.hypot`` (which ONNX lacks); ``names``:
    the graph's input names and output names.

    Args:
        module: The module exported.
        args: Example inputs of its forward.
        path: The ``.onnx`` file written.
        opset: The ONNX opset.
        dynamic_shapes: ``torch.export``'s dynamic shapes of ``args``; None: all static.
        names: The graph's input names and output names; None: torch.onnx's.
    """
    input_names, output_names = names or (None, None)
    with torch.no_grad():
        program = torch.export.export(module, args, dynamic_shapes=dynamic_shapes)
    torch.onnx.export(
        program,
        args,
        str(path),
        dynamo=True,
        opset_version=opset,
        input_names=input_names,
        output_names=output_names,
        verbose=False,
        custom_translation_table={torch.ops.aten.hypot.default: onnx_hypot},
    )


class OnnxLM:
    """An exported file in ONNX Runtime (CPU): ``step`` runs one call with the cache, ``greedy`` decodes.

    Args:
        path: The exported ``.onnx`` file.
        threads: ONNX Runtime's intra-op threads; None: its default.
    """

    def __init__(self, path: str | Path, threads: int | None = None) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self.past_names = [i.name for i in self.session.get_inputs()][1:]
        self.past_shape = {i.name: i.shape for i in self.session.get_inputs()[1:]}

    def empty_past(self, batch: int) -> dict:
        import numpy as np

        return {n: np.zeros((batch, s[1], 0, s[3]), dtype=np.float32) for n, s in self.past_shape.items()}

    def step(self, ids, past: dict) -> tuple:
        out = self.session.run(None, {"input_ids": ids, **past})
        return out[0], dict(zip(self.past_names, out[1:]))

    def greedy(self, prompt, new_tokens: int, eos: set[int] = frozenset()) -> list[int]:
        """Greedy tokens after ``prompt`` (1, T) int64, stopping after an end-of-sequence token as generate does."""
        import numpy as np

        logits, past = self.step(prompt, self.empty_past(prompt.shape[0]))
        out = []
        for _ in range(new_tokens):
            nxt = int(logits[0, -1].argmax())
            out.append(nxt)
            if nxt in eos:
                break
            logits, past = self.step(np.array([[nxt]], dtype=np.int64), past)
        return out


def _check(model: nn.Module, path: Path, check: OnnxCheck, report: OnnxExport) -> None:
    probe, new_tokens = check.probe, check.new_tokens
    runner = OnnxLM(path)
    with torch.no_grad():
        want = model(input_ids=probe).logits.float()
    got, _ = runner.step(probe.numpy(), runner.empty_past(probe.shape[0]))
    report.max_logit_difference = float((torch.from_numpy(got) - want).abs().max())
    report.logit_scale = float(want.abs().max())
    prompt = probe[:1, : min(8, probe.shape[1])]
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    with torch.no_grad():
        ref = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False)[0, prompt.shape[1] :].tolist()
    ours = runner.greedy(prompt.numpy(), new_tokens, eos)
    report.greedy_tokens, report.greedy_equal = len(ours), ours == ref


def export_onnx(
    model: nn.Module,
    path: str | Path,
    *,
    opset: int = MIN_OPSET,
    fold: bool = True,
    check: OnnxCheck | None = OnnxCheck(),
    made_from: dict | None = None,
) -> OnnxExport:
    """Export a (converted) causal LM to ``path`` with its KV cache, and check the file in ONNX Runtime.

    The model is not changed. Everything is checked before the export starts: the packages, the model's kind
    (`export_refusal`), the opset, the path. The files are written into `partial_folder` and moved under their
    names only once checked, so an interrupted export leaves no file under the final names. Each stage is printed on
    stderr as it starts and ends, with its seconds.

    Args:
        model: a Hugging Face causal LM (converted or not).
        path: the ``.onnx`` file to write; its identity goes beside it as ``PATH.json``.
        opset: the ONNX opset, at least `MIN_OPSET`.
        fold: fold each site's gamma into the layers that read it first (on a copy), where it can.
        check: how the file is checked against the model (`OnnxCheck`: logits on a probe, greedy tokens with
            the cache); None: no check.
        made_from: what the model was made from (a converted folder and its record's hash), recorded in the
            identity.

    Returns:
        An `OnnxExport`: the file, the layers, the folded sites, and the check's largest logit difference and
        greedy agreement.
    """
    missing = onnx_missing()
    if missing:
        raise ModuleNotFoundError(missing)
    _check_model(model)
    _check_cache(model)
    path, opset = check_target(path, opset)
    from normlab.owner import check_out_space

    blocks = getattr(getattr(model, "config", None), "num_hidden_layers", None) or 1
    graph = GRAPH_BYTES * (1 + blocks)  # beside the float32 weights, before any work
    check_out_space(str(path), model, "the ONNX file", "the export", extra=graph)
    if check is not None and check.probe is None:
        random_ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
        check = OnnxCheck(random_ids, check.new_tokens)
    start = time.perf_counter()
    report = OnnxExport(path=str(path), opset=opset, layers=0, made_from=made_from)
    stage = Stages(progress=True, prefix="export: ")
    with hold(path, "the ONNX file"):
        partial = partial_folder(path)
        if partial.exists():
            shutil.rmtree(partial)
            stage.say(f"removed {partial}: a partial export that an interrupted run left")
        partial.mkdir(parents=True)
        draft = partial / path.name  # the graph and its weights are written and checked here, then moved
        try:
            with stage("fold"):
                net = _prepare(model, fold, report)
            with stage("export (torch.export, then torch.onnx)"), library_noise():
                report.layers = _export(net, draft, opset)
            if check is not None:
                with stage("check in ONNX Runtime"):
                    _check(model, draft, check, report)
            report.seconds = time.perf_counter() - start
            output_files(draft)[2].write_text(json.dumps(_identity(report, net), indent=2) + "\n")  # every write
            # here, before any file takes its final name
        except BaseException:  # a failed or interrupted export gives its disk space back at once
            shutil.rmtree(partial, ignore_errors=True)
            raise
        publish(list(zip(output_files(draft), output_files(path))), partial)
    return report


def check_target(path: str | Path, opset: int) -> tuple[Path, int]:
    """The ONNX file's path and opset, checked before any work: a name ending in .onnx that is not a folder, in a
    folder that can be written, and an opset the installed onnx package knows.

    Args:
        path: The ``.onnx`` file to write.
        opset: The ONNX opset.
    """
    path = Path(path)
    if path.suffix != ".onnx":
        raise ValueError(f"the ONNX file's name must end in .onnx, got {str(path)!r}")
    if path.is_dir():
        raise ValueError(f"{path} is a folder; name the .onnx file to write (for example {path / 'model.onnx'})")
    check_writable(path, "the ONNX file")  # its folder takes the partial export and the lock beside it
    return path, _check_opset(opset)


def partial_folder(path: str | Path) -> Path:
    """Where an export to ``path`` writes before its check passes: ``.NAME.partial`` beside it. Only a finished,
    checked export has files under the final names.

    Args:
        path: The ``.onnx`` file an export writes.
    """
    return beside(path, "partial")


def _identity(report: OnnxExport, net: nn.Module) -> dict:
    from normlab.version import __version__

    inputs, outputs = _names(report.layers)
    return {
        "what": "a causal LM exported by normlab.export_onnx: one decoding step with its KV cache",
        "normlab": __version__,
        "model_class": type(net).__name__,
        "inputs": inputs,
        "outputs": outputs,
        **asdict(report),
    }
