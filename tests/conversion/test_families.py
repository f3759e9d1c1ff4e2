"""Families beyond Llama's, from tiny configs (issue 100): Olmo's and Cohere's LayerNorms were unknown classes, so
`normlab convert` refused both with a hint naming an option the command line does not have, and the library's hint
offered 'rms_norm' first for norms that subtract the mean."""

from __future__ import annotations

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
        r"'layer_norm'\} \(the command line converts the known classes only\)",
    ):
        normlab.convert_norms(model, "dyt")
    from normlab.sites import guess_kind

    assert guess_kind("FooRMSNorm") == "rms_norm" and guess_kind("OlmoLayerNorm") == "layer_norm"
    assert guess_kind("RMSLayerNorm") == "rms_norm" and guess_kind("MyNorm") == "rms_norm"
