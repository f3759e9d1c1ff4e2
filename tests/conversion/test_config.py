"""ConvertConfig (normlab.conversion.config): one object for convert, calibrate and heal; --set on the command
line; the resolved config in every output; the heal checkpoint's identity."""

from __future__ import annotations

import inspect
import json

import pytest

import normlab
from conftest import tiny_hf
from normlab.cli import main
from normlab.conversion.config import (
    SHORTHANDS,
    ConvertConfig,
    HealConfig,
    flag,
    identity_difference,
    resolve_convert_config,
)
from normlab.conversion.workflow import CONFIG_FILE, convert_model

transformers = pytest.importorskip("transformers")


@pytest.fixture()
def tiny(tmp_path):
    tiny_hf(tmp_path / "m")
    text = tmp_path / "calib.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 200)
    return {"model": str(tmp_path / "m"), "text": str(text)}


def test_set_reaches_every_section_and_unknown_fields_are_named():
    cfg = resolve_convert_config(
        ["heal.minutes=5", "heal.lr=3e-3", "calibrate.target=local", "init.alpha_init=0.5"], to="dyt"
    )
    assert (cfg.heal.lr, cfg.calibrate.target, cfg.init, cfg.to) == (3e-3, "local", {"alpha_init": 0.5}, "dyt")
    with pytest.raises(ValueError, match=r"unknown config field 'heal.rate'.*valid: minutes, tokens"):
        resolve_convert_config(["heal.rate=1"])
    with pytest.raises(ValueError, match=r"--set calibrate.massive: expected a number > 1"):
        resolve_convert_config(["calibrate.massive=0.5"])
    with pytest.raises(ValueError, match=r"--set heal.lr must be a finite number > 0"):
        resolve_convert_config(["heal.minutes=1", "heal.lr=-1"])
    with pytest.raises(ValueError, match=r"--set heal.lr applies only to a heal"):
        resolve_convert_config(["heal.lr=1e-3"])


def test_round_trip_through_a_dict_and_json():
    site_init = 'site_init={"*input*": {"alpha_init": 0.8}}'
    cfg = resolve_convert_config(["heal.tokens=500", "heal.train=lora", site_init], to="dyt")
    again = ConvertConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg
    with pytest.raises(ValueError, match="heal must be a table"):
        ConvertConfig.from_dict({"heal": 5})


def test_identity_names_the_field_that_differs_and_ignores_the_budget():
    a = resolve_convert_config(["heal.minutes=5"])
    b = resolve_convert_config(["heal.minutes=30", "heal.lr=3e-3"])
    assert a.difference(b.identity()) == "heal.lr: checkpoint 0.003 vs now None"
    assert a.difference(resolve_convert_config(["heal.tokens=100"]).identity()) is None  # only the budget differs
    assert (
        a.difference(a.identity(model_fingerprint="x"), model_fingerprint="y")
        == "model_fingerprint: checkpoint 'x' vs now 'y'"
    )
    assert identity_difference(None, {}).startswith("it records no identity")


def test_a_checkpoint_from_before_a_new_default_is_refused_naming_it_and_resumes_with_the_old_value():
    """A heal checkpoint written before ``heal.batch_size`` became 4 and ``heal.rollback_nats`` existed (its
    identity: batch 8, no rollback key) is refused with both fields named; setting the old values resumes it
    (an absent rollback_nats and null both mean no rollback)."""
    old = resolve_convert_config(["heal.minutes=30"]).identity()
    old["heal.batch_size"] = 8
    del old["heal.rollback_nats"]
    now = resolve_convert_config(["heal.minutes=30"])
    assert now.difference(old) == (
        "heal.batch_size: checkpoint 8 vs now 4; heal.rollback_nats: checkpoint None vs now 0.5"
    )
    assert resolve_convert_config(["heal.batch_size=8", "heal.rollback_nats=null"]).difference(old) is None


def test_every_knob_reachable_from_python_has_a_field():
    """convert_norms' and heal's keywords (beyond the model and the data) are all fields, so --set reaches them."""
    fields = set(_flat_keys(ConvertConfig().to_dict()))
    convert = set(inspect.signature(normlab.convert_norms).parameters) - {
        "model",
        "calibrate",
        "include",
        "extra_classes",
        "progress",
    }
    renamed = {"first_token": "calibrate.first_token", "to": "to"}
    for name in convert:
        key = renamed.get(name, name)
        assert key in fields or f"calibrate.{name}" in fields, name
    for name in (f.name for f in __import__("dataclasses").fields(HealConfig)):
        assert f"heal.{name}" in fields
    for short, key in SHORTHANDS.items():
        assert key in fields and flag(key) == short


def _flat_keys(d, prefix=""):
    for k, v in d.items():
        if isinstance(v, dict) and k in ("calibrate", "heal"):
            yield from _flat_keys(v, f"{k}.")
        else:
            yield f"{prefix}{k}"


def test_convert_with_set_writes_its_config_and_a_resume_with_another_is_refused(tiny, tmp_path, capsys):
    out, ck = tmp_path / "out", tmp_path / "heal.pt"
    base = ["convert", "--model", tiny["model"], "--calibrate", tiny["text"], "--seq-len", "16", "--sequences", "4",
            "--no-progress", "--heal-tokens", "256", "--checkpoint", str(ck)]  # fmt: skip
    assert main([*base, "--set", "heal.lr=3e-3", "heal.batch_size=2", "--out", str(out)]) == 0
    saved = json.loads((out / CONFIG_FILE).read_text())
    assert saved["heal"]["lr"] == 3e-3 and saved["heal"]["batch_size"] == 2 and saved["heal"]["tokens"] == 256
    assert ConvertConfig.from_dict(saved).heal.lr == 3e-3
    capsys.readouterr()
    assert main([*base, "--set", "heal.lr=1e-3", "heal.batch_size=2", "--resume"]) == 2
    err = capsys.readouterr().err
    assert "heal.lr: checkpoint 0.003 vs now 0.001" in err, err


def test_convert_model_takes_a_config_and_nothing_else(tiny):
    with pytest.raises(TypeError, match="expected a ConvertConfig"):
        convert_model(tiny["model"])
