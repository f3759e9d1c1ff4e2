"""Convert and heal in steps (``heal.steps``): each walk after a heal counts its budget from the original, each step
heals its share of the budget, and the folder saved is the model the last step left."""

from __future__ import annotations

import copy
import csv
import json

import pytest

from conftest import CALIB, convert_argv, tiny_hf
from conversion.test_frontier import _batches, _peaked, _plain
from normlab.cli import main
from normlab.conversion.config import resolve_convert_config

transformers = pytest.importorskip("transformers")


def test_a_walk_from_a_part_converted_model_counts_its_budget_from_the_reference():
    """The walk after a heal starts from a model already part-converted: with ``reference=`` the budget is the KL to
    the original, so a model already near its budget gains no site that would take it past; counted from itself,
    the same walk spends the budget again and ends past it."""
    from normlab.conversion.frontier import frontier
    from normlab.conversion.measure.fidelity import ReferenceKL

    original = _peaked()
    calib, held = _batches(2, 1), _batches(2, 2)
    model = copy.deepcopy(original)
    first, _ = frontier(model, "dyisru", calib, held, budget=_plain(nats=0.05, metric="kl"), progress=False)
    assert len(first.converted) == 2 and 0 < first.curve[-1] <= 0.05  # the peaked model's two cheapest sites

    again = copy.deepcopy(model)
    front, record = frontier(
        again, "dyisru", calib, held, budget=_plain(nats=0.05, metric="kl", walk="skip"), progress=False,
        reference=original,
    )  # fmt: skip
    assert front.ce_original == 0.0 and front.curve[0] == pytest.approx(first.curve[-1], rel=1e-5)
    assert front.converted == [] and record.sites == [] and len(front.passed) == len(front.order) == 5

    itself = copy.deepcopy(model)
    counted, _ = frontier(itself, "dyisru", calib, held, budget=_plain(nats=0.05, metric="kl"), progress=False)
    assert counted.converted  # counted from its own state it converts more ...
    kl = ReferenceKL()
    kl(original, held)
    assert kl(itself, held) > 0.05  # ... and ends past the budget the original would allow


def _steps(tmp_path, *extra) -> dict:
    text = tmp_path / "calib.txt"
    text.write_text(CALIB)
    model = tiny_hf(tmp_path / "m", seed=0)
    out = tmp_path / "o"
    argv = convert_argv(model, text, "--out", out, "--set", "budget.metric=kl", "heal.steps=3", *extra)
    assert main(argv) == 0
    return json.loads((out / "fidelity.json").read_text()) | {"out": out}


def test_convert_in_steps_heals_each_share_and_saves_what_the_last_step_left(tmp_path, capsys):
    fid = _steps(tmp_path, "--budget-nats", "0.00005", "--heal-tokens", 6000)
    printed = capsys.readouterr().out
    steps = fid["heal_steps"]
    assert [s["walk"] is None for s in steps] == [True, False, False]  # the first step's walk is the budget walk
    assert all(s["tokens"] >= 2000 and s["tokens"] < 2000 + 4 * 16 for s in steps)  # a third each, to a whole step
    for s in steps[1:]:  # every later walk: from the original, within the budget
        assert s["walk"]["ce_original"] == 0.0 and s["walk"]["ce_converted"] <= 0.00005
    assert [s["sites"] for s in steps] == sorted(s["sites"] for s in steps)  # a step only adds sites
    assert all(s["kept"] == (s["rose"] == []) for s in steps)  # a heal not kept says what it raised
    record = json.loads((fid["out"] / "normlab_conversion.json").read_text())
    assert (
        len(record["sites"])
        == steps[-1]["sites"]
        == fid["budget_walk"]["converted"] + sum(s["walk"]["converted"] for s in steps[1:])
    )
    assert "step 3 of 3: healing the" in printed
    assert not (tmp_path / "o.heal.pt").exists()  # each step's heal removed its checkpoint; the last, the job
    assert fid["heal"]["tokens"] == steps[-1]["tokens"]  # "heal" is the last step's
    with open(fid["out"] / "heal_curve.csv") as f:  # the curve: every step's, on one axis of tokens
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [k for k, s in enumerate(steps, 1) for _ in s["curve"]]
    tokens = [int(r["tokens"]) for r in rows]
    assert tokens == sorted(tokens) and tokens[-1] == sum(s["tokens"] for s in steps)
    assert (fid["out"] / "heal_curve.png").stat().st_size > 0


@pytest.mark.parametrize(
    "fields, error",
    [
        ({"heal.steps": 2, "heal.tokens": 1000}, "heal.steps 2 walks the budget afresh after each heal: give --budget"),
        ({"heal.steps": 2, "heal.tokens": 1000, "budget.nats": 0.1, "heal.resume": True}, "drop --resume"),
        ({"heal.steps": 0, "heal.tokens": 1000, "budget.nats": 0.1}, "--set heal.steps must be an int >= 1"),
        ({"heal.steps": 2, "budget.nats": 0.1}, "--set heal.steps applies only to a heal"),
        ({"heal.steps": 4, "heal.tokens": 1000, "budget.nats": 0.1, "seq_len": 128},
         "more than the budget --heal-tokens 1,000 gives each of --set heal.steps 4"),
    ],
)  # fmt: skip
def test_steps_that_cannot_run_are_refused_before_any_work(fields, error):
    with pytest.raises(ValueError, match=error.replace(".", r"\.").replace("(", r"\(")):
        resolve_convert_config(**fields)
