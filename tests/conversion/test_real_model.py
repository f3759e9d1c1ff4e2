"""Conversion on a real pretrained model that nobody here trained: SmolLM2-135M-Instruct (61 RMSNorms).

The fixture comes from PyPI (normlab.conversion.data.fixtures.smollm2, cached under $NORMLAB_CACHE). Its activations
have what test models lack: first-token massive activations with an RMS two orders of magnitude above the median
token's.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

import normlab

pytest.importorskip("transformers")
pytest.importorskip("gguf")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    from normlab.conversion.data.fixtures import smollm2
    from normlab.conversion.data.models import load_model
    from normlab.conversion.data.texts import TextCut, text_batches
    from normlab.corpus import fetch_shakespeare

    model, tok = load_model(smollm2())
    cut = TextCut(seq_len=64, n_calib=4, n_held=4, batch_size=4)
    calib, held = text_batches(fetch_shakespeare(), tok, model.config.vocab_size, cut)
    return model, calib, held, tok


def test_smollm2_has_massive_first_token_activations(smollm2):
    from normlab.conversion.calibrate.massive import massive_ratio

    model, calib, _, _ = smollm2
    seen = {}
    h = model.model.layers[20].input_layernorm.register_forward_pre_hook(lambda m, a: seen.setdefault("x", a[0]))
    with torch.no_grad():
        model(calib[0])
    h.remove()
    assert massive_ratio(seen["x"]) > 50  # what the random test models never had


def test_calibrated_smollm2_beats_default_init_and_round_trips(smollm2, tmp_path):
    model, calib, held, tokenizer = smollm2
    ce = {}
    for how in ("default", "calibrated"):
        conv = copy.deepcopy(model)
        rec = normlab.convert_norms(conv, "dyisru", calibrate=calib if how == "calibrated" else None, progress=False)
        fid = normlab.fidelity(model, conv, held, rec)
        ce[how], ce["original"] = fid["ce_converted"], fid["ce_original"]
        if how == "calibrated":
            kept = [s["name"] for s in rec.skipped if "before the massive activation forms" in s["reason"]]
            norms = [n for n, m in model.named_modules() if type(m).__name__ == "LlamaRMSNorm"]
            assert 0 < len(kept) < 61 and kept == norms[: len(kept)]  # the blocks before the sink forms, in order
            assert len(rec.sites) == 61 - len(kept) and sum(s.massive is not None for s in rec.sites) >= 20
            assert all(math.isfinite(s.fit["rel_error"]) for s in rec.sites)
            # a model loaded from GGUF saves, with its tokenizer, into a folder both Hugging Face and normlab read
            normlab.save_converted(conv, rec, tmp_path / "m", tokenizer=tokenizer)
            loaded, _ = normlab.load_converted(tmp_path / "m")
            with torch.no_grad():
                torch.testing.assert_close(loaded(held[0]).logits, conv(held[0]).logits)
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(tmp_path / "m")
            text = "To be, or not to be"
            assert tok(text)["input_ids"] == tokenizer(text)["input_ids"]
            # the status says how much of each site's target its fit explains; a poor fit never reads plain "ok"
            from normlab.record import POOR_FIT, fit_status

            explained = [s.fit["explained"] for s in rec.sites]
            assert all(e is not None and math.isfinite(e) and e <= 1.0 for e in explained)
            for s in rec.sites:
                assert fit_status(s.fit) == "ok" or not s.fit["converged"] or s.fit["explained"] < POOR_FIT
                if s.fit["converged"] and s.fit["explained"] < POOR_FIT:
                    assert fit_status(s.fit).startswith("poor fit (explains")
            table = rec.table()
            assert "explains" in table
    assert math.isfinite(ce["calibrated"])
    assert ce["calibrated"] < ce["default"]
    assert ce["original"] < ce["calibrated"]


def test_derf_converts_smollm2_with_its_shift_fitted(smollm2):
    """Derf (newer than the seeds) as a conversion target on the real model: alpha and shift fitted per site. On the
    first 14 of 30 blocks (29 sites, the massive activation formed at block 12): the real weights and activations,
    in half the time of the whole model."""
    model, calib, held, _ = smollm2
    model = first_blocks(model, 14)
    ce = {}
    for how in ("default", "calibrated"):
        conv = copy.deepcopy(model)
        rec = normlab.convert_norms(conv, "derf", calibrate=calib if how == "calibrated" else None, progress=False)
        ce[how] = normlab.fidelity(model, conv, held, rec)["ce_converted"]
        if how == "calibrated":
            shifts = [float(m.shift.abs().max()) for m in conv.modules() if type(m).__name__ == "Derf"]
            assert len(shifts) >= len(rec.sites) and max(shifts) > 0  # the shift moved from its init somewhere
    assert math.isfinite(ce["calibrated"]) and ce["calibrated"] < ce["default"]


def test_smollm2_budget_nats_converts_only_what_fits(smollm2):
    """--budget-nats on the real model: the cheapest sites first, and the held-out cross-entropy of what it leaves
    never above the original's plus the budget; the rest stay RMSNorm. On the first 14 of 30 blocks (29 sites, the
    massive activation formed at block 12), whose walk ranks the same kinds of site in half the time."""
    from normlab.conversion.config import BudgetConfig
    from normlab.conversion.frontier import frontier
    from normlab.conversion.measure.fidelity import cross_entropy

    model, calib, held, _ = smollm2
    conv = first_blocks(model, 14)
    plain = BudgetConfig(nats=0.1, walk="stop", refit_every=0, rank_batches=1, precision="float32")  # the float32 check
    front, record = frontier(conv, "dyisru", calib, held, budget=plain, progress=False)
    assert 1 <= len(front.converted) < 29, front.curve
    assert cross_entropy(conv, held) <= front.ce_original + 0.1 + 1e-9
    assert {s.name for s in record.sites} == set(front.converted)
    kinds = {n: type(m).__name__ for n, m in conv.named_modules() if n.endswith("norm")}
    assert len(kinds) == 29 and sum(k == "LlamaRMSNorm" for k in kinds.values()) == 29 - len(front.converted)
    assert front.costs[front.order[0]] <= front.costs[front.order[-1]]


def test_smollm2_heal_on_the_stream_keeps_its_best_state(smollm2):
    """A short heal of the real model from the stream: fresh sequences only, a validation curve, the best point's
    state kept (the model's validation CE after the heal is the curve's minimum), LoRA merged away. On the first 14
    of 30 blocks."""
    from normlab.conversion.data.texts import TextCut, text_splits
    from normlab.conversion.measure.fidelity import cross_entropy
    from normlab.corpus import fetch_shakespeare

    model, _, _, tok = smollm2
    model = first_blocks(model, 14)
    cut = TextCut(seq_len=64, n_calib=4, n_held=4, n_val=4, batch_size=4)
    sp = text_splits(fetch_shakespeare(), tok, model.config.vocab_size, cut)
    conv = copy.deepcopy(model)
    rec = normlab.convert_norms(conv, "dyisru", calibrate=sp.calib, progress=False)
    rep = normlab.heal(
        model,
        conv,
        sp.stream,
        rec,
        val=sp.val,
        tokens=4 * 64 * 6,
        objective="distill",
        train="lora",
        batch_size=4,
        eval_every=4 * 64 * 2,
        progress=False,
    )
    assert rep.sequences == 24 and rep.stream_passes < 0.01 and rep.tokens == 4 * 64 * 6
    ces = [p["val_ce"] for p in rep.curve]
    assert len(ces) == 4 and rep.best["val_ce"] == min(ces)
    assert cross_entropy(conv, sp.val) == pytest.approx(min(ces), rel=1e-4)
    assert not any("lora" in n for n, _ in conv.named_modules())


def test_smollm2_folded_gives_the_same_logits_on_real_text(smollm2):
    """normlab.fold on the real model, every site converted to DyT with SmolLM2's own gammas: the 61 gammas go into
    q/k/v, gate/up and the tied head (untied first), and the held-out logits do not move. In float64: uncalibrated,
    this model is so ill-conditioned that a relative change of 1e-7 in one weight of layer 0 moves its float32
    logits by 2.6%, so float32 rounding alone would hide what the test checks."""
    model, _, held, _ = smollm2
    conv = copy.deepcopy(model).double()
    normlab.convert_norms(conv, "dyt", progress=False)
    with torch.no_grad():
        want = conv(held[0]).logits
    report = normlab.fold(conv, held[0])
    assert len(report.folded) == 61 and not report.skipped, report.table()
    assert report.untied == ["lm_head"] and not conv.config.tie_word_embeddings
    with torch.no_grad():
        got = conv(held[0]).logits
    assert float((got - want).abs().max()) <= 1e-4 * float(want.abs().max())


def test_converted_smollm2_loads_without_normlab(smollm2, tmp_path):
    """DyISRU per channel with massive-token copies, saved with its tokenizer: transformers alone (a process that
    cannot import normlab) builds it from the folder, with normlab's logits and greedy tokens."""
    from conftest import load_without_normlab

    model, calib, held, tokenizer = smollm2
    conv = copy.deepcopy(model)
    rec = normlab.convert_norms(conv, "dyisru", calibrate=calib, per="channel", progress=False)
    assert any(s.massive for s in rec.sites)
    folder = normlab.save_converted(conv, rec, tmp_path / "m", tokenizer=tokenizer)
    x = held[0][:2]
    for m in conv.modules():  # the reference path, as the folder's formulas are: fused kernels round differently
        if hasattr(m, "kernel"):
            m.kernel = "reference"
    with torch.no_grad():
        torch.save({"x": x, "y": conv(x).logits}, folder / "case.pt")
        greedy = conv.generate(x[:1, :4], max_new_tokens=6, do_sample=False).tolist()
    seen = load_without_normlab([(str(folder), "AutoModelForCausalLM", "logits")], tmp_path)
    assert seen["normlab_imported"] is False
    assert seen[str(folder)]["class"] == "NormlabLlamaForCausalLM"
    assert seen[str(folder)]["diff"] <= 1e-5, seen
    assert seen[str(folder)]["generated"] == greedy


def first_blocks(model, k: int):
    """A copy of ``model`` keeping its first ``k`` decoder blocks, then its final norm and head: the real weights
    and activations, at less depth."""
    net = copy.deepcopy(model)
    net.model.layers = net.model.layers[:k]
    net.config.num_hidden_layers = k
    return net


def test_converted_smollm2_exports_to_onnx_with_its_cache(smollm2, tmp_path):
    """DyISRU per channel with massive-token copies, folded and exported: ONNX Runtime's logits on held-out
    Shakespeare within float32 rounding of PyTorch's (1e-5 of the largest logit), and 32 greedy tokens decoded
    with the cache identical to generate's. On SmolLM2's first 14 of 30 blocks: the massive activation forms at
    block 12's input, so blocks 12-13 and the final norm convert, each with its massive-token copy (the branch
    ONNX runs as an If), after 24 sites kept as RMSNorm; every block exports as the others do, and the export's
    time grows with the blocks (the whole model took 290 s here, as long as the rest of this file)."""
    pytest.importorskip("onnxruntime", reason="the onnx extra is absent: pip install 'normlab[onnx]'")
    model, calib, held, _ = smollm2
    conv = first_blocks(model, 14)
    rec = normlab.convert_norms(conv, "dyisru", calibrate=calib, per="channel", progress=False)
    assert len(rec.sites) == 5 and all(s.massive for s in rec.sites) and len(rec.skipped) == 24, rec.table()
    report = normlab.export_onnx(conv, tmp_path / "smollm2.onnx", check=normlab.OnnxCheck(held[0][:2]))
    assert len(report.folded) == len(rec.sites) and report.layers == 14
    assert report.max_logit_difference <= 1e-5 * report.logit_scale, report.summary()
    assert report.greedy_tokens == 32 and report.greedy_equal, report.summary()
