"""The fidelity pass (normlab.conversion.measure.fidelity): both models over the held-out batches, a few rows at a
time where the vocabulary is large."""

from __future__ import annotations

import copy

import pytest

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
