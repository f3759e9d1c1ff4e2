"""Healing (normlab.conversion.heal: distill, loop, blocks, lora) and loading real models' files: mechanics and bad
input. Calibration's own tests are in calibrate/test_sites.py.

The mechanics run on tiny random Hugging Face models (no downloads); tests/conversion/test_real_model.py checks the
same code on a real pretrained model.
"""

from __future__ import annotations

import contextlib
import copy
import math

import pytest
import torch

import normlab
from conftest import heal_each_precision, id_batches, peaked_lm, tiny_lm, token_stream
from normlab.cli import main

transformers = pytest.importorskip("transformers")


# ------------------------------------------------------------------ healing
@pytest.mark.parametrize("train", ["norms", "lora"])
def test_a_distill_heal_resumed_from_its_small_checkpoint_ends_where_an_unbroken_one_does(train, tmp_path):
    """The checkpoint keeps the trained parameters (and the buffers normlab's modules hold), not the frozen
    weights, which a resume loads again; a heal stopped halfway and resumed ends bit for bit where one that ran
    through does."""
    original = tiny_lm(layers=2)

    def fresh():
        m = copy.deepcopy(original)
        rec = normlab.convert_norms(m, "dyisru", calibrate=id_batches(2))
        torch.manual_seed(0)  # LoRA's adapters start from the same draw in each heal
        return m, rec

    kw = {"val": id_batches(1, seed=9), "train": train, "eval_every": 2 * 4 * 16, "progress": False}
    whole, rec = fresh()
    normlab.heal(original, whole, token_stream(), rec, tokens=12 * 4 * 16, **kw)
    half, rec = fresh()
    ck = tmp_path / "heal.pt"
    normlab.heal(original, half, token_stream(), rec, tokens=6 * 4 * 16, checkpoint=ck, **kw)
    state = torch.load(ck, weights_only=False)
    saved, before = state["model"], state["report"]["seconds"]  # issue 65, G4: the checkpoint keeps its seconds
    frozen = {n for n, _ in original.named_parameters()} - {n for n in saved}
    assert "model.embed_tokens.weight" in frozen and "model.layers.0.mlp.up_proj.weight" in frozen
    assert any(n.endswith(".lora_a") for n in saved) == (train == "lora")
    resumed, rec = fresh()
    rep = normlab.heal(original, resumed, token_stream(), rec, tokens=12 * 4 * 16, checkpoint=ck, resume=True, **kw)
    assert rep.resumed_from == 6 * 4 * 16 and rep.seconds >= before > 0  # they go on: its tokens/s stays honest
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name


def test_a_heal_whose_validation_worsens_keeps_its_earlier_state():
    """The best-state rule. The validation text is the converted model's own greedy output (low CE for it),
    and the heal pulls it toward another model with other preferences: every later validation point is worse
    than the start, so the heal ends in the start state and its report says the start was kept."""
    model = peaked_lm(0)
    rec = normlab.convert_norms(model, "dyt", calibrate=id_batches(2))
    with torch.no_grad():
        own = model.generate(
            torch.arange(4)[:, None] * 11,
            max_new_tokens=15,
            do_sample=False,
            attention_mask=torch.ones(4, 1, dtype=torch.long),
            pad_token_id=0,
        )
    start = copy.deepcopy(model.state_dict())
    rep = normlab.heal(
        peaked_lm(1),
        model,
        token_stream(),
        rec,
        val=[own],
        tokens=4000,
        train="norms",
        lr=1e-2,
        eval_every=500,
        rollback_nats=None,  # the best-state rule alone
        progress=False,
    )
    later = [p["val_ce"] for p in rep.curve[1:]]
    assert later and all(ce > rep.curve[0]["val_ce"] + 0.1 for ce in later)  # it did get worse
    assert rep.best == rep.curve[0] and rep.best["tokens"] == 0
    for k, v in model.state_dict().items():
        assert torch.equal(v, start[k]), k


def test_a_heal_keeps_its_best_point_not_its_last():
    """Distillation from the default init improves the validation CE; the state kept is the curve's minimum, and
    the model's validation CE after the heal is that minimum's."""
    from normlab.conversion.measure.fidelity import cross_entropy

    original = tiny_lm()
    model = copy.deepcopy(original)
    rec = normlab.convert_norms(model, "dyt")  # default init: far from the original
    val = id_batches(1, seed=9)
    rep = normlab.heal(
        original,
        model,
        token_stream(),
        rec,
        val=val,
        tokens=6000,
        train="norms",
        lr=1e-2,
        eval_every=500,
        progress=False,
    )
    ces = [p["val_ce"] for p in rep.curve]
    assert min(ces) < ces[0]  # it learned
    assert rep.best["val_ce"] == min(ces) and [p["best"] for p in rep.curve].count(True) >= 1
    assert cross_entropy(model, val) == pytest.approx(min(ces), rel=1e-5)


@pytest.mark.parametrize("rollback_nats", [0.5, None])
def test_a_spike_rolls_back_to_the_best_state_and_halves_the_rate(rollback_nats):
    """A rate far too high makes the validation CE jump. With ``rollback_nats`` set, a point that far above the best
    restores the best state and halves the rate: the point is marked, the report counts it, and every later point
    records the halved rate; with None the heal never rolls back and keeps its rate."""
    original = peaked_lm(0)
    model = copy.deepcopy(original)
    rec = normlab.convert_norms(model, "dyt", calibrate=id_batches(2))
    lr = 0.1
    rep = normlab.heal(original, model, token_stream(), rec, val=id_batches(1, seed=9), tokens=3000, train="norms",
                       lr=lr, eval_every=128, rollback_nats=rollback_nats, progress=False)  # fmt: skip
    marked = [i for i, p in enumerate(rep.curve) if p.get("rollback")]
    assert rep.rollbacks == len(marked)
    best = [p["val_ce"] for p in rep.curve]
    for i in marked:
        assert rep.curve[i]["val_ce"] > min(best[:i]) + rollback_nats
    for i, p in enumerate(rep.curve[1:], 1):
        assert p["lr"] == pytest.approx(lr * 0.5 ** sum(j < i for j in marked))
    if rollback_nats is None:
        assert not marked
        assert max(best[1:]) > min(best) + 0.5  # the rate does spike: the rolled-back run is tested on a real spike
    else:
        assert marked


@pytest.mark.parametrize("grad_clip", [0, 1e-3])
def test_each_point_records_the_gradient_norm_and_heal_grad_clip_clips_it(grad_clip):
    """Each curve point records the largest gradient norm of its steps, before clipping; with ``grad_clip`` the
    step's gradient is scaled down to that norm (torch's clip_grad_norm_); with 0 it is left as it is."""
    original = peaked_lm(0)
    model = copy.deepcopy(original)
    rec = normlab.convert_norms(model, "dyt")
    rep = normlab.heal(original, model, token_stream(), rec, val=id_batches(1, seed=9), tokens=640, lr=1e-2,
                       eval_every=64, grad_clip=grad_clip, progress=False)  # fmt: skip
    norms = [p["grad_norm"] for p in rep.curve[1:]]  # one step (4 sequences of 16 tokens) per point
    assert len(norms) == 10 and all(math.isfinite(n) and n > 0 for n in norms)
    grads = [p.grad for p in model.parameters() if p.grad is not None]  # the last step's, as the optimizer saw them
    left = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
    if grad_clip == 0:  # 0 does not clip
        assert left == pytest.approx(norms[-1], rel=1e-5)
    else:
        assert norms[-1] > 10 * grad_clip and left == pytest.approx(grad_clip, rel=1e-4)


@pytest.mark.parametrize("train", ["norms", "lora", "all"])
def test_heal_distillation_lowers_validation_kl(train):
    original = peaked_lm(0)
    model = copy.deepcopy(original)
    rec = normlab.convert_norms(model, "dyt")  # default init: far from the original
    rep = normlab.heal(
        original,
        model,
        token_stream(),
        rec,
        val=id_batches(1, seed=9),
        tokens=4000,
        train=train,
        lr=1e-2 if train != "all" else 1e-3,
        eval_every=1000,
        progress=False,
    )
    assert min(p["val_kl"] for p in rep.curve[1:]) < 0.95 * rep.curve[0]["val_kl"]
    assert not any("lora" in n for n, _ in model.named_modules())  # LoRA merged into the weights


@pytest.mark.parametrize("train", ["lora", "all"])
def test_a_heal_leaves_an_original_that_shares_the_weights_as_it_was(train):
    """``normlab convert`` keeps the original as a copy sharing the weight matrices (`sharing_copy`). The heal
    changes those matrices (a LoRA merge, or training every weight), and the original must still give its own
    outputs afterwards; the healed model must have moved."""
    from normlab.conversion.batches import sharing_copy

    model = peaked_lm(0)
    original = sharing_copy(model)
    ids = id_batches(1, seed=9)[0]
    with torch.no_grad():
        before = original(ids).logits
    rec = normlab.convert_norms(model, "dyt")
    normlab.heal(original, model, token_stream(), rec, val=id_batches(1, seed=9), tokens=2000,
                 train=train, lr=1e-2 if train != "all" else 1e-3, eval_every=1000, progress=False)  # fmt: skip
    with torch.no_grad():
        torch.testing.assert_close(original(ids).logits, before, rtol=0, atol=0)
        moved = [n for n, p in model.model.layers.named_parameters() if p.dim() >= 2
                 and not torch.equal(p, original.model.layers.get_parameter(n))]  # fmt: skip
    assert moved  # the heal changed the block matrices of the model, not of the original


@pytest.mark.parametrize("top_k", [None, 8])
def test_a_step_taken_a_few_rows_at_a_time_is_the_whole_batchs_step(monkeypatch, top_k):
    """Under a large vocabulary a heal step runs its batch in parts of rows and accumulates their gradients
    (`normlab.conversion.batches.logit_rows`): the loss and every gradient must be the whole batch's. In float64,
    so that the order of the sums stays far below the check (in float32, 1 of 32 elements once differed by 5e-4
    relative on an Intel Xeon)."""
    from types import SimpleNamespace

    from normlab.conversion import batches
    from normlab.conversion.heal.distill import _accumulated
    from normlab.conversion.heal.teacher import TeacherCache

    original = peaked_lm(0).double()
    model = copy.deepcopy(original)
    normlab.convert_norms(model, "dyt")
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    run = SimpleNamespace(original=original, converted=model)
    ids = id_batches(1, seed=7, batch=5)[0]

    def step(limit):
        monkeypatch.setattr(batches, "LOGITS_PART_BYTES", limit)
        model.zero_grad(set_to_none=True)
        teacher = TeacherCache(original, top_k) if top_k is not None else None
        loss = _accumulated(run, teacher, ids, contextlib.nullcontext())
        return loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    whole, g_whole = step(2**40)
    parts, g_parts = step(2 * 16 * 100 * 8)  # two rows' float64 logits: parts of 2, 2 and 1 rows
    assert parts == pytest.approx(whole, rel=1e-12)
    assert g_whole and g_parts.keys() == g_whole.keys()
    for n, g in g_whole.items():
        assert g.dtype == torch.float64
        torch.testing.assert_close(g_parts[n], g, rtol=1e-10, atol=1e-13)


def test_the_stream_never_repeats_before_it_has_used_every_sequence_and_never_touches_held_out_text(tmp_path):
    """A text whose held-out end is marked with a byte found nowhere else: no stream or validation sequence ever
    holds it, every held-out sequence does, and the stream goes through all its sequences once before any
    comes back, in a new order each pass."""
    from normlab.conversion.data.texts import TextCut, text_splits

    g = torch.Generator().manual_seed(0)
    body = "".join(chr(97 + int(c)) for c in torch.randint(0, 26, (40_000,), generator=g))  # no two sequences alike
    held = "#" * (4 * 64)  # the marked part: exactly the 4 held-out sequences of 64 bytes
    path = tmp_path / "marked.txt"
    path.write_text(body + held)
    for text_len in (len(body), 47 * 64):  # a long text (tokenized at its two ends) and a short one
        path.write_text(body[:text_len] + held)
        sp = text_splits(path, None, 256, TextCut(seq_len=64, n_calib=4, n_held=4, n_val=2, batch_size=2))
        mark = ord("#")
        assert all((b == mark).all() for b in sp.held)
        assert not any((b == mark).any() for b in sp.val)
        assert not (sp.stream.chunks == mark).any()
        n = len(sp.stream)
        val_rows = {tuple(r.tolist()) for b in sp.val for r in b}
        assert not any(tuple(r.tolist()) in val_rows for r in sp.stream.chunks)
        first = sp.stream.next_indices(n)
        assert sorted(first.tolist()) == list(range(n))  # every sequence once before any repeat
        second = torch.cat([sp.stream.next_indices(3) for _ in range(math.ceil(n / 3))])[:n]
        assert sorted(second.tolist()) == list(range(n)) and not torch.equal(first, second)
        state = sp.stream.state()
        nxt = sp.stream.next_indices(5)
        sp.stream.load_state(state)  # resumes exactly
        assert torch.equal(sp.stream.next_indices(5), nxt)


@pytest.mark.parametrize("kw,match", [({"minutes": 0}, "budget must be a number > 0"),
                                      ({"tokens": -5}, "budget must be a number > 0"),
                                      ({}, "exactly one budget"), ({"minutes": 1, "tokens": 5}, "exactly one budget"),
                                      ({"tokens": 5, "train": "everything"}, "train must be"),
                                      ({"tokens": 5, "objective": "mse"}, "objective=...\\): the heal's objective"),
                                      ({"tokens": 5, "steps": 2}, "steps=...\\): converting in steps .* retired"),
                                      ({"tokens": 5, "schedule": "linear"}, "schedule must be"),
                                      ({"tokens": 5, "rollback_nats": 0}, "rollback_nats must be a finite number"),
                                      ({"tokens": 5, "rollback_nats": "1"}, "rollback_nats must be a number or null"),
                                      ({"tokens": 5, "rollback_nats": math.inf}, "rollback_nats must be a finite"),
                                      ({"tokens": 5, "grad_clip": -1.0}, "grad_clip must be a finite number >= 0"),
                                      ({"tokens": 5, "grad_clip": True}, "grad_clip must be a number, got True"),
                                      ({"tokens": 5, "resume": True}, "resume=True needs checkpoint"),
                                      ({"tokens": 5, "precision": "fp16"}, "precision must be 'auto', 'float32'"),
                                      ])  # fmt: skip
def test_heal_bad_input_is_clear(kw, match):
    original = tiny_lm()
    model = copy.deepcopy(original)
    rec = normlab.convert_norms(model, "dyt")
    with pytest.raises(ValueError, match=match):
        normlab.heal(original, model, id_batches(1), rec, **kw)


def test_heal_precision_auto_is_resolved_before_any_step_and_the_report_says_how(monkeypatch):
    """heal.precision=auto: float32 on a CPU without native bf16 (the steps as a float32 heal's, bit for bit), and
    the report says which arithmetic ran and why; float32 says so too."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    seen = {k: (rep, m.state_dict()) for k, (rep, m) in heal_each_precision(("auto", "float32"), 4, 256, 128).items()}
    assert seen["auto"][0].precision == "float32 (heal.precision=auto: this CPU has neither AVX512-BF16 nor AMX)"
    assert seen["float32"][0].precision == "float32 (heal.precision=float32)"
    assert [p["val_ce"] for p in seen["auto"][0].curve] == [p["val_ce"] for p in seen["float32"][0].curve]
    for name, t in seen["auto"][1].items():
        assert torch.equal(t, seen["float32"][1][name]), name


@pytest.mark.slow
def test_a_bf16_heal_trains_and_keeps_its_validation_in_float32():
    """heal.precision=bf16: each step under CPU autocast (in a process of its own with oneDNN below AMX: a bf16
    matmul with AMX dies with SIGILL on this VM); the heal lowers the validation cross-entropy like a float32 one,
    and the model it leaves is float32."""
    import json
    import os
    import subprocess
    import sys

    code = """
import json
from conftest import heal_each_precision
out = {k: {"curve": [p["val_ce"] for p in rep.curve], "dtype": str(next(model.parameters()).dtype)}
       for k, (rep, model) in heal_each_precision(("float32", "bf16"), 8, 1024, 256).items()}
print(json.dumps(out))
"""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", "PYTHONPATH": os.path.dirname(__file__) + "/../.."}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    for precision, got in seen.items():
        assert got["dtype"] == "torch.float32" and min(got["curve"][1:]) < got["curve"][0], (precision, got)
    assert abs(min(seen["bf16"]["curve"]) - min(seen["float32"]["curve"])) < 0.1 * seen["float32"]["curve"][0]


# ------------------------------------------------------------------ real-model loading: bad input
def test_model_folder_without_weights_gguf_without_tokenizer_and_short_text(tmp_path):
    from normlab.conversion.data.models import load_model
    from normlab.conversion.data.texts import TextCut, text_batches

    tiny_lm().config.save_pretrained(tmp_path / "noweights")
    with pytest.raises(ValueError, match="no weights"):
        load_model(tmp_path / "noweights")
    fake = tmp_path / "broken.gguf"
    fake.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 64)
    with pytest.raises(ValueError, match="no usable tokenizer"):
        load_model(fake)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nothing")
    short = tmp_path / "short.txt"
    short.write_text("too short")
    with pytest.raises(ValueError, match="too short for two sequences"):
        text_batches(short, None, 100, TextCut(seq_len=32))


def test_convert_command_never_writes_over_its_source(tmp_path, capsys):
    tiny_lm().save_pretrained(tmp_path / "llama")
    text = tmp_path / "calib.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 100)
    args = ["convert", "--model", str(tmp_path / "llama"), "--calibrate", str(text), "--seq-len", "16"]
    assert main([*args, "--out", str(tmp_path / "llama")]) == 2
    assert "write over or inside the source model" in capsys.readouterr().err
    assert main([*args, "--out", str(tmp_path / "llama" / "converted")]) == 2
    assert "write over or inside the source model" in capsys.readouterr().err
    (tmp_path / "taken").mkdir()
    assert main([*args, "--out", str(tmp_path / "taken")]) == 2
    assert "already exists" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="2"):  # refused by the parser, exit code 2
        main([*args, "--heal-tokens", "0"])
    assert "--heal-tokens: expected an int >= 1, got 0" in capsys.readouterr().err
    assert main([*args, "--seq-len", "0"]) == 2  # a sequence needs two tokens (one to predict from)
    assert "--seq-len must be >= 2, got 0" in capsys.readouterr().err
    rc = main(
        [*args, "--out", str(tmp_path / "healed"), "--heal-tokens", "2000", "--no-progress", "--exclude", "model.norm"]
    )
    out = capsys.readouterr().out
    assert rc == 0 and "healed (norms): " in out and "cross-entropy" in out
    assert (tmp_path / "healed" / "heal_curve.csv").read_text().startswith("tokens,seconds,train_loss,val_ce")
    assert (tmp_path / "healed" / "heal_curve.png").stat().st_size > 0
    loaded, record = normlab.load_converted(tmp_path / "healed")
    assert not (tmp_path / "healed.heal.pt").exists()  # the default heal checkpoint is removed once saved
    assert "model.norm" not in [s.name for s in record.sites] and len(record.sites) == 4


def test_heal_runs_on_gpt2_and_refuses_a_model_without_logits_before_any_step():
    """GPT-2 (blocks in transformer.h, LayerNorm) heals by distillation and its validation CE does not rise; BERT (an
    encoder: no logits, nothing to distill) is refused before any step, saying why."""
    t = transformers
    torch.manual_seed(0)
    original = t.GPT2LMHeadModel(t.GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=4, n_positions=64)).eval()
    model = copy.deepcopy(original)
    rec = normlab.convert_norms(model, "dyt")  # default init: room to heal
    rep = normlab.heal(original, model, token_stream(), rec, val=id_batches(1, seed=9), tokens=2 * 4 * 64 * 4,
                       lr=1e-2, progress=False)  # fmt: skip
    assert rep.best["val_ce"] < rep.curve[0]["val_ce"]
    bert = t.BertModel(
        t.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    ).eval()
    converted = copy.deepcopy(bert)
    rec = normlab.convert_norms(converted, "dyt")
    before = copy.deepcopy(converted.state_dict())
    with pytest.raises(ValueError, match="gives no logits, so there is nothing to distill"):
        normlab.heal(bert, converted, token_stream(), rec, tokens=2 * 64 * 20, progress=False)
    assert all(torch.equal(v, converted.state_dict()[k]) for k, v in before.items())
