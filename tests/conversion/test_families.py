"""Families beyond Llama's, from tiny configs (issue 100): Olmo's and Cohere's LayerNorms were unknown classes, so
`normlab convert` refused both with a hint naming an option the command line does not have, and the library's hint
offered 'rms_norm' first for norms that subtract the mean."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import normlab
from conftest import CALIB
from normlab.cli import main

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("family, sites", [("Olmo", 3), ("Cohere", 2)])
def test_olmo_and_cohere_convert_from_the_command_line(family, sites, tmp_path, capsys):
    torch.manual_seed(0)
    shape = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2
    )
    cfg = getattr(transformers, f"{family}Config")(vocab_size=100, **shape)
    getattr(transformers, f"{family}ForCausalLM")(cfg).eval().save_pretrained(tmp_path / "m")
    (tmp_path / "calib.txt").write_text(CALIB)
    argv = ["convert", "--model", str(tmp_path / "m"), "--calibrate", str(tmp_path / "calib.txt"), "--to", "dyisru",
            "--no-progress", "--out", str(tmp_path / "o")]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    model, record = normlab.load_converted(tmp_path / "o")
    assert len(record.sites) == sites and {s.source for s in record.sites} == {f"{family}LayerNorm"}
    assert all(s.eps == 1e-5 for s in record.sites)  # Olmo's is written into its forward, not kept as an attribute


class MyLayerNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return nn.functional.layer_norm(x, x.shape[-1:], self.weight)


def test_an_unknown_norm_class_is_named_with_the_kind_its_name_suggests():
    model = nn.Sequential(nn.Linear(8, 8), MyLayerNorm(8))
    with pytest.raises(ValueError, match=r"extra_classes=\{MyLayerNorm: 'layer_norm'\}"):
        normlab.replace_norms(model, "dyt")
    with pytest.raises(
        ValueError,
        match=r"its MyLayerNorm is not one: from Python, pass extra_classes=\{MyLayerNorm: "
        r"'layer_norm'\}; on the command line, --extra-class MODULE:MyLayerNorm=layer_norm",
    ):
        normlab.convert_norms(model, "dyt")
    from normlab.sites import guess_kind

    assert guess_kind("FooRMSNorm") == "rms_norm" and guess_kind("OlmoLayerNorm") == "layer_norm"
    assert guess_kind("RMSLayerNorm") == "rms_norm" and guess_kind("MyNorm") == "rms_norm"


def test_llama4_s_weightless_qk_norm_gets_one_answer_from_both_doors():
    """issue 100: `replace_norms` raised on Llama 4's weightless q/k norm (a class it did not know) while
    `convert_norms` skipped it as unknown; it is a known RMSNorm now, and both doors leave it, saying why (no weight,
    so no width), and convert every other norm."""
    sizes = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 128, "intermediate_size_mlp": 128}
    cfg = transformers.Llama4TextConfig(**sizes, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        head_dim=16, num_local_experts=1, use_qk_norm=True)  # fmt: skip
    answers = []
    for door in (lambda m: normlab.replace_norms(m, "dyt"), lambda m: normlab.convert_norms(m, "dyt", progress=False)):
        torch.manual_seed(0)
        model = transformers.Llama4ForCausalLM(cfg).eval()
        record = door(model)
        assert len(record.sites) == 5  # 2 blocks x 2 norms + the final one
        answers.append(record.skipped)
        assert torch.isfinite(model(torch.randint(0, 100, (1, 8))).logits).all()
    assert answers[0] == answers[1] and [s["class"] for s in answers[0]] == ["Llama4TextWeightlessRMSNorm"] * 2
    assert answers[0][0]["reason"] == "its channel count is unknown: no normalized_shape and no 1-d weight"


def test_the_command_line_converts_a_norm_class_normlab_does_not_know(models, tmp_path, capsys):
    """issue 100: a model whose norms are of a class normlab does not know (here Llama's, renamed LlamaScaleNorm for
    the test) was told of `extra_classes=`, an option the command line did not have. `--extra-class
    MODULE:CLASS=KIND` converts it, the budget walk's path included; a bad entry is one line before any work."""
    from transformers.models.llama import modeling_llama

    cls = modeling_llama.LlamaRMSNorm
    cls.__name__ = "LlamaScaleNorm"  # neither a known class nor an *RMSNorm
    try:
        _convert_unknown_class(models, tmp_path, capsys)
    finally:
        cls.__name__ = "LlamaRMSNorm"


def _convert_unknown_class(models, tmp_path, capsys):
    from conftest import convert_argv

    entry = "transformers.models.llama.modeling_llama:LlamaRMSNorm=rms_norm"
    assert main(convert_argv(models["m"], models["text"], "--out", tmp_path / "no")) == 2
    assert "--extra-class MODULE:LlamaScaleNorm=rms_norm" in capsys.readouterr().err
    for extra, out in (([], "all"), (["--budget-nats", "1"], "walk")):
        argv = convert_argv(models["m"], models["text"], "--extra-class", entry, *extra, "--out", tmp_path / out)
        assert main(argv) == 0, capsys.readouterr().err
        record = json.loads((tmp_path / out / "normlab_conversion.json").read_text())
        assert record["sites"] and all(s["source"] == "LlamaScaleNorm" for s in record["sites"])
        assert json.loads((tmp_path / out / "convert_config.json").read_text())["extra_classes"] == [entry]
    for bad, says in (("no_colon=rms_norm", "give module:Class=kind"),
                      ("transformers.models.llama.modeling_llama:LlamaRMSNorm=batch_norm", "the kind must be one of"),
                      ("no.such.module:X=rms_norm", "cannot import X from no.such.module")):  # fmt: skip
        assert main(convert_argv(models["m"], models["text"], "--extra-class", bad, "--out", tmp_path / "x")) == 2
        assert f"--extra-class {bad!r}: {says}" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
