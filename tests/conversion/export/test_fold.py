"""normlab.fold: every site's gamma (and beta) moved into the linear layers that read it, checked on a probe."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import normlab
from conftest import sink_batches, tiny_lm, with_sinks
from normlab.conversion.calibrate.massive import MassiveTokens

transformers = pytest.importorskip("transformers")


def _tiny_llama(tied: bool) -> nn.Module:
    return tiny_lm(tie_word_embeddings=tied)


def _converted(tied: bool, massive_tokens: str = "shared"):
    model = with_sinks(_tiny_llama(tied))
    calib = sink_batches(2)
    record = normlab.convert_norms(model, "dyisru", calibrate=calib, massive_tokens=massive_tokens, progress=False)
    g = torch.Generator().manual_seed(1)
    for m in model.modules():  # gammas far from 1, so that a fold that drops one shows
        if isinstance(m, normlab.DyISRU):
            with torch.no_grad():
                m.weight.mul_(torch.rand(m.weight.shape, generator=g) + 0.5)
    return model, record


@pytest.mark.parametrize("tied", [True, False], ids=["tied_head", "untied_head"])
def test_folded_model_gives_the_same_logits_saves_and_loads(tied, tmp_path):
    model, record = _converted(tied)
    x = torch.randint(0, 100, (3, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(x).logits
    report = normlab.fold(model)
    assert len(report.folded) == 5 and not report.skipped  # 2 x (input, post-attention) + the final norm
    assert report.folded["model.layers.0.input_layernorm"] == [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    assert report.folded["model.norm"] == ["lm_head"]
    assert report.untied == (["lm_head"] if tied else [])
    assert model.lm_head.weight is not model.model.embed_tokens.weight and not model.config.tie_word_embeddings
    for m in model.modules():
        if isinstance(m, normlab.DyISRU):
            assert torch.equal(m.weight, torch.ones_like(m.weight))  # a bare f at every site
    with torch.no_grad():
        got = model(x).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    normlab.save_converted(model, record, tmp_path / "out")
    loaded, _ = normlab.load_converted(tmp_path / "out")
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_massive_token_sites_keep_both_copies_exact():
    model, _ = _converted(tied=False, massive_tokens="auto")
    sites = [m for m in model.modules() if isinstance(m, MassiveTokens)]
    assert sites
    for s in sites:  # a massive copy with its own bias, so that (b1 - b) / w is exercised
        with torch.no_grad():
            s.massive.bias.normal_()
            s.main.bias.zero_()  # the readers have no bias: only the massive copy may carry one
    x = sink_batches(1, seed=3, t=10, batch=2)[0]
    with torch.no_grad():
        want = model(x).logits
    report = normlab.fold(model)
    assert not report.skipped
    with torch.no_grad():
        got, step = model(x).logits, model(x[:, :1]).logits  # a single (massive) token
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    assert torch.isfinite(step).all()


class _Reused(nn.Module):
    """A norm whose output goes into a linear layer and also straight into the sum: not foldable."""

    def __init__(self):
        super().__init__()
        self.norm, self.lin = normlab.DyT(8), nn.Linear(8, 8)
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 2.0)

    def forward(self, x):
        y = self.norm(x)
        return self.lin(y) + y


def test_a_site_read_by_more_than_linear_layers_is_refused_and_nothing_changes():
    model = _Reused()
    before = copy.deepcopy(model.state_dict())
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="nothing was changed. Some site's output is read by more than linear"):
        normlab.fold(model, x)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


class _Sliced(nn.Module):
    """A norm read whole by one linear layer, in part (its first 4 channels) by another, and last token only by a
    third."""

    def __init__(self):
        super().__init__()
        self.norm, self.whole, self.part = normlab.DyT(8), nn.Linear(8, 3), nn.Linear(4, 3)
        self.tail = normlab.DyT(3)
        self.last = nn.Linear(3, 2)
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 2.0)
            self.tail.weight.uniform_(0.5, 2.0)

    def forward(self, x):
        y = self.norm(x)
        z = self.tail(self.whole(y) + self.part(y[..., :4]))
        return self.last(z[:, -1:])


def test_a_site_read_in_part_by_a_linear_layer_is_left_with_the_reason():
    """issue 65: a Linear reading a slice of a site's channels raised a raw size mismatch; a reader of some of the
    tokens (the last one) still takes the gamma."""
    model = _Sliced()
    x = torch.randn(2, 5, 8)
    want = model(x)
    report = normlab.fold(model, x)
    why = "part reads part of its channels (a slice), so the gamma cannot move into its columns"
    assert report.skipped == {"norm": why}
    assert report.folded == {"tail": ["last"]}
    torch.testing.assert_close(model(x), want)


def test_a_site_with_a_bias_and_a_bias_free_reader_is_left_with_the_reason():
    model = nn.Sequential(normlab.DyT(8), nn.Linear(8, 4, bias=False), normlab.DyT(4, bias=False), nn.Linear(4, 2))
    with torch.no_grad():
        model[0].bias.fill_(0.3)
    x = torch.randn(5, 8)
    want = model(x)
    report = normlab.fold(model, x)
    assert report.skipped == {"0": "a nonzero bias, and a reader without one (fold(..., add_biases=True) gives it one)"}
    assert report.folded == {"2": ["3"]}
    torch.testing.assert_close(model(x), want)


def test_add_biases_folds_a_bias_into_a_bias_free_reader_and_an_undo_removes_it():
    """For an export (normlab.export_onnx folds its own copy): the reader gets a bias W b, the site is bare."""
    model = nn.Sequential(normlab.DyT(8), nn.Linear(8, 4, bias=False))
    with torch.no_grad():
        model[0].bias.uniform_(-0.5, 0.5)
        model[0].weight.uniform_(0.5, 2.0)
    x = torch.randn(5, 8)
    want = model(x)
    report = normlab.fold(model, x, add_biases=True)
    assert report.folded == {"0": ["1"]} and model[1].bias is not None
    assert torch.all(model[0].bias == 0) and torch.all(model[0].weight == 1)
    torch.testing.assert_close(model(x), want)

    class Reused(nn.Module):  # the site also feeds the output directly: the fold's check fails and undoes all
        def __init__(self):
            super().__init__()
            self.norm, self.lin = normlab.DyT(8), nn.Linear(8, 8, bias=False)
            with torch.no_grad():
                self.norm.bias.fill_(0.3)

        def forward(self, x):
            y = self.norm(x)
            return self.lin(y) + y

    reused = Reused()
    with pytest.raises(ValueError, match="nothing was changed"):
        normlab.fold(reused, x, add_biases=True)
    assert reused.lin.bias is None and torch.all(reused.norm.bias == 0.3)


def test_fold_needs_a_probe_or_a_vocabulary_and_a_site():
    with pytest.raises(ValueError, match="pass probe="):
        normlab.fold(nn.Sequential(normlab.DyT(8), nn.Linear(8, 2)))
    with pytest.raises(ValueError, match="no normlab norm sites"):
        normlab.fold(nn.Sequential(nn.Linear(8, 2)), torch.randn(1, 8))


def test_a_bf16_fold_undone_by_rounding_says_so_and_how_to_fold():
    """issue 50: on a bf16 model the fold blamed a non-linear reader, where bf16 rounding moved the logits. Run in a
    process of its own with oneDNN below AMX (a bf16 matmul with AMX dies with SIGILL on this VM)."""
    import os
    import subprocess
    import sys

    code = """
import torch, normlab
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 64), normlab.DyT(64, kernel="reference"), nn.Linear(64, 64))
with torch.no_grad():
    model[1].weight.uniform_(0.3, 3.0)
model = model.to(torch.bfloat16)
try:
    normlab.fold(model, torch.randn(8, 64, dtype=torch.bfloat16))
    print("FOLDED")
except ValueError as e:
    print(e)
"""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "The model is torch.bfloat16" in run.stdout and "fold a float32 copy (model.float())" in run.stdout, (
        run.stdout
    )
