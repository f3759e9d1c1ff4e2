"""ConvertConfig (normlab.conversion.config): one object for convert, calibrate and heal; --set on the command
line; the resolved config in every output; the heal checkpoint's identity."""

from __future__ import annotations

import dataclasses
import inspect
import json
import re

import pytest
import torch

import normlab
from conftest import tiny_hf
from normlab.cli import main
from normlab.conversion.calibrate.fit import fit_replacement
from normlab.conversion.calibrate.sites import calibrate_sites
from normlab.conversion.config import (
    LEGACY_KEYS,
    SHORTHANDS,
    BudgetConfig,
    CalibrateConfig,
    ConvertConfig,
    DataConfig,
    HealConfig,
    choices,
    field_docs,
    flag,
    identity_difference,
    resolve_convert_config,
)
from normlab.conversion.convert import SITE_FIELDS, resolve_options
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
    with pytest.raises(ValueError, match=r"--set calibrate.massive: expected a finite number > 1"):
        resolve_convert_config(["calibrate.massive=0.5"])
    with pytest.raises(ValueError, match=r"--set heal.lr must be a finite number > 0"):
        resolve_convert_config(["heal.minutes=1", "heal.lr=-1"])
    with pytest.raises(ValueError, match=r"--set heal.lora_lr must be a finite number > 0"):
        resolve_convert_config(["heal.minutes=1", "heal.train=lora", "heal.lora_lr=inf"])
    with pytest.raises(ValueError, match=r"--set heal.lr applies only to a heal"):
        resolve_convert_config(["heal.lr=1e-3"])


def test_round_trip_through_a_dict_and_json():
    site_init = 'site_init={"*input*": {"alpha_init": 0.8}}'
    cfg = resolve_convert_config(["heal.tokens=5000", "heal.train=lora", site_init], to="dyt")
    again = ConvertConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg
    with pytest.raises(ValueError, match="heal must be a table"):
        ConvertConfig.from_dict({"heal": 5})


def test_identity_names_the_field_that_differs_and_ignores_the_budget():
    a = resolve_convert_config(["heal.minutes=5"])
    b = resolve_convert_config(["heal.minutes=30", "heal.lr=3e-3"])
    assert a.difference(b.identity()) == "heal.lr: checkpoint 0.003 vs now 0.00025"  # the rate it runs at
    assert a.difference(resolve_convert_config(["heal.tokens=1000"]).identity()) is None  # only the budget differs
    assert (
        a.difference(a.identity(model_fingerprint="x"), model_fingerprint="y")
        == "model_fingerprint: checkpoint 'x' vs now 'y'"
    )
    assert identity_difference(None, {}).startswith("it records no identity")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")
def test_device_cuda_without_a_gpu_is_refused_before_any_work_and_a_heal_may_move_devices():
    with pytest.raises(ValueError, match=r"--device cuda: this machine has no CUDA device .*use --device cpu"):
        resolve_convert_config(model="smollm2", device="cuda")
    with pytest.raises(ValueError, match="--set device must be 'cpu' or 'cuda', got 'tpu'"):
        resolve_convert_config(["device=tpu"])
    cpu = resolve_convert_config()
    assert "device" not in cpu.identity()  # a heal checkpoint resumes on another device


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
    """convert_norms' settings are ConvertConfig's fields (its keywords beyond the model, the data and the hooks are
    overrides of them), and every heal field and shorthand reaches a field, so --set reaches them all."""
    fields = set(_flat_keys(ConvertConfig().to_dict()))
    for name in SITE_FIELDS:
        assert name in fields
    for name in (f.name for f in dataclasses.fields(CalibrateConfig)):
        assert f"calibrate.{name}" in fields
    for name in (f.name for f in dataclasses.fields(HealConfig)):
        assert f"heal.{name}" in fields
    for name in (f.name for f in dataclasses.fields(DataConfig)):
        assert f"data.{name}" in fields
    for short, key in SHORTHANDS.items():
        assert key in fields and flag(key) == short


def test_no_default_is_written_in_two_places():
    """The Python API states no default of its own: convert_norms takes the config and overrides (its only
    defaulted parameters are the hooks, and ``to``'s None reads the config's); calibrate_sites takes the config and
    fit_replacement the section."""
    params = inspect.signature(normlab.convert_norms).parameters
    assert {n for n, p in params.items() if p.kind is p.VAR_KEYWORD} == {"overrides"}
    own = {"model", "to", "calibrate", "config", "extra_classes", "include", "progress", "overrides"}
    assert set(params) == own, set(params) - own
    assert all(p.default in (None, p.empty) for p in params.values())
    sites = inspect.signature(calibrate_sites).parameters
    assert not {f.name for f in dataclasses.fields(CalibrateConfig)} & set(sites)
    assert not set(SITE_FIELDS) & set(sites)  # per: read from the config, not passed beside it
    assert sites["config"].annotation in (ConvertConfig, "ConvertConfig")
    fit = inspect.signature(fit_replacement).parameters  # the fit reads its two settings from the section too
    assert not {f.name for f in dataclasses.fields(CalibrateConfig)} & set(fit) and "config" in fit


def test_every_calibrate_field_is_an_override_checked_by_the_config():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    for f in dataclasses.fields(CalibrateConfig):
        spec, cfg = resolve_options(None, None, {f.name: getattr(CalibrateConfig(), f.name)}, calibrating=True)
        assert cfg.calibrate == CalibrateConfig() and cfg.to == ConvertConfig().to == spec.name
    spec, cfg = resolve_options("dyt", CalibrateConfig(solver="lbfgs"), {"per": "channel", "massive": 5.0}, True)
    assert (cfg.to, cfg.per, cfg.calibrate.solver, cfg.calibrate.massive) == ("dyt", "channel", "lbfgs", 5.0)
    assert spec is normlab.registry.norm_spec("dyt")  # the conversion modules receive the spec
    with pytest.raises(TypeError, match="unknown option 'max_token'.*CalibrateConfig's"):
        normlab.convert_norms(model, "dyisru", max_token=16)
    with pytest.raises(ValueError, match="massive_tokens must be 'auto', 'route' or 'shared', got 'own'"):
        normlab.convert_norms(model, "dyisru", massive_tokens="own")
    with pytest.raises(ValueError, match="max_tokens: expected an int >= 16"):
        normlab.convert_norms(model, "dyisru", config=CalibrateConfig(max_tokens=8))
    with pytest.raises(ValueError, match="per must be 'global' or 'channel', got 'token'"):
        normlab.convert_norms(model, "dyisru", per="token")
    with pytest.raises(ValueError, match="to='dyt' and config.to='dyisru' disagree"):
        normlab.convert_norms(model, "dyt", config=ConvertConfig())
    assert isinstance(model[1], torch.nn.LayerNorm)  # every refusal before the model is touched


def test_the_python_api_applies_the_configs_exclude_and_refuses_what_it_would_drop():
    """issue 65, A15 and A14: ``convert_norms(config=ConvertConfig(exclude=[...]))`` leaves the excluded norms as
    ``normlab convert`` does (it converted them); a config's heal or budget section, which only convert_model runs,
    is refused, not dropped; a keyword that contradicts a value the config sets is refused, naming both, while a
    keyword may still set a field the config leaves at its default."""

    def model():
        return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.LayerNorm(8))

    m = model()
    record = normlab.convert_norms(m, config=ConvertConfig(to="dyt", exclude=["2"]), progress=False)
    assert [s.name for s in record.sites] == ["1"] and isinstance(m[2], torch.nn.LayerNorm)
    with pytest.raises(ValueError, match="every one of the 2 norms"):  # the config's exclude and the caller's include
        normlab.convert_norms(model(), config=ConvertConfig(exclude=["2"]), include=lambda n, _: n != "1")
    refused = [
        (ConvertConfig(heal=HealConfig(minutes=1.0)), "heal"),
        (ConvertConfig(budget=BudgetConfig(nats=0.4)), "budget"),
    ]
    for cfg, what in refused:
        m = model()
        with pytest.raises(ValueError, match=f"asks for a {what}.*convert_model"):
            normlab.convert_norms(m, config=cfg)
        assert isinstance(m[1], torch.nn.LayerNorm)
    with pytest.raises(ValueError, match="per='global' and the config's per='channel' disagree"):
        normlab.convert_norms(model(), config=ConvertConfig(per="channel"), per="global")
    with pytest.raises(ValueError, match="max_tokens=64 and the config's max_tokens=32 disagree"):
        normlab.convert_norms(model(), config=CalibrateConfig(max_tokens=32), max_tokens=64)
    spec, cfg = resolve_options(None, ConvertConfig(per="channel"), {"per": "channel", "solver": "lbfgs"}, True)
    assert (cfg.per, cfg.calibrate.solver) == ("channel", "lbfgs")  # agreeing, or a field left at its default


def test_choices_are_the_literal_types():
    assert choices(CalibrateConfig, "massive_tokens") == ("auto", "route", "shared")
    assert choices(ConvertConfig, "per") == ("global", "channel")
    docs = field_docs(HealConfig)
    assert set(docs) == {f.name for f in dataclasses.fields(HealConfig)}  # every field says what it is
    assert set(field_docs(CalibrateConfig)) == {f.name for f in dataclasses.fields(CalibrateConfig)}
    with pytest.raises(ValueError, match=r"--set heal.schedule must be 'constant', 'cosine' or 'cooldown'"):
        resolve_convert_config(["heal.minutes=1", "heal.schedule=linear"])


def test_convert_help_shows_each_fields_docstring_and_choices(capsys):
    with pytest.raises(SystemExit):
        main(["convert", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--massive-tokens {auto,route,shared}" in out
    assert " ".join(field_docs(CalibrateConfig)["solver"].split()) in out  # the field's own words
    assert "budget.walk = 'skip' ('skip' or 'stop')" in out


def test_the_python_api_and_the_cli_give_the_same_record(tiny, tmp_path):
    """convert_norms(model, "dyisru", calibrate=data, per="channel") and normlab convert with the same settings
    fit the same sites to the same values."""
    from normlab.conversion.data.models import load_model
    from normlab.conversion.data.texts import TextCut, text_batches

    out = tmp_path / "out"
    argv = ["convert", "--model", tiny["model"], "--calibrate", tiny["text"], "--seq-len", "16", "--sequences", "4",
            "--per", "channel", "--eval-text", "none", "--no-progress", "--out", str(out),
            "--device", "cpu"]  # fmt: skip  # named: the model is moved to it and every batch follows
    assert main(argv) == 0
    cli = json.loads((out / "normlab_conversion.json").read_text())
    assert json.loads((out / "convert_config.json").read_text())["device"] == "cpu"
    net, tok = load_model(tiny["model"], progress=False)
    calib, _ = text_batches(tiny["text"], tok, net.get_input_embeddings().num_embeddings, TextCut(16, 4, 4))
    api = normlab.convert_norms(net, "dyisru", calibrate=calib, per="channel").to_dict()
    assert [s["name"] for s in api["sites"]] == [s["name"] for s in cli["sites"]]
    assert (api["target"], api["per"], api["notes"]) == (cli["target"], cli["per"], cli["notes"])
    for a, c in zip(api["sites"], cli["sites"]):
        assert a["kwargs"] == c["kwargs"] and a["massive"] == c["massive"]
        assert set(a["fit"]) == set(c["fit"])
        for key, value in a["fit"].items():
            exact = not isinstance(value, (int, float, list)) or isinstance(value, bool)
            want = value if exact else pytest.approx(value, rel=1e-5, abs=1e-7)
            assert c["fit"][key] == want, (a["name"], key)


def _flat_keys(d, prefix=""):
    for k, v in d.items():
        if isinstance(v, dict) and k in ("data", "calibrate", "heal", "budget"):
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


def test_the_heal_rate_defaults_by_what_it_trains_and_an_explicit_rate_wins():
    """issue 48: the norms' default fell to 2.5e-4 when two orders of the 30-minute text heal ended +0.53 / +0.53 at
    it against +0.78 / +1.14 at 1e-3."""
    assert HealConfig().rate() == 2.5e-4
    assert HealConfig(train="lora").rate() == 2.5e-4  # the norms' group; the adapters take HEAL_LEARNING_RATES["lora"]
    assert HealConfig(train="all").rate() == 2e-5
    assert HealConfig(lr=3e-3).rate() == HealConfig(train="all", lr=3e-3).rate() == 3e-3


def test_a_heal_checkpoint_records_the_rate_it_runs_at_not_the_absence_of_one():
    """A checkpoint written before 0.3.4 with no rate given healed at 1e-3; resumed now with none given it would go
    on at 2.5e-4 unseen. The identity holds the rate the heal runs at, so that resume is refused, naming heal.lr,
    and a rate given as the default's value matches a checkpoint written without one."""
    default = resolve_convert_config(["heal.minutes=5"])
    assert default.identity()["heal.lr"] == 2.5e-4
    assert default.difference(resolve_convert_config(["heal.minutes=5", "heal.lr=2.5e-4"]).identity()) is None
    assert "heal.lr: checkpoint None vs now 0.00025" in default.difference({**default.identity(), "heal.lr": None})
    assert "heal.lr" in default.difference(resolve_convert_config(["heal.minutes=5", "heal.lr=1e-3"]).identity())


@pytest.mark.parametrize(
    "sets, says",
    [
        (["heal.lora_rank=4"], "heal.lora_rank sizes heal.train=lora's adapters: it does nothing here"),
        (["heal.lora_lr=3e-4"], "heal.lora_lr is heal.train=lora's adapters' rate: it does nothing here"),
    ],
)
def test_a_knob_the_heal_would_ignore_is_refused(sets, says):
    """issue 65: a setting that the chosen heal does not read (a LoRA rank or rate without LoRA) is refused, naming
    it, rather than accepted and ignored; the same knob where it applies, and any knob at its default, pass."""
    with pytest.raises(ValueError, match=says):
        resolve_convert_config(["heal.tokens=1000", *sets])
    resolve_convert_config(
        ["heal.tokens=1000", "heal.train=lora", "heal.lora_rank=4", "heal.lora_lr=3e-4", "heal.grad_clip=0.5"]
    )
    resolve_convert_config(["heal.tokens=1000", "heal.lora_rank=8"])  # the default


@pytest.mark.parametrize("key, value", [("heal.objective", "blocks"), ("heal.steps", 2), ("heal.objective", "distill")])
def test_a_retired_option_is_refused_in_one_line_and_a_saved_config_at_its_one_value_is_read(key, value, tmp_path):
    """issue 98: heal.objective = "blocks" and heal.steps, which the project's own measurements rejected, were retired.
    Given (--set, a keyword, a study's table) each is refused in one line saying what it was and what to use; a
    convert_config.json saved before, at the value that is now the only behaviour, still reads."""
    for given in ([f"{key}={value}"], {key: value}):
        with pytest.raises(ValueError, match=r"retired in 0\.10\.0: .*drop it") as e:
            resolve_convert_config(given, **({"heal.tokens": 1000} if isinstance(given, list) else {}))
        assert "\n" not in str(e.value) and key in str(e.value)
    section, name = key.split(".")
    saved = {**ConvertConfig().to_dict(), "heal": {**ConvertConfig().to_dict()["heal"], name: value}}
    if value in ("distill",):
        assert ConvertConfig.from_dict(saved) == ConvertConfig()  # an older folder's config, at the kept value
    else:
        with pytest.raises(ValueError, match="retired"):
            ConvertConfig.from_dict(saved)


@pytest.mark.parametrize(
    "sets, says",
    [
        (["data.temperature=0.7"], "data.temperature does nothing here: only a conversion that samples"),
        (["heal.tokens=1000", "data.samples=64"], "data.samples does nothing here"),
        (["heal.tokens=1000", "data.starts=bos"], "data.starts does nothing here"),
        (["heal.tokens=1000", "data.heal=self", "data.self_fraction=0.3"], "only --heal-text self\\+text, whose"),
        (["heal.tokens=1000", "heal.batch_size=2000"], "batch_size 2000 x --seq-len 128 = 256,000 tokens a step"),
    ],
)
def test_a_sampling_knob_with_nothing_to_sample_and_a_step_over_the_budget_are_refused(sets, says):
    """issue 65: data.samples, data.self_fraction and data.temperature were accepted without a self heal,
    and heal.batch_size=2000 with a 1,000-token budget trained 64,000 tokens in one step."""
    with pytest.raises(ValueError, match=says):
        resolve_convert_config(sets)
    resolve_convert_config(["heal.tokens=1000", "data.heal=self+text", "data.self_fraction=0.3", "data.starts=bos"])
    resolve_convert_config(["data.calibrate=self", "data.temperature=0.7", "data.samples=64"])
    resolve_convert_config(["heal.tokens=512", "heal.batch_size=4"])  # one step is the whole budget


@pytest.mark.parametrize(
    "sets, drawn",
    [
        (["budget.nats=0.1", "data.walk=self"], 72),  # the walk alone reads 32: 2 x 32 + 8
        (["budget.nats=0.1", "data.walk=self", "sequences=16"], 40),
        (["data.calibrate=self"], 72),
        (["heal.tokens=1000", "data.heal=self"], 1024),  # a heal's set
        (["heal.tokens=1000", "data.heal=self", "budget.nats=0.1", "data.walk=self"], 1024),
        (["budget.nats=0.1", "data.walk=self", "data.samples=2048"], 2048),  # as set
        (["heal.tokens=1000"], None),  # nothing samples the original
    ],
)
def test_the_samples_drawn_are_what_the_conversion_reads(sets, drawn):
    """A walk on samples without a heal drew a heal's 1,024 samples (ten minutes on an AVX2 CPU) to read 32; it
    draws what calibration and the walk can read now, and the config it saves records the count."""
    cfg = resolve_convert_config(sets)
    assert cfg.data.samples == drawn
    again = ConvertConfig.from_dict(cfg.to_dict())
    again.validate()
    assert again.data.samples == drawn


@pytest.mark.parametrize(
    ("sets", "given", "says"),
    [
        (["calibrate.massive_tokens=route"], {"calibrate.enabled": False}, "--massive-tokens route does nothing with"),
        (["calibrate.solver=lbfgs"], {"calibrate.enabled": False}, "does nothing with --no-calibrate"),
        (["data.samples=100000000", "data.walk=self"], {"budget.nats": 0.1},
         "100,000,000 samples of 128 tokens needs about 95.4 GiB"),
    ],
)  # fmt: skip
def test_idle_knobs_and_samples_the_machine_cannot_hold_are_refused(sets, given, says):
    """issue 85: `--massive-tokens route --no-calibrate` was saved as if it did something, and
    data.samples=100000000 on a walk that reads 72 samples began drawing 3.2 billion tokens."""
    from normlab.conversion.config import resolve_convert_config
    from normlab.errors import machine_memory

    if "GiB" in says and (machine_memory() or 0) > 100 * 2**30:
        pytest.skip("this machine holds 95 GiB of token ids")
    with pytest.raises(ValueError, match=re.escape(says)):
        resolve_convert_config(sets, model="m", to="dyisru", **given)


def test_what_each_stage_reads_is_one_section_and_the_old_names_point_to_it():
    """issue 87: the data fields sat in three sections and two top-level fields. An old name given now is refused
    with its new one; a config or a checkpoint identity written before 0.6 still reads."""
    with pytest.raises(ValueError, match=r"heal.text is now data.heal"):
        resolve_convert_config(["heal.tokens=1000", "heal.text=self"])
    with pytest.raises(ValueError, match=r"eval_text is now data.judge"):
        resolve_convert_config(eval_text="none")
    with pytest.raises(ValueError, match=r"budget.text is now data.walk"):
        resolve_convert_config({"budget": {"nats": 0.1, "text": "self"}})
    heal = {"tokens": 1000, "text": "self+text", "self_sequences": 64, "seed": 3, "sample_precision": "bf16"}
    old = {"text": "t.txt", "eval_text": None, "calibrate": {"source": "self"}, "budget": {"nats": 0.1, "text": "self"}}
    old["heal"] = heal
    d = ConvertConfig.from_dict(old).data
    assert (d.text, d.judge, d.calibrate, d.walk, d.heal, d.samples, d.seed, d.precision) == (
        "t.txt", None, "self", "self", "self+text", 64, 3, "bf16")  # fmt: skip
    now = resolve_convert_config(["heal.tokens=1000", "data.heal=self", "data.samples=64", "data.seed=3"])
    old_name = {new: was for was, new in LEGACY_KEYS.items()}
    saved = {old_name.get(k, k): v for k, v in now.identity().items()}
    assert "heal.text" in saved and "heal.self_sequences" in saved  # as a checkpoint of 0.5 holds it
    assert now.difference(saved) is None


def test_the_record_reads_the_per_choices_the_config_offers():
    """issue 98: the record (on the core floor) no longer imports the conversion config to check ``per``; its own
    tuple must stay the config's Literal."""
    from normlab.record import PER
    from normlab.typed import choices

    assert tuple(choices(ConvertConfig, "per")) == PER
