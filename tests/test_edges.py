"""Issue 29: right answers at the edges and clear errors everywhere, outside the kernels (whose edge rows are in
test_kernels_cpu.py). Each defect's test failed on 111695b; each message class has a test that a bad value gives
one line naming the file (or flag) and the field, exit 2, before any work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import normlab
from normlab.cli import main

transformers = pytest.importorskip("transformers")

CALIB = "The quick brown fox jumps over the lazy dog. " * 200


def _tiny(cls_name: str, path: Path) -> Path:
    torch.manual_seed(0)
    kw = dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2)  # fmt: skip
    if cls_name == "Gemma":
        kw["head_dim"] = 8
    cfg = getattr(transformers, f"{cls_name}Config")(**kw)
    getattr(transformers, f"{cls_name}ForCausalLM")(cfg).eval().save_pretrained(path)
    return path


# ------------------------------------------------------------------ defect 4: a converted ViT reloads
@pytest.mark.parametrize("head", ["ViTModel", "ViTForImageClassification"])
@pytest.mark.parametrize("target", ["dyt", "dyisru"])
def test_defect_4_a_converted_vit_saved_by_transformers_reloads_exactly(tmp_path, head, target):
    """transformers' save_pretrained writes ViT's legacy key names (encoder.layer.N); load_converted read the raw
    file into a fresh model and failed with 'weights do not match' for every ViT and every target."""
    cfg = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                 image_size=16, patch_size=4, num_labels=3)  # fmt: skip
    torch.manual_seed(0)
    model = getattr(transformers, head)(cfg).eval()
    rec = normlab.convert_norms(model, target, calibrate=[torch.randn(4, 3, 16, 16)])
    normlab.save_converted(model, rec, tmp_path / "out")
    loaded, rec2 = normlab.load_converted(tmp_path / "out")
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        a, b = model(x), loaded(x)
    key = "logits" if head.endswith("Classification") else "last_hidden_state"
    torch.testing.assert_close(getattr(b, key), getattr(a, key), rtol=0, atol=0)
    assert rec2.target == target


# ------------------------------------------------------------------ defect 5: --out DIR/ with a trailing slash
def test_defect_5_a_trailing_slash_keeps_the_heal_checkpoint_beside_the_output(tmp_path, capsys):
    """`--out DIR/` put the heal checkpoint inside the output (DIR/.heal.pt) and left `..heal.pt.lock` in the saved
    model. The checkpoint is DIR.heal.pt for DIR and DIR/ alike, and nothing of it is inside DIR."""
    model = _tiny("Llama", tmp_path / "m")
    text = tmp_path / "calib.txt"
    text.write_text(CALIB)
    out = str(tmp_path / "o") + "/"
    rc = main(["convert", "--model", str(model), "--calibrate", str(text), "--seq-len", "16", "--sequences", "4",
               "--no-progress", "--heal-tokens", "200", "--out", out])  # fmt: skip
    assert rc == 0, capsys.readouterr().err
    inside = sorted(p.name for p in (tmp_path / "o").iterdir())
    assert not [n for n in inside if "heal" in n and n != "heal_curve.csv" and n != "heal_curve.png"], inside
    assert (tmp_path / ".o.heal.pt.lock").is_file()  # the checkpoint's owner, beside the output (the heal ended)
    normlab.load_converted(tmp_path / "o")


def test_defect_5_a_checkpoint_inside_an_output_to_be_made_is_refused(tmp_path, capsys):
    model = _tiny("Llama", tmp_path / "m")
    text = tmp_path / "calib.txt"
    text.write_text(CALIB)
    rc = main(["convert", "--model", str(model), "--calibrate", str(text), "--heal-tokens", "200", "--out",
               str(tmp_path / "o"), "--checkpoint", str(tmp_path / "o" / "ck.pt")])  # fmt: skip
    assert rc == 2 and "inside an input or the output" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------ defect 6: folders saved without a tokenizer
@pytest.mark.parametrize("family", ["Qwen2", "Qwen3", "Gemma", "Llama"])
def test_defect_6_a_folder_without_tokenizer_files_falls_back_to_byte_ids(tmp_path, family):
    """transformers builds an empty tokenizer (no ids for any text) for Qwen2, Qwen3 and Gemma folders saved without
    tokenizer files, where Llama raises; the text then became 0-1 tokens and the error blamed the text."""
    from normlab.conversion.hf import load_model, token_chunks

    model, tokenizer = load_model(_tiny(family, tmp_path / "m"))
    assert tokenizer is None
    assert token_chunks(CALIB, tokenizer, 100, 16).shape[0] > 10


# ------------------------------------------------------------------ defect 7: names that become paths
@pytest.mark.parametrize("name", ["../../escape", "a/b", "..", ".", "", "a\\b"])
def test_defect_7_an_experiment_name_cannot_leave_its_root(tmp_path, name):
    """`name = "../../escape"` in a TOML made `normlab report` write escape_loss.png two levels above the root."""
    from normlab.sweep import load_experiment

    toml = tmp_path / "e.toml"
    toml.write_text(f'name = {json.dumps(name)}\n[[runs]]\nname = "a"\nset = {{}}\n')
    with pytest.raises(ValueError, match=r"e\.toml: name must be one path segment"):
        load_experiment(str(toml))


def test_defect_7_a_report_refuses_an_index_whose_name_escapes(tmp_path):
    from normlab.errors import NormlabError
    from normlab.report import write_report

    root = tmp_path / "r"
    root.mkdir()
    exp = {"name": "../../escape", "title": "t", "source": "", "claim": "", "runs": [], "figures": ["loss"]}
    (root / "index.json").write_text(json.dumps({"profile": "tiny", "experiments": [exp]}))
    with pytest.raises(NormlabError, match=r"index\.json: experiment name '\.\./\.\./escape' must be one path segment"):
        write_report(root)
    assert not list(tmp_path.rglob("escape*"))


# ------------------------------------------------------------------ the kernel build: the fix that applies
def _build_in_child(env: dict) -> str:
    """Build and load the CPU kernels in a fresh process with ``env``; what it printed (the warning included)."""
    import os
    import subprocess
    import sys

    code = ("import warnings; warnings.simplefilter('always')\n"
            "from normlab.kernels import cpu_build\n"
            "ok = cpu_build.load(wait=True)\nprint('LOADED' if ok else 'FAILED', cpu_build.failure())")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    return proc.stdout + proc.stderr


def test_a_cache_that_cannot_be_written_says_so_not_install_a_compiler():
    out = _build_in_child({"NORMLAB_CACHE": "/proc/normlab-cache"})  # /proc: no folder can be made there
    assert "FAILED" in out and "/proc/normlab-cache" in out and "set NORMLAB_CACHE to a folder you can write" in out
    assert "install a C++ compiler" not in out


def test_a_cache_naming_a_file_says_so(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    out = _build_in_child({"NORMLAB_CACHE": str(f)})
    assert "FAILED" in out and "is a file, not a folder" in out and "install a C++ compiler" not in out


def test_an_empty_cache_variable_is_unset(monkeypatch):
    from normlab.corpus import cache_dir

    monkeypatch.setenv("NORMLAB_CACHE", "")
    assert cache_dir() == Path.home() / ".cache" / "normlab"


@pytest.mark.parametrize("cxx", ["/bin/false", "/bin/echo"])
def test_a_cxx_that_is_not_a_compiler_is_named(tmp_path, cxx):
    out = _build_in_child({"CXX": cxx, "NORMLAB_CACHE": str(tmp_path / "cache")})
    assert "FAILED" in out and f"CXX={cxx}" in out and "Traceback" not in out


def test_a_library_built_here_loads_after_the_compiler_is_gone(tmp_path):
    """The cache key needs `$CXX --version`; with the compiler gone, a library this machine built for this source,
    torch and CPU is still found and loaded (it was ignored, and every norm fell back to the reference)."""
    cache = tmp_path / "cache"
    assert "LOADED" in _build_in_child({"NORMLAB_CACHE": str(cache)})  # built once, with the compiler
    out = _build_in_child({"NORMLAB_CACHE": str(cache), "CXX": str(tmp_path / "gone-c++")})
    assert "LOADED" in out, out


# ------------------------------------------------------------------ fuzz: each field of a file given a wrong kind
_TOML = {"name": "fz", "title": "t", "source": "s", "claim": "c", "seeds": [0], "metrics": ["final_val_loss"],
         "base": {"set": {}}, "baseline": "a", "figures": ["loss"], "guard": True, "mechanism": ["a"],
         "profiles": ["tiny"]}  # fmt: skip
_WRONG = [5, "x", [1, 2], {"k": 1}, True, 1.5]


def value(v) -> str:
    """A value as TOML."""
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{json.dumps(k)} = {value(x)}" for k, x in v.items()) + " }"
    if isinstance(v, list):
        return "[" + ", ".join(value(x) for x in v) + "]"
    return json.dumps(v) if not isinstance(v, bool) else str(v).lower()


def _toml_text(top: dict, run: dict) -> str:
    lines = [f"{k} = {value(v)}" for k, v in top.items()]
    return "\n".join(lines) + "\n[[runs]]\n" + "\n".join(f"{k} = {value(v)}" for k, v in run.items()) + "\n"


def _kind_ok(field: str, v) -> bool:
    """Whether ``v`` happens to be a valid value of ``field`` (then it is not a wrong kind for it)."""
    from normlab.sweep import _RUN, _TOP, _is

    kind = {**_TOP, **_RUN}.get(field)
    return kind is not None and _is(v, kind)


@pytest.mark.parametrize("field", [*_TOML, "runs"])
def test_fuzz_every_toml_field_of_the_wrong_kind_is_one_line_naming_file_and_field(tmp_path, capsys, field):
    run = {"name": "a", "set": {"model.norm": "rms_norm"}}
    tried = 0
    for wrong in _WRONG:
        if _kind_ok(field, wrong) or field in ("name",) and isinstance(wrong, str):
            continue
        top = {**_TOML, field: wrong}
        path = tmp_path / f"e{tried}.toml"
        text = _toml_text(top, run) if field != "runs" else _toml_text(_TOML, run).split("[[runs]]")[0] + (
            f"runs = {value(wrong)}\n")  # fmt: skip
        path.write_text(text)
        rc = main(["sweep", str(path), "--profile", "tiny", "--root", str(tmp_path / "root"), "--no-progress"])
        err = capsys.readouterr().err.strip()
        assert rc == 2, (field, wrong, err)
        assert len(err.splitlines()) == 1 and str(path) in err and field in err, (field, wrong, err)
        assert "Traceback" not in err
        tried += 1
    assert tried >= 3
    assert not (tmp_path / "root" / "runs").exists()  # nothing trained


@pytest.mark.parametrize("field", ["name", "label", "set", "shape", "profiles", "budget", "lrs", "lr_field"])
def test_fuzz_every_run_field_of_the_wrong_kind(tmp_path, capsys, field):
    tried = 0
    for wrong in _WRONG:
        if _kind_ok(field, wrong):
            continue
        path = tmp_path / f"r{tried}.toml"
        path.write_text(_toml_text({"name": "fz"}, {"name": "a", "set": {}, field: wrong}))
        rc = main(["sweep", str(path), "--profile", "tiny", "--root", str(tmp_path / "root"), "--no-progress"])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and len(err.splitlines()) == 1 and str(path) in err and field in err, (field, wrong, err)
        tried += 1
    assert tried >= 3


def _report_root(tmp_path) -> tuple[Path, Path]:
    """A sweep root with one finished tiny run (trained for real)."""
    from normlab.sweep import expand, load_experiment, run_sweep, write_index

    toml = tmp_path / "one.toml"
    toml.write_text('name = "one"\nseeds = [0]\n[[runs]]\nname = "a"\nset = { "model.norm" = "rms_norm", '
                    '"steps" = 4, "eval_every" = 2, "metrics_every" = 2 }\n')  # fmt: skip
    exp = load_experiment(str(toml))
    root = tmp_path / "root"
    specs = expand(exp, "tiny", root)
    write_index([exp], "tiny", root)
    run_sweep(specs, progress=False)
    return root, Path(specs[0].config.out)


@pytest.mark.slow
def test_fuzz_every_summary_and_metrics_field_the_report_reads(tmp_path, capsys):
    from normlab.report.results import ROW_FIELDS, SUMMARY_FIELDS

    root, run = _report_root(tmp_path)
    summary = json.loads((run / "summary.json").read_text())
    metrics = (run / "metrics.jsonl").read_text()
    assert main(["report", "--root", str(root)]) == 0
    capsys.readouterr()
    for field, kinds in SUMMARY_FIELDS.items():
        for wrong in ("junk", [1], {"a": 1}):
            if isinstance(wrong, kinds):
                continue
            (run / "summary.json").write_text(json.dumps({**summary, field: wrong}))
            rc = main(["report", "--root", str(root)])
            err = capsys.readouterr().err.strip()
            assert rc == 2 and len(err.splitlines()) == 1, (field, wrong, err)
            assert "summary.json" in err and field in err, err
    (run / "summary.json").write_text(json.dumps(summary))
    rows = [json.loads(line) for line in metrics.splitlines()]
    for field in ROW_FIELDS:
        at = next(i for i, r in enumerate(rows) if field in r)
        bad = [dict(r) for r in rows]
        bad[at][field] = "junk"
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in bad))
        rc = main(["report", "--root", str(root)])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and "metrics.jsonl" in err and field in err, (field, err)
    (run / "metrics.jsonl").write_text("[1, 2]\nnot json\n42\n" + metrics)  # junk lines: skipped
    assert main(["report", "--root", str(root)]) == 0


def _saved_conversion(tmp_path) -> Path:
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2)).eval()  # fmt: skip
    rec = normlab.convert_norms(model, "dyt")
    return normlab.save_converted(model, rec, tmp_path / "conv")


def test_fuzz_every_conversion_record_field(tmp_path):
    from normlab.conversion.record import _RECORD_FIELDS, _SITE_FIELDS
    from normlab.conversion.saving import RECORD_FILE

    folder = _saved_conversion(tmp_path)
    good = json.loads((folder / RECORD_FILE).read_text())
    normlab.load_converted(folder)
    cases = [({**good, k: w}, k) for k in _RECORD_FIELDS for w in ("junk", 5, {"a": 1})]  # "junk": no such norm
    site0 = good["sites"][0]
    cases += [({**good, "sites": [{**site0, k: w}, *good["sites"][1:]]}, f"sites[0].{k}") for k in _SITE_FIELDS
              for w in ("junk", [1], {"a": 1}) if not isinstance(w, _SITE_FIELDS[k][0])]  # fmt: skip
    cases += [({**good, "sites": [{k: v for k, v in site0.items() if k != "dim"}]}, "sites[0].dim"),
              ({**good, "sites": [{**site0, "extra": 1}]}, "sites[0].extra")]  # fmt: skip
    for d, field in cases:
        (folder / RECORD_FILE).write_text(json.dumps(d))
        with pytest.raises(ValueError) as e:
            normlab.load_converted(folder)
        msg = str(e.value)
        assert RECORD_FILE in msg and field in msg and "\n" not in msg, (field, msg)


def test_load_converted_refuses_edited_and_foreign_folders(tmp_path):
    from safetensors.torch import load_file, save_file

    from normlab.conversion.saving import RECORD_FILE

    folder = _saved_conversion(tmp_path)
    good = json.loads((folder / RECORD_FILE).read_text())
    weights = folder / "model.safetensors"
    state = load_file(weights)
    # another converted model of the same shape: its weights used to load silently
    torch.manual_seed(1)
    other = _saved_conversion(tmp_path / "b")
    (folder / "model.safetensors").write_bytes((other / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match="is not the file normlab_conversion.json was saved with"):
        normlab.load_converted(folder)
    unchecked = {k: v for k, v in good.items() if k != "weights_sha256"}  # a record from before the field
    (folder / RECORD_FILE).write_text(json.dumps(unchecked))
    for edit, match in (
        (lambda s: {k: v for k, v in s.items() if not k.endswith("layers.0.input_layernorm.alpha")}, "missing"),
        (lambda s: {**s, "extra.weight": torch.zeros(1)}, "unexpected"),
        (lambda s: {**s, "model.norm.weight": torch.zeros(7)}, r"model\.norm\.weight has shape \(7,\)"),
    ):
        save_file(edit(state), str(weights))
        with pytest.raises(ValueError, match=match):
            normlab.load_converted(folder)
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError, match="damaged or truncated"):
        normlab.load_converted(folder)
    (folder / RECORD_FILE).write_text(json.dumps({**unchecked, "model_class": "NoSuchModel"}))
    save_file(state, str(weights))
    with pytest.raises(ValueError, match="model_class 'NoSuchModel' is not a transformers model class"):
        normlab.load_converted(folder)


# ------------------------------------------------------------------ checks before the work; sizes; misleading successes
@pytest.mark.parametrize("args,match", [
    (["--to", "layer_norm"], r"--to layer_norm: calibration fits .* pass --no-calibrate"),
    (["--init", "beta_init=-1"], r"--init beta_init=-1: .*beta"),
])  # fmt: skip
def test_convert_flags_are_checked_before_the_model_loads(tmp_path, capsys, args, match):
    import re

    out = tmp_path / "o"
    rc = main(["convert", "--model", str(tmp_path / "missing-model"), "--out", str(out), *args])
    err = capsys.readouterr().err
    assert rc == 2 and re.search(match, err), err  # the flag, before the model (which does not even exist)
    assert not out.exists()


def test_a_bogus_kernel_variable_leaves_no_output(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("NORMLAB_KERNEL", "bogus")
    model = _tiny("Llama", tmp_path / "m")
    out = tmp_path / "o"
    rc = main(["convert", "--model", str(model), "--out", str(out), "--no-calibrate", "--to", "dyt"])
    assert rc == 2 and "NORMLAB_KERNEL='bogus'" in capsys.readouterr().err
    assert not out.exists() and not list(tmp_path.glob(".o.lock"))


@pytest.mark.parametrize("argv", [["predict", "--set", "model.width=100000"], ["gain", "--samples", "100000000"],
                                  ["train", "--preset", "tiny", "--set", "model.width=60000", "model.heads=1"]])
def test_sizes_that_exhaust_memory_are_refused_up_front(tmp_path, capsys, argv, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "GiB" in err and "more than this machine's" in err, err
    assert not (tmp_path / "runs").exists()


def test_rms_ema_is_read_as_training_sets_it():
    """predict and jacobian read rms_ema at the running mean training sets from its first batch (they read the
    placeholder 1.0); match_rms no longer moves it (its forwards ran in train mode)."""
    from normlab.lab import GPT, GPTConfig
    from normlab.lab.phase import predict
    from normlab.theory.jacobian import jacobian_table

    rows = {r["norm"]: r for r in jacobian_table(["rms_norm", "rms_ema"], [64], std=0.02, tokens=2)}
    assert rows["rms_ema"]["total"] == pytest.approx(rows["rms_norm"]["total"], rel=0.2)  # was ~0.02 of it
    cfg = GPTConfig(width=32, depth=1, heads=2, context=16, norm="rms_ema", norm_final="dyt", norm_init="match_rms")
    p = predict(cfg)
    assert p["rms_out"] == pytest.approx(1.0, rel=0.05)  # normalised as in training, not by the placeholder
    torch.manual_seed(0)
    model = GPT(cfg).train()
    idx = torch.randint(256, (2, 16))
    model(idx)  # the first training forward sets the running means
    before = {n: float(m.running_ms) for n, m in model.named_modules() if hasattr(m, "running_ms")}
    model.match_rms_(idx)
    after = {n: float(m.running_ms) for n, m in model.named_modules() if hasattr(m, "running_ms")}
    assert before == after and model.training


@pytest.mark.parametrize("setting,match", [
    (["model.norm_init=match_rms"], "match_rms' scales the gamma of point-wise norms; no site"),
    (["model.alpha_table=dyt_paper"], "alpha_table sets alpha_init, which no norm"),
    (["model.norm=dyt", "model.alpha_table=dyt_paper@"], "names no width after '@'"),
])  # fmt: skip
def test_knobs_that_would_be_ignored_are_refused(tmp_path, capsys, setting, match):
    out = tmp_path / "r"
    assert main(["train", "--preset", "tiny", "--out", str(out), "--set", *setting]) == 2
    assert match in capsys.readouterr().err and not out.exists()


def test_random_bytes_as_calibration_text_warn():
    from normlab.conversion.hf import check_text

    with pytest.warns(UserWarning, match="are not text"):
        check_text(bytes(range(256)).decode("latin-1") * 50, "noise.bin")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_text(CALIB, "calib.txt")


def test_a_fit_that_overflows_says_so():
    import numpy as np

    from normlab.theory.fit import fit_elementwise

    x = np.array([1e200, -1e200, 3e199, 1.0])
    res = fit_elementwise(x, np.tanh(x), "dyisru")
    assert not res.converged
    assert "overflow" in res.message and "no positive slope" not in res.message


# ------------------------------------------------------------------ the papers cited as papers
def test_no_source_document_numbers_are_left():
    """A user who clones normlab has no `shared/seeds` folder: the papers are cited by name (README, References),
    never as "seed 000".."seed 004" or by that folder, in the README, docs, sources, scripts or experiment TOMLs."""
    import re

    repo = Path(__file__).resolve().parents[1]
    files = [repo / "README.md", *(repo / "docs").rglob("*.md"), *(repo / "docs").rglob("*.toml"),
             *(repo / "src").rglob("*.py"), *(repo / "src").rglob("*.toml"),
             *(repo / "scripts").rglob("*.py")]  # fmt: skip
    pattern = re.compile(r"\bseeds? 00[0-4]\b|shared/seeds", re.IGNORECASE)
    hits = [f"{f.relative_to(repo)}:{i}" for f in files for i, line in enumerate(f.read_text().splitlines(), 1)
            if pattern.search(line)]  # fmt: skip
    assert not hits, hits[:10]
    assert "## References" in (repo / "README.md").read_text()
