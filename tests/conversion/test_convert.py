"""Model conversion: Hugging Face models from small configs (no downloads), calibration, fidelity, save/load."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import normlab
from conftest import tiny_lm
from normlab.cli import main
from normlab.lab import resolve_config, train

transformers = pytest.importorskip("transformers")


def _hf_models() -> dict:
    t = transformers
    torch.manual_seed(0)
    return {
        "llama": (
            tiny_lm(),
            "LlamaRMSNorm",
            5,
        ),
        "gpt2": (
            t.GPT2LMHeadModel(
                t.GPT2Config(
                    vocab_size=100, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0
                )
            ),
            "LayerNorm",
            5,
        ),
        "bert": (
            t.BertModel(
                t.BertConfig(
                    vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
                )
            ),
            "LayerNorm",
            5,
        ),
        "gemma": (
            t.GemmaForCausalLM(
                t.GemmaConfig(
                    vocab_size=100,
                    hidden_size=32,
                    intermediate_size=64,
                    num_hidden_layers=2,
                    num_attention_heads=4,
                    num_key_value_heads=1,
                    head_dim=8,
                )
            ),
            "GemmaRMSNorm",
            5,
        ),
        "t5": (
            t.T5ForConditionalGeneration(
                t.T5Config(
                    vocab_size=100, d_model=32, d_ff=64, num_layers=2, num_heads=4, d_kv=8, decoder_start_token_id=0
                )
            ),
            "T5LayerNorm",
            12,
        ),
    }


def _inputs(name):
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "decoder_input_ids": ids} if name == "t5" else {"input_ids": ids}


def _out(model, batch):
    out = model(**batch)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


@pytest.mark.parametrize("name", ["llama", "gpt2", "bert", "gemma", "t5"])
def test_hf_models_convert_run_and_round_trip(name, tmp_path):
    model, norm_class, n_norms = _hf_models()[name]
    batch = _inputs(name)
    record = normlab.convert_norms(model, "dyisru", calibrate=[batch])
    assert len(record.sites) == n_norms and not record.skipped
    assert not any(type(m).__name__ == norm_class for m in model.modules())  # every norm replaced
    for s in record.sites:  # every fit is finite; a fit that is not "ok" says why (a random model's best fit
        assert math.isfinite(s.fit["rel_error"])  # to a LayerNorm can be linear: flagged as degenerate)
        assert s.fit["converged"] or any("degenerate" in n for n in s.notes)
    _out(model, batch).float().pow(2).mean().backward()  # forward and backward
    grads = [p.grad for n, p in model.named_parameters() if n.endswith("log_beta")]
    assert len(grads) == n_norms and all(g is not None and torch.isfinite(g).all() for g in grads)
    model.eval()
    normlab.save_converted(model, record, tmp_path / "m")
    loaded, rec2 = normlab.load_converted(tmp_path / "m")
    with torch.no_grad():
        assert torch.equal(_out(loaded, batch), _out(model, batch))
    assert rec2.to_dict() == record.to_dict()


@pytest.mark.parametrize("name,to", [("llama", "rms_norm"), ("gemma", "rms_norm"), ("gpt2", "layer_norm"),
                                     ("t5", "rms_norm")])  # fmt: skip
def test_converting_to_the_same_norm_is_exact(name, to):
    """The affine is copied with the right semantics (Gemma's 1 + weight included): same norm, same outputs."""
    model, _, _ = _hf_models()[name]
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n or "ln_" in n:
                p.add_(0.1 * torch.randn_like(p))  # non-trivial affine
    batch = _inputs(name)
    original = copy.deepcopy(model).eval()
    normlab.convert_norms(model, to)
    with torch.no_grad():
        torch.testing.assert_close(_out(model.eval(), batch), _out(original, batch), rtol=1e-5, atol=1e-5)


class OutlierModel(nn.Module):
    """Token -> a norm -> a head, with the activations of the DyISRU paper's outlier model built in.

    Every token's vector has the same norm outside channel 0 (||x_without_0|| = 10) and its own value
    in channel 0, from 0 to 60: on that outlier channel RMSNorm equals DyISRU with beta = 100 (Theorem 3),
    and DyT is only an approximation. (On the other channels ||x_without_i|| includes the outlier and changes
    from token to token, so no element-wise function is exact there; the papers fit the outliers only.)
    """

    def __init__(self, c: int = 64, vocab: int = 64) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        bulk = torch.randn(vocab, c - 1, generator=g)
        emb = torch.cat([torch.linspace(0, 60, vocab)[:, None], 10 * bulk / bulk.norm(dim=1, keepdim=True)], 1)
        self.emb = nn.Embedding.from_pretrained(emb, freeze=False)
        self.norm = nn.RMSNorm(c, eps=1e-6)
        self.head = nn.Linear(c, vocab)

    def forward(self, ids):
        return self.head(self.norm(self.emb(ids)))


def test_dyisru_calibration_is_exact_on_the_papers_outlier_model():
    torch.manual_seed(0)
    model = OutlierModel()
    ids = torch.arange(64)[None]
    with torch.no_grad():
        x = model.emb(ids)
        y = model.norm(x)[..., 0]  # the outlier channel
    errors = {}
    for to in ("dyisru", "scaled_dyt"):
        conv = copy.deepcopy(model)
        normlab.convert_norms(conv, to, calibrate=[ids], per="channel", fit_amplitude=False)  # papers' sqrt(C) form
        with torch.no_grad():
            errors[to] = float((conv.norm(x)[..., 0] - y).norm() / y.norm())
    assert errors["dyisru"] < 1e-5  # exact, as Theorem 3 says
    assert errors["scaled_dyt"] > 100 * errors["dyisru"]


def _trained_lab_model(tmp_path, outlier_scale: float):
    """A small GPT trained in the lab, then given two massive-activation channels (as large LLMs develop)."""
    from normlab.lab import GPT
    from normlab.lab.data import get_batch, load_corpus

    text = tmp_path / "text.txt"
    text.write_text("To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer\n" * 200)
    cfg = resolve_config("tiny", {"steps": 60, "lr": 3e-3}, data=[str(text)], out=str(tmp_path / "run"))
    train(cfg, progress=False)
    model = GPT(cfg.model)
    model.load_state_dict(torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)["model"])
    with torch.no_grad():  # outlier channels: two residual dimensions far larger than the rest
        model.wte.weight[:, :2] *= outlier_scale
        model.wpe.weight[:, :2] *= outlier_scale
    corpus = load_corpus([str(text)])
    batches = [get_batch(corpus.train, (8, 32), seed=s, step=0)[0] for s in range(6)]
    return model.eval(), batches[:4], batches[4:]


def test_calibration_beats_default_init_on_outlier_heavy_activations(tmp_path):
    model, calib, held = _trained_lab_model(tmp_path, outlier_scale=20.0)
    x = {}

    def grab(module, args):
        x["x"] = args[0].detach().reshape(-1, 32)

    h = model.blocks[0].norm_attn.register_forward_pre_hook(grab)
    model(held[0])
    h.remove()
    z = (x["x"] - x["x"].mean(-1, keepdim=True)) / x["x"].std(-1, keepdim=True)
    assert float((z**4).mean() - 3) > 5  # heavy-tailed: excess kurtosis over channels
    err = {}
    for to in ("dyisru", "dyt", "derf"):
        for cal in (True, False):
            conv = copy.deepcopy(model)
            rec = normlab.convert_norms(conv, to, calibrate=calib if cal else None)
            err[to, cal] = normlab.fidelity(model, conv, held, rec, lm=True)
    for to in ("dyisru", "dyt", "derf"):
        assert err[to, True]["mean_site_error"] < err[to, False]["mean_site_error"]
        assert err[to, True]["kl"] < err[to, False]["kl"]


# ------------------------------------------------------------------ bad input, all-or-nothing
def test_bad_input_is_clear_and_conversion_is_all_or_nothing(tmp_path):
    with pytest.raises(ValueError, match="found no normalization module"):
        normlab.convert_norms(nn.Sequential(nn.Linear(4, 4)), "dyisru")
    model, _, _ = _hf_models()["llama"]
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match="unknown norm 'dyisr'"):
        normlab.convert_norms(model, "dyisr")
    with pytest.raises(TypeError, match="calibrate: expected a tensor of inputs"):
        normlab.convert_norms(model, "dyisru", calibrate="some text")
    with pytest.raises(ValueError, match="calibration batch 0 could not be run"):
        normlab.convert_norms(model, "dyisru", calibrate=[{"input_ids": torch.zeros(2, 3, 4, dtype=torch.long)}])
    with pytest.raises(ValueError, match="does not take beta_init"):  # fails at one site, after others were built
        normlab.convert_norms(model, "dyt", site_init={"*.1.*": {"beta_init": 3.0}})
    assert not any(type(m).__module__.startswith("normlab") for m in model.modules())  # nothing half-converted
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    (tmp_path / "notamodel").mkdir()
    assert main(["convert", "--model", str(tmp_path / "notamodel"), "--calibrate", "x.txt"]) == 2


def test_unknown_norm_classes_are_reported_not_skipped_silently():
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.GroupNorm(2, 8))
    record = normlab.convert_norms(model, "dyisru")
    assert [s.name for s in record.sites] == ["1"]
    assert record.skipped[0]["name"] == "2" and "GroupNorm" in record.skipped[0]["class"]
    assert "not converted: 2 (GroupNorm)" in record.table()


def test_per_site_init_and_per_channel():
    model, _, _ = _hf_models()["llama"]
    rec = normlab.convert_norms(
        model,
        "dyt",
        site_init={"*input_layernorm": {"alpha_init": 0.8}, "*post_attention_layernorm": {"alpha_init": 0.2}},
    )
    alphas = {s.name: s.kwargs.get("alpha_init") for s in rec.sites}
    assert alphas["model.layers.0.input_layernorm"] == 0.8
    assert alphas["model.layers.1.post_attention_layernorm"] == 0.2
    assert math.isclose(model.model.layers[0].input_layernorm.alpha.item(), 0.8, rel_tol=1e-6)
    model2, _, _ = _hf_models()["llama"]
    rec = normlab.convert_norms(model2, "dyisru", calibrate=[_inputs("llama")], per="channel")
    assert model2.model.norm.log_beta.shape == (32,)
    assert rec.sites[0].fit["per"] == "channel"


def test_convert_command(tmp_path, capsys):
    model, _, _ = _hf_models()["llama"]
    model.save_pretrained(tmp_path / "llama")
    text = tmp_path / "calib.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 200)
    rc = main(
        [
            "convert",
            "--model",
            str(tmp_path / "llama"),
            "--to",
            "dyisru",
            "--calibrate",
            str(text),
            "--out",
            str(tmp_path / "out"),
            "--seq-len",
            "32",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "converted 5 norms of LlamaForCausalLM to dyisru" in out and "fidelity on" in out
    loaded, record = normlab.load_converted(tmp_path / "out")
    assert record.target == "dyisru" and (tmp_path / "out" / "fidelity.json").exists()


def test_derf_calibration_fits_alpha_and_its_shift():
    """A known Derf (alpha 0.7, shift 0.4) is recovered from its input and output by fit_replacement."""
    from normlab.conversion.calibrate.fit import fit_replacement

    torch.manual_seed(0)
    truth = normlab.create_norm("derf", 16, alpha_init=0.7, shift_init=0.4).double()
    x = torch.randn(512, 16, dtype=torch.float64) * 2
    with torch.no_grad():
        y = truth(x)
    new = normlab.create_norm("derf", 16)  # alpha 0.5, shift 0
    out = fit_replacement(new, x, y)
    assert out.ok and out.rel_error < 1e-6
    assert float(new.alpha) == pytest.approx(0.7, rel=1e-4) and float(new.shift) == pytest.approx(0.4, abs=1e-4)


def test_fit_status_says_how_much_of_the_target_a_fit_explains():
    from normlab.record import POOR_FIT, fit_status

    assert fit_status({"converged": True, "explained": 0.93}) == "ok"
    assert fit_status({"converged": True, "explained": POOR_FIT / 2}) == "poor fit (explains 10%)"
    assert fit_status({"converged": True, "explained": -0.4}) == "poor fit (explains 0%)"
    assert fit_status({"converged": False, "explained": 0.9}) == "FLAGGED"
    assert fit_status({"converged": True}) == "ok"  # records from before the field
    assert fit_status(None) == "not calibrated (default init)"  # issue 29: no fit is not an ok fit


def test_a_calibrated_fit_reports_the_variance_it_explains():
    """A DyISRU fitted to data made by a known DyISRU explains ~all of it; fitted to noise, next to none."""
    from normlab.conversion.calibrate.fit import fit_replacement

    torch.manual_seed(0)
    x = torch.randn(512, 16) * 3
    truth = normlab.create_norm("dyisru", 16, beta_init=9.0, kernel="reference").double()
    with torch.no_grad():
        y = truth(x.double())
    good = fit_replacement(normlab.create_norm("dyisru", 16, kernel="reference"), x, y)
    assert good.explained > 0.999
    noise = fit_replacement(normlab.create_norm("dyisru", 16, kernel="reference"), x, torch.randn(512, 16).double())
    assert noise.explained < 0.05


def test_an_extra_class_without_a_channel_count_is_an_error_not_a_wrong_skip():
    from torch import nn

    from normlab.conversion.convert import convert_norms

    class MyNorm(nn.Module):
        def forward(self, x):
            return x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()

    model = nn.Sequential(nn.Linear(4, 4), MyNorm())
    with pytest.raises(ValueError, match=r"extra_classes\[MyNorm\]: cannot convert 1: its channel count is unknown"):
        convert_norms(model, to="dyt", extra_classes={MyNorm: "rms_norm"})


def test_excluding_every_norm_says_so_not_that_the_model_has_none():
    """issue 50: --exclude '*' said the model had no norms."""
    model = tiny_lm()
    with pytest.raises(ValueError, match=r"every one of the 5 norms of LlamaForCausalLM is excluded"):
        normlab.convert_norms(model, "dyt", include=lambda name, m: False)


def test_fidelity_holds_one_batch_of_site_outputs_and_sums_in_chunks_yet_gives_the_whole_numbers(monkeypatch):
    """issue 66: `fidelity` sums each site's error batch by batch and the KL and cross-entropy ``ROWS`` rows at a
    time (a 152k vocabulary's logits and 49 sites' outputs no longer sit in memory whole); its numbers equal the
    ones computed on everything at once, here by hand."""
    import importlib

    from conftest import id_batches

    original = tiny_lm(layers=2)
    converted = copy.deepcopy(original)
    record = normlab.convert_norms(converted, "dyt", progress=False)
    held = id_batches(3, seed=4, t=40, batch=5)  # 200 rows a batch: with ROWS at 64, four chunks of the KL
    monkeypatch.setattr(importlib.import_module("normlab.conversion.measure.fidelity"), "ROWS", 64)
    got = normlab.fidelity(original, converted, held, record)
    outs = {"a": {}, "b": {}}
    hooks = []
    for k, m in (("a", original), ("b", converted)):
        for s in record.sites:
            keep = lambda mod, a, y, k=k, n=s.name: outs[k].setdefault(n, []).append(y)  # noqa: E731
            hooks.append(m.get_submodule(s.name).register_forward_hook(keep))
    with torch.no_grad():
        la = torch.cat([original(b).logits.reshape(-1, 100) for b in held])
        lb = torch.cat([converted(b).logits.reshape(-1, 100) for b in held])
    for h in hooks:
        h.remove()
    for s in record.sites:
        ya, yb = torch.cat(outs["a"][s.name]), torch.cat(outs["b"][s.name])
        assert got["sites"][s.name] == pytest.approx(float((yb - ya).norm() / ya.norm()), rel=1e-5)
    cos = torch.nn.functional.cosine_similarity(la, lb, dim=-1).mean()
    assert got["output_cosine"] == pytest.approx(float(cos), rel=1e-5)
    kl = torch.nn.functional.kl_div(lb.log_softmax(-1), la.log_softmax(-1), log_target=True, reduction="sum")
    assert got["kl"] == pytest.approx(float(kl) / len(la), rel=1e-5)
    ids = torch.cat(held)
    ce = torch.nn.functional.cross_entropy(la.reshape(*ids.shape, -1)[:, :-1].reshape(-1, 100), ids[:, 1:].reshape(-1))
    assert got["ce_original"] == pytest.approx(float(ce), rel=1e-5)


def test_a_running_mean_target_says_its_mean_is_a_placeholder_until_primed():
    """issue 65: --to rms_ema --no-calibrate gave no note that the running mean square stays at 1.0 until a forward
    in training mode (or prime_running_stats) sets it."""
    record = normlab.convert_norms(tiny_lm(), "rms_ema")
    assert record.sites and all(any("placeholder 1.0 until primed" in n for n in s.notes) for s in record.sites)
    assert not any("placeholder" in n for s in normlab.convert_norms(tiny_lm(), "dyt").sites for n in s.notes)
