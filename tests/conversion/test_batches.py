"""Running batches through a model (normlab.conversion.batches): the inputs follow the model to its device, which
is how every stage of a conversion runs where the model is (``normlab convert --device``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import id_batches, tiny_lm
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


def test_a_sharing_copy_shares_the_matrices_and_owns_the_norms():
    """The original kept beside a conversion: the same weight matrices (no second model in memory), its own norms,
    and a norm swapped in the model leaves the copy's norm and outputs as they were."""
    import normlab
    from normlab.conversion.batches import sharing_copy
    from normlab.conversion.heal.loop import is_ours

    model = tiny_lm()
    original = sharing_copy(model)
    mats = {n: p for n, p in model.named_parameters() if p.dim() >= 2}
    assert mats and all(original.get_parameter(n) is p for n, p in mats.items())
    vecs = [n for n, p in model.named_parameters() if p.dim() < 2]
    assert vecs and all(original.get_parameter(n) is not model.get_parameter(n) for n in vecs)
    ids = id_batches(1)[0]
    with torch.no_grad():
        before = original(ids).logits
        normlab.convert_norms(model, "dyisru", calibrate=[ids])
        model.get_parameter(vecs[0]).add_(1.0)  # were it shared, the original would move too
        assert not torch.allclose(model(ids).logits, before, atol=1e-3)
        torch.testing.assert_close(original(ids).logits, before, rtol=0, atol=0)
    assert not any(is_ours(m) for m in original.modules())


def test_row_chunks_cut_a_batch_along_its_rows_and_keep_the_rest():
    from normlab.conversion.batches import row_chunks

    x = torch.arange(10).reshape(5, 2)
    assert [p.tolist() for p in row_chunks(x, 2)] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8, 9]]]
    assert row_chunks(x, 5)[0] is x and row_chunks((x, torch.zeros(5)), 9)[0] is x  # whole; a loader's tuple
    d = {"input_ids": x, "attention_mask": torch.ones(5, 2), "scale": 2.0}
    parts = row_chunks(d, 3)
    assert [p["input_ids"].shape[0] for p in parts] == [3, 2] and all(p["scale"] == 2.0 for p in parts)
    assert torch.equal(torch.cat([p["attention_mask"] for p in parts]), d["attention_mask"])
    odd = {"input_ids": x, "other": torch.ones(3)}  # tensors without a common first axis: not cut
    assert row_chunks(odd, 1) == [odd]


def test_bf16_insisted_on_a_cpu_without_it_warns_that_it_is_emulated_and_auto_takes_float32(monkeypatch):
    """A CPU with neither AVX512-BF16 nor AMX runs bf16 matmuls emulated (7x slower than float32 on an AVX2 EPYC):
    "bf16" still runs there, with a warning that names the field and the way out; "auto" takes float32 silently."""
    import warnings

    import normlab.errors
    from normlab.conversion.batches import autocast_dtype

    model = nn.Linear(4, 3)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(normlab.errors, "check_cpu_bf16", lambda **kw: None)  # the probe passes: bf16 runs here
    with pytest.warns(UserWarning, match=r"heal.precision=bf16: this CPU has neither.*heal.precision=auto takes"):
        dtype, why = autocast_dtype("bf16", model, "heal.precision")
    assert dtype is torch.bfloat16 and "emulated" in why
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert autocast_dtype("auto", model, "heal.precision")[0] is None
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)  # native: no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        expected = (torch.bfloat16, "bf16 autocast (heal.precision=bf16)")
        assert autocast_dtype("bf16", model, "heal.precision") == expected


def test_auto_takes_bf16_only_where_this_cpu_runs_it_faster(monkeypatch):
    """An Intel Xeon VM advertising AVX512-BF16 ran a bf16 matmul at 0.6x float32's speed, and "auto" took bf16
    there on the flag alone (a slower walk, sampling and heal). It now times both once (`cpu_bf16_speed`) and takes
    bf16 only where it is `BF16_GAIN` times faster, saying why it did not."""
    import normlab.conversion.batches as batches
    import normlab.errors

    model = nn.Linear(4, 3)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    monkeypatch.setattr(normlab.errors, "check_cpu_bf16", lambda **kw: None)
    monkeypatch.setattr(batches, "cpu_bf16_speed", lambda: 0.6)
    assert batches.autocast_dtype("auto", model, "budget.precision") == (
        None,
        "float32 (budget.precision=auto: a bf16 matmul runs at 0.60x float32's speed on this CPU)",
    )
    assert batches.autocast_dtype("bf16", model, "budget.precision")[0] is torch.bfloat16  # asked for: taken
    monkeypatch.setattr(batches, "cpu_bf16_speed", lambda: 2.4)
    assert batches.autocast_dtype("auto", model, "budget.precision") == (
        torch.bfloat16,
        "bf16 autocast (budget.precision=auto)",
    )
    monkeypatch.undo()
    speed = batches.cpu_bf16_speed()  # the real timing: a positive ratio, once per process
    assert speed > 0 and batches.cpu_bf16_speed() is speed


def test_log_probs_raise_half_precision_to_float32_and_keep_float64():
    """bf16 logits are raised to float32 before the softmax; a float64 model's stay float64 (a float32 cast
    there made a float64 check of the heal's gradients only as exact as float32); and `logit_rows` counts a
    float64 head's logits at 8 bytes."""
    from normlab.conversion import batches
    from normlab.conversion.batches import log_probs, logit_rows

    ids = id_batches(1, seed=0, batch=4)[0]
    raised = {torch.bfloat16: torch.float32, torch.float32: torch.float32, torch.float64: torch.float64}
    for dtype, want in raised.items():
        model = tiny_lm().to(dtype)
        logp = log_probs(model, ids, stage="test")
        assert logp.dtype == want
        torch.testing.assert_close(logp.exp().sum(-1), torch.ones(ids.shape, dtype=want))
    vocab = tiny_lm().get_output_embeddings().out_features
    one_row = ids.shape[1] * vocab
    assert logit_rows(tiny_lm(), ids) == batches.LOGITS_PART_BYTES // (4 * one_row)
    assert logit_rows(tiny_lm().double(), ids) == batches.LOGITS_PART_BYTES // (8 * one_row)
