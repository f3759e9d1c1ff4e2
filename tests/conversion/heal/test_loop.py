"""The heal's loop (normlab.conversion.heal.loop): the rate schedules, and the validation split it selects on."""

from __future__ import annotations

import copy

import pytest

import normlab
from conftest import id_batches, peaked_lm, token_stream


def test_the_cosine_schedule_warms_up_then_falls_to_a_tenth():
    from normlab.conversion.heal.loop import lr_factor

    assert lr_factor("constant", 0.0) == lr_factor("constant", 0.7) == 1.0
    f = [lr_factor("cosine", i / 200) for i in range(201)]
    assert 0 < f[0] < 0.25 and f[10] == pytest.approx(1.0)  # the warmup ends at 5% of the budget
    assert all(a < b for a, b in zip(f[:10], f[1:11]))  # rises
    assert all(a > b for a, b in zip(f[10:], f[11:]))  # then falls
    assert f[-1] == pytest.approx(0.1) and lr_factor("cosine", 1.5) == pytest.approx(0.1)


def test_the_cooldown_schedule_holds_the_rate_then_falls_to_zero():
    from normlab.conversion.heal.loop import COOLDOWN, lr_factor

    f = [lr_factor("cooldown", i / 200) for i in range(201)]
    start = round(200 * (1 - COOLDOWN))  # the step where the cooldown begins
    assert all(v == 1.0 for v in f[:start]) and f[start] == pytest.approx(1.0)  # the full rate until the last 20%
    assert all(a > b for a, b in zip(f[start:], f[start + 1 :]))  # then falling at every step
    assert f[start + (200 - start) // 2] == pytest.approx(0.5)  # along a straight line
    assert f[-1] == 0.0 and lr_factor("cooldown", 1.5) == 0.0 and lr_factor("cooldown", -0.1) == 1.0


def _scheduled_heal(schedule: str, eval_every: int):
    """A 4,000-token DyT heal of a peaked tiny Llama at 1e-2 under ``schedule``, a curve point every ``eval_every``."""
    original = peaked_lm(0)
    model = copy.deepcopy(original)
    rec = normlab.convert_norms(model, "dyt")
    return normlab.heal(original, model, token_stream(), rec, val=id_batches(1, seed=9), tokens=4000, lr=1e-2,
                        schedule=schedule, eval_every=eval_every, progress=False)  # fmt: skip


def test_a_cooldown_heal_records_the_rate_then_its_fall():
    rep = _scheduled_heal("cooldown", eval_every=320)
    lrs = [p["lr"] for p in rep.curve[1:]]
    assert lrs[0] == pytest.approx(1e-2)  # no warmup
    held = [lr for lr, p in zip(lrs, rep.curve[1:]) if p["tokens"] < 0.8 * 4000 - 320]
    assert held and all(lr == pytest.approx(1e-2) for lr in held)
    assert all(a > b for a, b in zip(lrs[len(held) + 1 :], lrs[len(held) + 2 :]))  # falling through the cooldown
    assert lrs[-1] < 1e-3  # near 0 at the budget's end (the last step's rate)
    assert min(p["val_kl"] for p in rep.curve[1:]) < rep.curve[0]["val_kl"]


def test_a_cosine_heal_records_its_rate_as_it_falls():
    rep = _scheduled_heal("cosine", eval_every=640)
    lrs = [p["lr"] for p in rep.curve[1:]]
    assert len(lrs) >= 6 and all(a > b for a, b in zip(lrs, lrs[1:]))  # past the warmup: falling at every point
    assert 1e-3 <= lrs[-1] < 1.2e-3  # a tenth of the rate at the budget's end (the last step's)
    assert min(p["val_kl"] for p in rep.curve[1:]) < rep.curve[0]["val_kl"]


def test_the_validation_measured_in_parts_reads_as_the_whole_split(monkeypatch):
    """The heal's validation split is stored and measured a few rows at a time under a large vocabulary: its
    cross-entropy and KL must be the whole split's."""
    from normlab.conversion import batches
    from normlab.conversion.heal.loop import Validation

    original = peaked_lm(0)
    model = copy.deepcopy(original)
    normlab.convert_norms(model, "dyt")
    val = id_batches(2, seed=9, batch=3)
    read = []
    for limit in (2**40, 16 * 100 * 4):
        monkeypatch.setattr(batches, "LOGITS_PART_BYTES", limit)
        v = Validation(original, model, val, [])
        read.append((len(v.batches), v.measure()))
    (n_whole, whole), (n_parts, parts) = read
    assert (n_whole, n_parts) == (2, 6)
    assert parts == pytest.approx(whole, rel=1e-6)


def test_the_adapters_take_their_own_rate_and_a_rollback_halves_both():
    """heal.lora_lr sets the LoRA adapters' Adam rate (1e-3 by default), heal.lr the norms': each group its own."""
    from normlab.conversion.config import HEAL_LEARNING_RATES, HealConfig
    from normlab.conversion.heal.loop import make_optimizer, trainable
    from normlab.conversion.heal.lora import add_lora

    model = copy.deepcopy(peaked_lm(0))
    normlab.convert_norms(model, "dyisru")
    adapters = {id(p) for w in add_lora(model.model.layers, rank=2) for p in (w.lora_a, w.lora_b)}
    params = trainable(model, "lora")
    assert adapters <= {id(p) for p in params} and len(params) > len(adapters)

    def rates(cfg: HealConfig, scale: float = 1.0) -> set[tuple[bool, float]]:
        opt = make_optimizer(params, cfg.rate(), model, scale, cfg.lora_rate())
        return {(any(id(p) in adapters for p in g["params"]), g["lr"]) for g in opt.param_groups}

    assert rates(HealConfig(train="lora")) == {(False, 2.5e-4), (True, HEAL_LEARNING_RATES["lora"])}
    assert rates(HealConfig(train="lora", lr=1e-4, lora_lr=3e-4), 0.5) == {(False, 5e-5), (True, 1.5e-4)}
