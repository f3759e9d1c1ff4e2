"""Running batches through a model (normlab.conversion.batches): the inputs follow the model to its device, which
is how every stage of a conversion runs where the model is (``normlab convert --device``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from normlab.conversion.batches import model_device, run_batch


def test_a_batch_goes_to_the_models_device():
    """A model on another device than its batches (here "meta", the one other device a CPU has) gets them there;
    without the move, the same call fails."""
    model = nn.Linear(4, 3, device="meta")
    x = torch.randn(2, 4)
    with pytest.raises((RuntimeError, NotImplementedError)):
        model(x)  # what run_batch spares every caller
    assert model_device(model).type == "meta"
    assert run_batch(model, x).device.type == "meta"
    assert run_batch(model, (x, torch.zeros(2))).device.type == "meta"  # an (inputs, targets) tuple from a loader

    class Kw(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 3, device="meta")

        def forward(self, input_ids, scale=1.0):
            return self.lin(input_ids) * scale

    assert run_batch(Kw(), {"input_ids": x, "scale": 2.0}).device.type == "meta"  # a dict: tensors moved, the rest kept


def test_a_model_without_parameters_keeps_its_batches_where_they_are():
    assert model_device(nn.ReLU()) is None
    x = torch.randn(2, 4)
    assert torch.equal(run_batch(nn.ReLU(), x), x.relu())


def test_a_token_id_outside_the_vocabulary_is_named_with_the_vocabulary():
    """issue 65: ids at or above the vocabulary gave "IndexError: index out of range in self", which names neither
    the id nor the vocabulary."""
    from conftest import tiny_lm

    model = tiny_lm()
    ids = torch.randint(0, 100, (2, 16))
    run_batch(model, ids)
    ids[1, 3] = 5000
    with pytest.raises(ValueError, match=r"token id 5000 is outside the model's vocabulary of 100 .* \[0, 100\)"):
        run_batch(model, {"input_ids": ids})
