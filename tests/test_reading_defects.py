"""Defects found by reading the code (issue 18), each with a test that fails on the code before the fix."""

from __future__ import annotations

import csv
import math

import pytest
import torch

import normlab
import normlab.kernels as K
from normlab._table import append_csv
from normlab.lab import GPTConfig, resolve_config, train
from normlab.lab.runs import read_summary


# 1: a base class's keyword counts only when **kwargs reaches it
def test_a_keyword_the_class_does_not_pass_on_is_refused_clearly():
    assert "bias" not in normlab.registry.init_kwargs("rms_norm")  # RMSNorm.__init__ has no **kwargs
    with pytest.raises(TypeError, match="norm 'rms_norm' does not take bias"):
        normlab.create_norm("rms_norm", 64, bias=False)
    assert "bias" in normlab.registry.init_kwargs("dyt")  # DyT passes **kwargs on to the family's bias
    cfg = GPTConfig(norm="dyt", norm_final="rms_norm", norm_final_kwargs={"bias": False})
    with pytest.raises(ValueError, match="model.norm_final_kwargs: norm 'rms_norm' does not take bias"):
        cfg.validate()


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


# 3: a CSV whose columns change gets a new header
def test_append_csv_with_new_columns_rewrites_the_header(tmp_path):
    path = tmp_path / "bench.csv"
    append_csv(path, [{"a": 1, "b": 2}])
    append_csv(path, [{"a": 3, "b": 4, "c": 5}])
    append_csv(path, [{"a": 6, "b": 7, "c": 8}])
    rows = list(csv.reader(path.open()))
    assert rows[0] == ["a", "b", "c"] and all(len(r) == 3 for r in rows)
    assert rows[1] == ["1", "2", ""] and rows[3] == ["6", "7", "8"]


def test_the_shipped_lab_csv_has_one_width():
    from pathlib import Path

    rows = list(csv.reader((Path(__file__).parents[1] / "bench" / "lab.csv").open()))
    assert len({len(r) for r in rows}) == 1


# 4: the fits evaluate the functional forms
def test_fit_model_is_the_functional_form():
    import normlab.functional as FN
    from normlab.theory.fit import fit_elementwise

    x = torch.linspace(-3, 3, 101, dtype=torch.float64)
    y = 2.0 * FN.dyt(x, torch.tensor(0.7, dtype=torch.float64))
    res = fit_elementwise(x.numpy(), y.numpy(), "dyt", scale=2.0)
    assert float(res.param) == pytest.approx(0.7, rel=1e-8)


# 6: a diverged run reads as diverged
def test_a_diverged_runs_final_train_loss_stays_nan(corpus_file, tmp_path):
    cfg = resolve_config("tiny", ["lr=1e6", "grad_clip=0", "warmup=0", "steps=40", "log_every=1"], data=[corpus_file],
                         out=str(tmp_path / "run"), norm="layer_scale")  # fmt: skip
    summary = train(cfg, progress=False)
    assert summary["status"] == "diverged"
    assert math.isnan(summary["final_train_loss"])
    assert math.isnan(read_summary(tmp_path / "run")["final_train_loss"])


# 7: only normlab's own errors are the user's fault
def test_an_internal_runtime_error_keeps_its_traceback(monkeypatch, capsys):
    from normlab import cli
    from normlab.errors import NormlabError

    def boom(args):
        raise RuntimeError("CUDA out of memory (a fault, not bad input)")

    monkeypatch.setattr(cli, "_cmd_demo", boom)
    with pytest.raises(RuntimeError, match="out of memory"):
        cli.main(["demo"])

    def ours(args):
        raise NormlabError("the folder is locked by pid 1")

    monkeypatch.setattr(cli, "_cmd_demo", ours)
    assert cli.main(["demo"]) == 2
    assert "the folder is locked by pid 1" in capsys.readouterr().err


# 8: --max-batches counted sequences; the flag says so now
def test_convert_names_the_number_of_sequences(capsys):
    from normlab.cli import build_parser

    args = build_parser().parse_args(["convert", "--model", "m", "--to", "dyt", "--out", "o", "--sequences", "8"])
    assert args.sequences == 8
    with pytest.raises(SystemExit):
        build_parser().parse_args(["convert", "--model", "m", "--to", "dyt", "--out", "o", "--max-batches", "8"])
