"""The fidelity pass (normlab.conversion.measure.fidelity): both models over the held-out batches, a few rows at a
time where the vocabulary is large."""

from __future__ import annotations

import copy

import pytest
import torch

import normlab
from conftest import id_batches, tiny_lm
from normlab.conversion import batches
from normlab.conversion.measure import fidelity as fid_mod
from normlab.conversion.measure.judge import TokenTally


def test_a_batch_measured_a_row_at_a_time_reads_as_the_whole_batch(monkeypatch):
    """A 152k vocabulary's logits at 8 x 128 tokens are 0.6 GB for each model: `fidelity` cuts a batch into parts
    of rows whose logits fit `normlab.conversion.batches.LOGITS_PART_BYTES`. Every statistic must be the one the
    whole batch gives."""
    original = tiny_lm(initializer_range=0.5)
    model = copy.deepcopy(original)
    rec = normlab.convert_norms(model, "dyt", calibrate=id_batches(1, seed=3))
    held = id_batches(2, seed=4, t=16, batch=4)
    seen = []
    run = fid_mod.run_batch
    monkeypatch.setattr(fid_mod, "run_batch", lambda m, b, i, **k: seen.append(len(b)) or run(m, b, i, **k))

    def measured(limit):
        monkeypatch.setattr(batches, "LOGITS_PART_BYTES", limit)
        seen.clear()
        tally = TokenTally()
        out = fid_mod.fidelity(original, model, held, rec, tally=tally)
        return out, tally, list(seen)

    whole, t_whole, rows_whole = measured(2**40)
    parts, t_parts, rows_parts = measured(4 * 16 * 100)  # one row's logits: 16 tokens x 100 ids x 4 bytes
    assert set(rows_whole) == {4} and set(rows_parts) == {1}  # the cut happened, and only where asked
    for k in ("kl", "ce_original", "ce_converted", "output_cosine", "mean_site_error"):
        assert parts[k] == pytest.approx(whole[k], rel=1e-5), k
    assert parts["sites"] == pytest.approx(whole["sites"], rel=1e-5)
    assert _flat(t_parts.result()) == pytest.approx(_flat(t_whole.result()), rel=1e-5)


def _flat(d: dict, key: str = "") -> dict:
    """A nested dict of numbers as one level (``"kld.mean"``), for one approx comparison."""
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{key}{k}.") if isinstance(v, dict) else {f"{key}{k}": v})
    return out


def test_reference_kl_reads_0_on_its_reference_then_the_kl_to_it_by_hand():
    """ReferenceKL, the budget walk's ``metric="kl"``: its first call records the model and reads 0; later calls read
    the mean KL(reference || model) per position, equal to the full KL computed by hand when k covers the
    vocabulary, and at most that KL when k is smaller (the tail merged). Masked positions do not count, and other
    batches than the reference's are refused."""
    import torch

    model = tiny_lm("Llama", layers=2, initializer_range=0.3)
    batches = id_batches(2, t=12)
    with torch.no_grad():
        ref = [model(b).logits.log_softmax(-1) for b in batches]
    full, few = fid_mod.ReferenceKL(), fid_mod.ReferenceKL(k=5)
    assert full(model, batches) == 0.0 and few(model, batches) == 0.0
    changed = copy.deepcopy(model)
    normlab.convert_norms(changed, "dyt", include=lambda n, m: n == "model.layers.1.input_layernorm")
    with torch.no_grad():
        new = [changed(b).logits.log_softmax(-1) for b in batches]
    by_hand = torch.cat([(p.exp() * (p - q)).sum(-1).flatten() for p, q in zip(ref, new)]).mean()
    assert by_hand > 1e-3  # the change is seen
    assert full(changed, batches) == pytest.approx(float(by_hand), rel=1e-5)
    assert 0 < few(changed, batches) <= float(by_hand) + 1e-6
    assert full(model, batches) == pytest.approx(0.0, abs=1e-6)
    mask = torch.ones_like(batches[0])
    mask[:, :4] = 0
    masked = fid_mod.ReferenceKL()
    masked(model, [{"input_ids": batches[0], "attention_mask": mask}])
    got = masked(changed, [{"input_ids": batches[0], "attention_mask": mask}])
    with torch.no_grad():
        p, q = (m(batches[0], attention_mask=mask).logits.log_softmax(-1)[:, 4:] for m in (model, changed))
    assert got == pytest.approx(float((p.exp() * (p - q)).sum(-1).mean()), rel=1e-4)
    with pytest.raises(ValueError, match="1 batches against a reference of 2"):
        full(model, batches[:1])
    with pytest.raises(ValueError, match="k must be an int >= 1"):
        fid_mod.ReferenceKL(k=0)


def test_reference_kl_on_every_nth_position_runs_the_output_layer_on_those_alone():
    """``ReferenceKL(every=n)``, the walk's ranking measure: the KL at positions 0, n, 2n, ... exactly, each with its
    whole context, while the output layer sees only those rows; masked positions still do not count."""
    import torch

    model = tiny_lm("Llama", layers=2, initializer_range=0.3)
    changed = copy.deepcopy(model)
    normlab.convert_norms(changed, "dyt", include=lambda n, m: n == "model.layers.0.input_layernorm")
    batches = id_batches(2, t=12)
    mask = torch.ones_like(batches[0])
    mask[0, :5] = 0
    runs = [{"input_ids": batches[0], "attention_mask": mask}, batches[1]]
    rows = []
    head = changed.get_output_embeddings().register_forward_hook(lambda mod, args, out: rows.append(out.shape[1]))
    thin = fid_mod.ReferenceKL(every=3)
    thin(model, runs)
    got = thin(changed, runs)
    head.remove()
    assert rows == [4, 4]  # positions 0, 3, 6, 9 of 12
    total, count = 0.0, 0
    with torch.no_grad():
        for run, m in zip(runs, (mask, torch.ones_like(batches[1]))):
            kw = run if isinstance(run, dict) else {"input_ids": run}
            p, q = (net(**kw).logits.log_softmax(-1)[:, ::3] for net in (model, changed))
            kl = (p.exp() * (p - q)).sum(-1)[m[:, ::3].bool()]
            total, count = total + float(kl.sum()), count + kl.numel()
    assert count == 30 and got == pytest.approx(total / count, rel=1e-4)  # 8 rows of 4; positions 0 and 3 of one masked
    with pytest.raises(ValueError, match="every must be an int >= 1"):
        fid_mod.ReferenceKL(every=0)


def test_reference_kl_in_parts_of_the_positions_reads_what_it_reads_whole(monkeypatch):
    """A vocabulary whose log-probabilities at every position would not fit `LOGITS_PART_BYTES` is read a part of the
    positions at a time (here 7 rows per part, masked and not): the same reference and the same KL as whole."""
    import torch

    model = tiny_lm("Llama", layers=2, initializer_range=0.3)
    changed = copy.deepcopy(model)
    normlab.convert_norms(changed, "dyt", include=lambda n, m: n == "model.layers.0.input_layernorm")
    batches = id_batches(2, t=12)
    mask = torch.ones_like(batches[0])
    mask[0, :5] = 0
    runs = [{"input_ids": batches[0], "attention_mask": mask}, batches[1]]
    whole = fid_mod.ReferenceKL(k=20)
    whole(model, runs)
    want = whole(changed, runs)
    monkeypatch.setattr(fid_mod, "LOGITS_PART_BYTES", 7 * 4 * model.config.vocab_size)
    parts = fid_mod.ReferenceKL(k=20)
    parts(model, runs)
    for (v, i), (w, j) in zip(parts.reference, whole.reference):
        assert torch.equal(v, w) and torch.equal(i, j)
    assert parts(changed, runs) == pytest.approx(want, rel=1e-6) and want > 1e-3


def test_a_batch_that_fails_is_named_by_its_stage():
    """issue 85: a held-out batch (or a heal's) that the model could not run was reported as "calibration batch 0",
    whatever the stage. Each error now names the stage that ran it and the batch, with the cause."""
    from conftest import token_stream

    original = tiny_lm(initializer_range=0.5)
    model = copy.deepcopy(original)
    rec = normlab.convert_norms(model, "dyt", calibrate=id_batches(1, seed=3))
    bad = [*id_batches(1, seed=4), torch.full((2, 8), 100)]  # batch 1: ids past the vocabulary of 100
    with pytest.raises(ValueError, match=r"held-out batch 1 could not be run.*vocabulary"):
        normlab.fidelity(original, model, bad, rec)
    with pytest.raises(ValueError, match=r"heal \(the original, as teacher\) batch 0 could not be run.*vocabulary"):
        normlab.heal(original, model, token_stream(), rec, tokens=64, val=[torch.full((2, 8), 100)], progress=False)
