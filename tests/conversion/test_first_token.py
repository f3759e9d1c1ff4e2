"""The first token's own replacement (normlab.conversion.first_token): the data its fit sees, and what that buys on
first tokens the calibration sequences never started with."""

from __future__ import annotations

import copy

import pytest
import torch

import normlab
from conftest import id_batches, tiny_lm
from normlab.conversion import first_token as ft
from normlab.conversion.first_token import FirstRows, first_token_batches

pytest.importorskip("transformers")


def test_first_token_batches_put_each_distinct_calibration_token_first():
    calib = [torch.tensor([[5, 7, 7, 9], [9, 11, 5, 5]]), torch.tensor([[13, 13, 2, 7]])]
    seqs = torch.cat(first_token_batches(calib, max_tokens=100, size=2))
    assert seqs.shape == (6, 2)
    assert sorted(seqs[:, 0].tolist()) == [2, 5, 7, 9, 11, 13]
    capped = torch.cat(first_token_batches(calib, max_tokens=3))
    assert len(capped) == 3 and set(capped[:, 0].tolist()) <= {2, 5, 7, 9, 11, 13}
    assert len(set(capped[:, 0].tolist())) == 3


@pytest.mark.parametrize(
    "batches",
    [
        [torch.randn(2, 4, 8)],  # not token ids (an image or embedding input)
        [torch.arange(8)],  # no batch axis
        [{"input_ids": torch.zeros(2, 4, dtype=torch.long), "attention_mask": torch.ones(2, 4)}],  # more than ids
    ],
)
def test_first_token_batches_are_empty_when_the_batches_are_not_plain_token_ids(batches):
    assert first_token_batches(batches, max_tokens=100) == []


def test_first_rows_are_the_original_models_first_position_for_each_token():
    """A causal model's first position sees only its own token: the rows taken from the two-token sequences equal
    the model's activations at position 0 of a long sequence that starts with that token."""
    model = tiny_lm()
    calib = id_batches(2)
    name = "model.layers.1.input_layernorm"
    rows = FirstRows(model, calib, {name: -1}, max_tokens=4096, sequential=False)
    tokens = torch.cat(rows.firsts)[:, 0]
    x, y = rows(model, name)
    assert x.shape == y.shape == (len(tokens), 32)
    seen = {}
    hook = model.get_submodule(name).register_forward_hook(lambda m, a, o: seen.update(x=a[0], y=o))
    long = torch.cat([tokens[:, None], torch.randint(0, 100, (len(tokens), 9))], 1)
    with torch.no_grad():
        model(long)
    hook.remove()
    torch.testing.assert_close(x, seen["x"][:, 0].float(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(y, seen["y"][:, 0].float(), rtol=1e-4, atol=1e-5)


def _first_position_error(model, converted, tokens) -> float:
    """Relative error of the converted model's logits at position 0, on sequences starting with ``tokens``."""
    seqs = torch.cat([tokens[:, None], torch.randint(0, 100, (len(tokens), 3))], 1)
    with torch.no_grad():
        a, b = model(seqs).logits[:, 0], converted(seqs).logits[:, 0]
    return float((b - a).norm() / a.norm())


def _with_sink(model):
    """Token 0 becomes an attention sink, as the first token of real LLMs is: two huge embedding channels."""
    with torch.no_grad():
        model.model.embed_tokens.weight[0, :2] = 400.0
    return model


def test_first_token_fit_carries_over_to_first_tokens_the_calibration_never_started_with(monkeypatch):
    """Every calibration sequence starts with the sink token 0. Fitted on those first tokens alone (the old way,
    forced here by making the two-token batches unavailable), the first-token copy knows the sink only and is far
    off on a sequence that starts with an ordinary token; fitted on every calibration token put first, it is not."""
    model = _with_sink(tiny_lm())
    calib = [torch.cat([torch.zeros(4, 1, dtype=torch.long), b[:, 1:]], 1) for b in id_batches(3, t=32)]
    ordinary = torch.arange(1, 100)

    def converted():
        net = copy.deepcopy(model)
        record = normlab.convert_norms(net, "dyisru", calibrate=calib, first_token="own", per="channel")
        assert all(s.first_token for s in record.sites)
        return net

    now = _first_position_error(model, converted(), ordinary)
    monkeypatch.setattr(ft, "first_token_batches", lambda batches, max_tokens: [])
    old = _first_position_error(model, converted(), ordinary)
    assert now < 0.25 * old, (now, old)
