"""ONNX export (normlab.conversion.export.onnx_export): the formulas at the edges in ONNX Runtime, converted tiny
models of
every family the export covers checked against PyTorch with their KV cache, the command line, and bad input."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import pytest
import torch

import normlab
from conftest import id_batches, sink_batches, tiny_lm, with_sinks
from normlab import functional as FN
from normlab.conversion.export.onnx_export import OnnxCheck, export_onnx, export_program

for _name in ("onnx", "onnxscript", "onnxruntime"):
    pytest.importorskip(_name, reason="the onnx extra is absent: pip install 'normlab[onnx]'")
transformers = pytest.importorskip("transformers")

EDGES = [0.0, -0.0, 1e-45, -1e-30, 1e-3, 0.5, -2.0, 1e4, -1e19, 1e30, 3e38, -3e38, math.inf, -math.inf, math.nan]


class _Hypot(torch.nn.Module):
    def forward(self, a, b):
        return torch.hypot(a, b)


def test_hypot_in_onnx_runtime_is_torchs_at_the_edges(tmp_path):
    """ONNX has no Hypot: the export writes it from other operators (`onnx_hypot`). Every pair of edge values
    (zeros, subnormals, huge, inf, NaN), run in ONNX Runtime, gives torch.hypot's answer."""
    import onnxruntime as ort

    a = torch.tensor(EDGES).repeat_interleave(len(EDGES))
    b = torch.tensor(EDGES).repeat(len(EDGES))
    export_program(_Hypot(), (a, b), tmp_path / "h.onnx")
    got = ort.InferenceSession(str(tmp_path / "h.onnx")).run(None, {"a": a.numpy(), "b": b.numpy()})[0]
    torch.testing.assert_close(torch.from_numpy(got), torch.hypot(a, b), rtol=2e-7, atol=0, equal_nan=True)


class _Formula(torch.nn.Module):
    def __init__(self, name: str, c: int) -> None:
        super().__init__()
        self.name = name
        g = torch.Generator().manual_seed(0)
        self.p = torch.nn.Parameter(torch.rand(c, generator=g) + 0.5)
        self.weight = torch.nn.Parameter(torch.randn(c, generator=g))
        self.bias = torch.nn.Parameter(torch.randn(c, generator=g))

    def forward(self, x):
        return getattr(FN, self.name)(x, self.p, weight=self.weight, bias=self.bias)


@pytest.mark.parametrize("name", ["dyt", "derf", "scaled_dyt", "dyisru", "eln"])
def test_each_formula_in_onnx_runtime_gives_the_references_answer_at_the_edges(name, tmp_path):
    """Huge, tiny, zero, NaN and inf inputs: ONNX Runtime's answer is the reference's, NaN where it is NaN."""
    import onnxruntime as ort

    c = len(EDGES)
    x = torch.stack([torch.tensor(EDGES), torch.tensor(EDGES).roll(3), torch.linspace(-4, 4, c)])
    x[2, 5] = math.inf  # ELN: a row holding inf is NaN where centred; the others finite
    module = _Formula(name, c)
    export_program(module, (x,), tmp_path / "f.onnx")
    got = ort.InferenceSession(str(tmp_path / "f.onnx")).run(None, {"x": x.numpy()})[0]
    with torch.no_grad():
        want = module(x)
    torch.testing.assert_close(torch.from_numpy(got), want, rtol=3e-6, atol=3e-6, equal_nan=True)


def _case(family: str, target: str, **config):
    model = with_sinks(tiny_lm(family, **config))
    record = normlab.convert_norms(model, target, calibrate=sink_batches(2), per="channel", progress=False)
    assert any(s.massive for s in record.sites)
    return model, record


@pytest.mark.slow
@pytest.mark.parametrize(
    "family, target, config",
    [("Llama", "derf", {}), ("Qwen3", "eln", {}), ("Gemma", "dyt", {})],
)  # fmt: skip
# two more exports, each about 35 s, in the tests below: Qwen2 with DyISRU (healed, its projections' biases), Mistral
# with scaled DyT (through the command line); each formula's ONNX against the reference at the edges above
def test_a_converted_lm_exports_with_its_cache_and_runs_in_onnx_runtime(family, target, config, tmp_path):
    """Folded, exported, and in ONNX Runtime: the logits of held-out ids within float32 rounding of PyTorch's,
    and 32 greedy tokens decoded with the cache (massive-token copies included) identical to generate's."""
    model, _ = _case(family, target, **config)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = export_onnx(model, tmp_path / "m.onnx", check=OnnxCheck(id_batches(1, seed=5, t=12)[0]))
    assert report.folded and report.layers == 2
    assert report.max_logit_difference <= 1e-5 * report.logit_scale, report.summary()
    assert report.greedy_equal, report.summary()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())  # the model was not changed
    meta = json.loads((tmp_path / "m.onnx.json").read_text())
    assert meta["inputs"][:3] == ["input_ids", "past.0.key", "past.0.value"] and meta["outputs"][0] == "logits"


@pytest.mark.slow
def test_gpt2_exports_though_its_conv1d_layers_take_no_fold(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=4, n_positions=64, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    normlab.convert_norms(model, "dyisru", calibrate=id_batches(2), per="channel", progress=False)
    report = export_onnx(model, tmp_path / "g.onnx", check=OnnxCheck(id_batches(1, seed=5, t=12)[0]))
    assert "no linear layer reads its output" in report.fold_note
    assert report.max_logit_difference <= 1e-5 * report.logit_scale and report.greedy_equal


def test_what_the_export_does_not_cover_is_refused_before_any_file(tmp_path):
    out = tmp_path / "x.onnx"
    with pytest.raises(ValueError, match=r"sliding-window attention layers \(DynamicSlidingWindowLayer"):
        export_onnx(tiny_lm("Gemma3"), out)
    bert = transformers.BertForMaskedLM(
        transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=4)
    )
    with pytest.raises(ValueError, match="BertForMaskedLM is not one"):
        export_onnx(bert, out)
    with pytest.raises(ValueError, match="opset must be an int from 18 to"):
        export_onnx(tiny_lm(), out, opset=9)
    with pytest.raises(ValueError, match="must end in .onnx"):
        export_onnx(tiny_lm(), tmp_path / "x.bin")
    assert list(tmp_path.iterdir()) == []


def _cli(*args, env_code: str = ""):
    code = f"{env_code}\nimport sys\nfrom normlab.cli import main\nsys.exit(main({list(args)!r}))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_normlab_export_writes_a_checked_file_from_a_converted_folder(tmp_path):
    folder = normlab.save_converted(*_case("Mistral", "scaled_dyt", sliding_window=None), tmp_path / "c")
    out = tmp_path / "onnx" / "m.onnx"
    run = _cli("export", str(folder), "--onnx", str(out))
    assert run.returncode == 0, run.stderr[-2000:]
    assert "identical to generate's" in run.stdout
    for stage in ("fold", "export (torch.export, then torch.onnx)", "check in ONNX Runtime"):
        assert re.search(rf"export: {re.escape(stage)}: [0-9.]+ s, peak [0-9.]+ GB\n", run.stderr), (
            run.stderr
        )  # seconds, memory
    assert "torchvision" not in run.stderr and "FutureWarning" not in run.stderr
    meta = json.loads(out.with_suffix(".onnx.json").read_text())
    assert meta["made_from"]["folder"] == str(folder.resolve()) and meta["greedy_equal"] is True
    again = _cli("export", str(folder), "--onnx", str(out))  # an existing file is not replaced unasked
    assert again.returncode == 2 and "exists; pass --overwrite" in again.stderr


@pytest.mark.slow
def test_an_interrupted_export_leaves_nothing_under_the_final_names_and_a_retry_is_clean(tmp_path, monkeypatch):
    """The graph and its weights are written into .NAME.partial and moved only once checked: an interrupt during the
    check leaves no .onnx, .data or .json, and gives the partial folder's space back at once; what a SIGKILL leaves
    there (a partial folder with a cut graph) the next export says it found, replaces and finishes. The first
    export's graph is stood in for by two written files (what the file handling sees of it; the retry exports for
    real), sparing a second 30-second torch.export."""
    import normlab.conversion.export.onnx_export as ox

    model, _ = _case("Llama", "dyisru")
    out = tmp_path / "m.onnx"

    def written(net, draft, opset):
        for f in ox.output_files(draft)[:2]:
            f.write_bytes(b"\x08\x07graph")
        return 2

    def killed(*args, **kwargs):
        assert (tmp_path / ".m.onnx.partial" / "m.onnx").is_file()  # interrupted with the files written
        raise KeyboardInterrupt

    monkeypatch.setattr(ox, "_export", written)
    monkeypatch.setattr(ox, "_check", killed)
    with pytest.raises(KeyboardInterrupt):
        export_onnx(model, out)
    assert not any((tmp_path / n).exists() for n in ("m.onnx", "m.onnx.data", "m.onnx.json"))  # nothing under them
    assert not (tmp_path / ".m.onnx.partial").exists()
    monkeypatch.undo()
    (tmp_path / ".m.onnx.partial").mkdir()  # as a SIGKILL mid-write leaves it: no handler runs
    (tmp_path / ".m.onnx.partial" / "m.onnx").write_bytes(b"\x08\x07cut short")
    report = export_onnx(model, out, check=OnnxCheck(id_batches(1, seed=5, t=12)[0]))
    assert report.greedy_equal and not (tmp_path / ".m.onnx.partial").exists()
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == [
        "m.onnx",
        "m.onnx.data",
        "m.onnx.json",
    ]


def test_an_export_whose_last_write_fails_leaves_no_file_under_the_final_names(tmp_path, monkeypatch):
    """issue 99: the .onnx.json was written after the graph and its weights had taken their final names, so a full
    disk at that write left .onnx and .onnx.data without it, and the empty partial folder. Every write happens in
    the partial folder; a failed one leaves nothing under the final names and no partial folder. The graph is stood
    in for by two written files, as in the interrupted export's test."""
    import errno

    import normlab.conversion.export.onnx_export as ox

    model, _ = _case("Llama", "dyisru")

    def written(net, draft, opset):
        for f in ox.output_files(draft)[:2]:
            f.write_bytes(b"\x08\x07graph")
        return 2

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ox, "_export", written)
    monkeypatch.setattr(ox, "_identity", full)
    with pytest.raises(OSError, match="No space left"):
        export_onnx(model, tmp_path / "m.onnx", check=None)
    left = sorted(p.name for p in tmp_path.iterdir() if p.name != ".m.onnx.lock")  # the lock file stays, unheld
    assert left == [], left
    monkeypatch.setattr(ox, "_identity", lambda report, net: {"what": "stand-in"})
    export_onnx(model, tmp_path / "m.onnx", check=None)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == [
        "m.onnx", "m.onnx.data", "m.onnx.json"]  # fmt: skip
    assert not (tmp_path / ".m.onnx.partial").exists()


def test_normlab_export_says_what_is_wrong_in_one_line(tmp_path, capsys, monkeypatch):
    """Each refusal is one line on stderr, exit code 2, no traceback (the command's own main, in this process: the
    subprocess run of the command is test_normlab_export_writes_a_checked_file_from_a_converted_folder's)."""
    from normlab.cli import main

    def run(*argv) -> str:
        assert main(list(argv)) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err
        return err

    (tmp_path / "plain").mkdir()
    plain = ["export", str(tmp_path / "plain"), "--onnx", str(tmp_path / "m.onnx")]
    assert "is not a converted model's folder (no normlab_conversion.json)" in run(*plain)
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "onnxruntime", None)  # as if the onnx extra were not installed
        assert "ONNX export needs onnxruntime: pip install 'normlab[onnx]'" in run(*plain)
    folder = normlab.save_converted(*_case("Mistral", "scaled_dyt", sliding_window=None), tmp_path / "c")
    (tmp_path / "dir.onnx").mkdir()
    bad_targets = ((tmp_path / "dir.onnx", "is a folder; name the .onnx file"), (tmp_path / "m.bin", "end in .onnx"))
    for bad, says in bad_targets:
        assert says in run("export", str(folder), "--onnx", str(bad))


def test_normlab_export_refuses_a_folder_it_cannot_write(tmp_path):
    """issue 85: an ONNX file in a folder that cannot be written (a tmpfs mounted read-only) was found only at the
    lock, after the checks; it is refused with the checks, naming the file, before the model loads."""
    folder = normlab.save_converted(*_case("Llama", "dyt"), tmp_path / "c")
    mount = tmp_path / "ro"
    mount.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,ro", "tmpfs", str(mount)], capture_output=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.decode().strip()})")
    try:
        run = _cli("export", str(folder), "--onnx", str(mount / "m.onnx"))
    finally:
        subprocess.run(["umount", str(mount)], check=False)
    assert run.returncode == 2 and f"the ONNX file {mount / 'm.onnx'}" in run.stderr, run.stderr
    assert "not writable" in run.stderr and "Traceback" not in run.stderr, run.stderr


def test_normlab_export_refuses_a_disk_too_small_before_the_work(tmp_path, tmpfs):
    """issue 85, the re-try: an export to a full disk ran torch.export, then died with a raw OSError traceback at
    the write and left its partial folder holding the space. The disk is checked before the work, from the weights'
    size, and a failed export gives its partial folder back."""
    folder = normlab.save_converted(*_case("Llama", "dyt"), tmp_path / "c")
    mount = tmpfs("300k")
    run = _cli("export", str(folder), "--onnx", str(mount / "m.onnx"))
    assert run.returncode == 2 and f"the ONNX file {mount / 'm.onnx'}: its disk has" in run.stderr, run.stderr
    assert "the export needs about" in run.stderr and "Traceback" not in run.stderr, run.stderr
    assert "export (torch.export" not in run.stderr + run.stdout and not list(mount.iterdir())


@pytest.mark.slow
def test_a_healed_model_with_biases_folds_them_into_its_exported_copy(tmp_path):
    """A heal trains each site's bias; Qwen2's q, k and v projections have one, its MLP's gate and up none. The export
    folds it into both (into its own copy, which transformers never reloads), and the model itself keeps its
    projections as they were."""
    model, _ = _case("Qwen2", "dyisru")
    q_bias = model.model.layers[0].self_attn.q_proj.bias.detach().clone()
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__ == "DyISRU":
                m.bias.uniform_(-0.3, 0.3)
    report = export_onnx(model, tmp_path / "m.onnx", check=OnnxCheck(id_batches(1, seed=5, t=12)[0]))
    assert len(report.folded) == 5 and "bias" not in report.fold_note, report.summary()
    assert report.max_logit_difference <= 1e-5 * report.logit_scale and report.greedy_equal, report.summary()
    assert model.model.layers[0].mlp.gate_proj.bias is None
    assert torch.equal(model.model.layers[0].self_attn.q_proj.bias, q_bias)
