"""Bad input gets a clear error at the boundary that says what was expected and what was given."""

import math

import pytest
import torch

import normlab
import normlab.functional as FN
from normlab.cli import main
from normlab.lab import GPTConfig


def test_unknown_name_lists_valid_names():
    with pytest.raises(ValueError, match="Did you mean 'dyt'") as e:
        normlab.create_norm("dty", 8)
    for name in ("rms_norm", "dyisru", "layer_norm"):
        assert name in str(e.value)


def test_unknown_kwarg_lists_valid_ones():
    with pytest.raises(TypeError, match="does not take beta_init; it takes: .*alpha_init"):
        normlab.create_norm("dyt", 8, beta_init=3.0)


def test_wrong_last_dimension(norm_name):
    m = normlab.create_norm(norm_name, 8)
    with pytest.raises(ValueError, match=r"expected an input of shape \(\.\.\., 8\), got \(2, 3, 5\)"):
        m(torch.randn(2, 3, 5))


@pytest.mark.parametrize("fn,args", [(FN.rms_norm, ()), (FN.layer_norm, ()), (FN.dyt, (0.5,)), (FN.dyisru, (4.0,))])
def test_wrong_weight_shape(fn, args):
    with pytest.raises(ValueError, match=r"expected weight of shape \(8,\) .* got weight of shape \(7,\)"):
        fn(torch.randn(3, 8), *args, weight=torch.ones(7))


@pytest.mark.parametrize("fn", [FN.layer_norm, FN.dyt, FN.dyisru])
def test_wrong_bias_shape(fn):
    extra = {"alpha": 0.5} if fn is FN.dyt else {"beta": 4.0} if fn is FN.dyisru else {}
    with pytest.raises(ValueError, match=r"expected bias of shape \(8,\)"):
        fn(torch.randn(3, 8), bias=torch.zeros(2, 8), **extra)


def test_wrong_alpha_shape():
    with pytest.raises(ValueError, match=r"alpha of shape \(8,\) or \(\) or \(1,\)"):
        FN.dyt(torch.randn(3, 8), torch.ones(3))


def test_non_floating_input(norm_name):
    m = normlab.create_norm(norm_name, 4)
    with pytest.raises(TypeError, match="expected a floating-point input .* got dtype torch.int64"):
        m(torch.arange(8).reshape(2, 4))


@pytest.mark.parametrize("value", [0.0, -1.0, math.inf, math.nan])
@pytest.mark.parametrize("name", ["dyisru", "eln"])
def test_bad_beta_init(name, value):
    with pytest.raises(ValueError, match=f"expected beta_init to be a finite number > 0, got {value}"):
        normlab.create_norm(name, 8, beta_init=value)


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_non_finite_alpha_init(value):
    with pytest.raises(ValueError, match="expected alpha_init to be a finite number"):
        normlab.create_norm("dyt", 8, alpha_init=value)


def test_bad_dim():
    with pytest.raises(ValueError, match="expected dim .* got 0"):
        normlab.create_norm("rms_norm", 0)


def test_empty_batch(norm_name):
    m = normlab.create_norm(norm_name, 8)
    x = torch.randn(0, 8, requires_grad=True)
    y = m(x)
    assert y.shape == (0, 8)
    y.sum().backward()
    assert x.grad.shape == (0, 8)


# 1: a base class's keyword counts only when **kwargs reaches it
def test_a_keyword_the_class_does_not_pass_on_is_refused_clearly():
    assert "bias" not in normlab.registry.init_kwargs("rms_norm")  # RMSNorm.__init__ has no **kwargs
    with pytest.raises(TypeError, match="norm 'rms_norm' does not take bias"):
        normlab.create_norm("rms_norm", 64, bias=False)
    assert "bias" in normlab.registry.init_kwargs("dyt")  # DyT passes **kwargs on to the family's bias
    cfg = GPTConfig(norm="dyt", norm_final="rms_norm", norm_final_kwargs={"bias": False})
    with pytest.raises(ValueError, match="model.norm_final_kwargs: norm 'rms_norm' does not take bias"):
        cfg.validate()


def test_rms_ema_momentum_true_is_refused():
    import normlab

    with pytest.raises(ValueError, match="momentum"):
        normlab.create_norm("rms_ema", 8, momentum=True)


@pytest.mark.parametrize("name, dim, kwargs, match", [
    ("dyt", 8, {"alpha_init": 1e40}, "alpha_init at most 3.4e\\+38 in magnitude"),
    ("dyt", 8, {"alpha_init": True}, "alpha_init to be a finite number"),
    ("dyisru", 8, {"beta_init": True}, "beta_init to be a finite number > 0"),
    ("group_rms", 8, {"group_size": True}, "group_size to be an int >= 1"),
    ("scaled_dyt", "8", {}, "ScaledDyT: expected dim .* got '8'"),
    ("dyt", 8, {"per_channel_alpha": "yes"}, "per_channel_alpha to be True or False"),
    ("layer_norm", 8, {"bias": "no"}, "bias to be True or False"),
])  # fmt: skip
def test_bad_norm_arguments_are_clear_value_errors(name, dim, kwargs, match):
    from normlab.registry import create_norm

    with pytest.raises(ValueError, match=match):
        create_norm(name, dim, **kwargs)


@pytest.mark.parametrize(
    "argv",
    [
        ["predict", "--set", "model.width=100000"],
        ["gain", "--samples", "100000000"],
        ["train", "--preset", "tiny", "--set", "model.width=60000", "model.heads=1"],
    ],
)
def test_sizes_that_exhaust_memory_are_refused_up_front(tmp_path, capsys, argv, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "GiB" in err and "of this machine's" in err and "a job may take" in err, err
    assert not (tmp_path / "runs").exists()


def test_replace_text_keeps_the_old_file_when_a_write_fails(tmp_path, monkeypatch):
    """issue 85: a study cell's result.json, a conversion's report: written beside and moved into place, so a write
    that fails part-way (a full disk, a kill) leaves the previous file whole and no partial one."""
    from pathlib import Path

    from normlab.owner import replace_text

    target = tmp_path / "result.json"
    target.write_text('{"old": true}\n')
    real = Path.write_text

    def half_then_full(self, text, *a, **k):
        real(self, text[: len(text) // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", half_then_full)
    with pytest.raises(OSError, match="No space left"):
        replace_text(target, '{"new": true, "padding": "' + "x" * 100 + '"}\n')
    monkeypatch.setattr(Path, "write_text", real)
    assert target.read_text() == '{"old": true}\n' and sorted(p.name for p in tmp_path.iterdir()) == ["result.json"]
    replace_text(target, "{}\n")
    assert target.read_text() == "{}\n"
