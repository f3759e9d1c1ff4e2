"""The heal's own-sample stream (normlab.conversion.data.samples) and the second text every conversion is measured on:
samples reproducible from their seed and cached under their identity, the held-out text never in the heal's
data, a mixed stream that resumes exactly, a second text that never touches the heal."""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch

from conftest import tiny_hf, tiny_tokenizer
from normlab.cli import main
from normlab.conversion.config import DataConfig, resolve_convert_config
from normlab.conversion.data.samples import SampleSet, Starts, sample_starts, self_samples
from normlab.conversion.data.streams import MixedStream, calibration_samples, heal_splits, own_samples
from normlab.conversion.data.texts import TextSplits, TokenStream

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _own_sample_cache(tmp_path, monkeypatch):
    """The tiny models' sample sets go to the test's folder, never into the user's cache."""
    monkeypatch.setattr("normlab.conversion.data.samples.cache_dir", lambda: tmp_path / "normlab-cache")


@pytest.fixture()
def model(tmp_path):
    return transformers.LlamaForCausalLM.from_pretrained(tiny_hf(tmp_path / "m")).eval()


def _samples(model, cache, **kw):
    args = dict(n=6, seq_len=8, fingerprint="f", starts=Starts(1, varied=False), seed=0, batch_size=4)
    return self_samples(model, SampleSet(**{**args, **kw}), cache=cache)


def test_samples_are_reproducible_from_their_seed_and_read_back_from_the_cache(model, tmp_path, monkeypatch):
    a = _samples(model, tmp_path / "c1")
    assert a.shape == (6, 8) and a.dtype == torch.long and (a[:, 0] == 1).all()
    assert (a >= 0).all() and (a < 100).all()
    assert torch.equal(a, _samples(model, tmp_path / "c2"))  # drawn again elsewhere: the same tokens
    torch.manual_seed(123)
    outside = torch.rand(3)
    torch.manual_seed(123)
    _samples(model, tmp_path / "c3")
    assert torch.equal(torch.rand(3), outside)  # the caller's random state is left as it was
    assert not torch.equal(a, _samples(model, tmp_path / "c1", seed=1))  # another seed, other samples

    def refuse(*_a, **_k):
        raise AssertionError("sampled again instead of reading the cache")

    monkeypatch.setattr("normlab.conversion.data.samples._draw", refuse)
    assert torch.equal(a, _samples(model, tmp_path / "c1"))  # the same identity: read back
    with pytest.raises(AssertionError, match="sampled again"):
        _samples(model, tmp_path / "c1", fingerprint="another model")  # another identity is never read as this one


def test_a_second_process_waits_for_the_samples_being_drawn_and_reads_them(model, tmp_path, monkeypatch, capfd):
    """A heal started while another process draws the same sample set (a real process holding the cache's lock)
    waits for it, says so, and reads what it wrote: it neither fails after its calibration nor samples again."""
    import subprocess
    import sys
    import time

    a = _samples(model, tmp_path / "drawn")  # the set the other process will "finish" writing
    (drawn,) = (tmp_path / "drawn").glob("samples-*.pt")
    cache = tmp_path / "c"
    cache.mkdir()
    target, ready = cache / drawn.name, tmp_path / "ready"
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time, shutil, pathlib\n"
         "from normlab.owner import hold\n"
         "src, dst, ready = map(pathlib.Path, sys.argv[1:])\n"
         "with hold(dst, 'the sample cache'):\n"
         "    ready.touch()\n"
         "    time.sleep(1.5)\n"
         "    shutil.copy(src, dst)\n",
         str(drawn), str(target), str(ready)]
    )  # fmt: skip
    monkeypatch.setattr(
        "normlab.conversion.data.samples._draw", lambda *a, **k: pytest.fail("sampled again, not waiting")
    )
    try:
        while not ready.exists():
            assert holder.poll() is None, "the process holding the lock died"
            time.sleep(0.02)
        start = time.monotonic()
        b = _samples(model, cache)
        waited = time.monotonic() - start
    finally:
        holder.wait(timeout=30)
    assert waited > 0.5, f"did not wait for the process drawing the samples ({waited:.2f} s)"
    assert torch.equal(a, b)
    assert "waiting for the sample cache" in capfd.readouterr().err


def test_a_damaged_sample_cache_is_drawn_again(model, tmp_path):
    a = _samples(model, tmp_path)
    (cached,) = tmp_path.glob("samples-*.pt")
    cached.write_bytes(cached.read_bytes()[:50])
    assert torch.equal(a, _samples(model, tmp_path))
    assert not list(tmp_path.glob("*.tmp"))


def test_a_model_without_generate_is_refused_with_the_way_out(tmp_path):
    net = torch.nn.Sequential(torch.nn.Embedding(10, 4))
    net.get_input_embeddings = lambda: net[0]
    with pytest.raises(ValueError, match=r"not a Hugging Face causal LM: heal on a text instead \(data.heal=text\)"):
        self_samples(net, SampleSet("f", 2, 4, Starts(None)), cache=tmp_path)


def _stream(lo: int, n: int = 8, seq_len: int = 4) -> TokenStream:
    return TokenStream(torch.arange(lo, lo + n * seq_len).view(n, seq_len), seed=0)


def test_a_mixed_stream_draws_its_fraction_and_resumes_exactly():
    mix = MixedStream(_stream(0), _stream(1000), 0.25)
    batch = mix.next(8)
    assert (batch[:2] < 1000).all() and (batch[2:] >= 1000).all() and mix.drawn == 8
    state = json.loads(json.dumps(mix.state()))
    ahead = [mix.next(8) for _ in range(3)]
    again = MixedStream(_stream(0), _stream(1000), 0.25)
    again.load_state(state)
    assert all(torch.equal(x, again.next(8)) for x in ahead)
    with pytest.raises(ValueError, match="resume with the same data.self_fraction"):
        MixedStream(_stream(0), _stream(1000), 0.5).load_state(state)
    with pytest.raises(ValueError, match="sequence lengths differ"):
        MixedStream(_stream(0), _stream(0, seq_len=2), 0.5)


def test_the_held_out_text_never_reaches_the_heal(model, tmp_path):
    held = [torch.full((2, 8), 7)]
    splits = TextSplits([torch.zeros(2, 8, dtype=torch.long)], held, [torch.full((2, 8), 5)], _stream(0, seq_len=8))
    for text in ("self", "self+text"):
        cfg = resolve_convert_config(["heal.tokens=1000", f"data.heal={text}", "data.samples=16"]).data
        got = heal_splits(splits, model, cfg, starts=Starts(1, varied=False))
        assert got.held is held and got.calib is splits.calib  # measured on the same held-out text as before
        chunks = got.stream.chunks
        assert not any(torch.equal(row, h) for row in chunks for h in held[0])
        own = got.stream if text == "self" else got.stream.first
        assert len(own) == 14 and (own.chunks[:, 0] == 1).all()  # 16 samples, 2 validate
        val = torch.cat(got.val)
        assert not any(torch.equal(row, v) for row in own.chunks for v in val)  # validation is not trained on
        assert len(val) == (2 if text == "self" else 4)  # "self+text" validates on both
    assert heal_splits(splits, model, resolve_convert_config(["heal.tokens=1000"]).data, starts=Starts(1)) is splits


@pytest.mark.parametrize(("sets", "match"), [
    (["data.heal=self"], "--heal-text applies only to a heal"),
    (["heal.tokens=10", "data.heal=books"], "data.heal"),
    (["heal.tokens=10", "data.self_fraction=1"], r"data.self_fraction must be a number in \(0, 1\)"),
    (["heal.tokens=10", "data.temperature=0"], r"data.temperature must be a number in \(0, inf\)"),
    (["heal.tokens=10", "data.samples=1"], "data.samples must be an int >= 2"),
    (["data.judge=\"\""], "--eval-text must be 'docs', a text file, or none"),
    (["data.calibrate=books"], "--set data.calibrate must be 'text' or 'self', got 'books'"),
    (["data.calibrate=self", "calibrate.enabled=false"], "drop --no-calibrate"),
    (["data.calibrate=self", "data.samples=32"], "of the original's 32 samples, of which 28 are not"),
])  # fmt: skip
def test_the_sample_settings_are_checked(sets, match):
    with pytest.raises(ValueError, match=match):
        resolve_convert_config(sets)


def _convert(models, out, *extra):
    return [
        "convert", "--model", str(models["m"]), "--calibrate", str(models["text"]), "--seq-len", "16",
        "--sequences", "4", "--no-progress", "--to", "dyisru", "--out", str(out), *map(str, extra),
    ]  # fmt: skip


def test_the_second_text_is_measured_and_never_touches_the_heal(models, tmp_path, capsys):
    heal = ("--heal-tokens", 256, "--heal-text", "self+text", "--set", "data.samples=16")
    assert main(_convert(models, tmp_path / "a", *heal, "--eval-text", models["other"])) == 0
    out = capsys.readouterr().out
    assert "second text (other.txt, never calibrated or healed on), 4 held-out sequences" in out, out
    fid = json.loads((tmp_path / "a" / "fidelity.json").read_text())
    assert fid["second_text"]["name"] == "other.txt" and fid["before_heal"]["second_text"]["sequences"] == 4
    assert json.loads((tmp_path / "a" / "convert_config.json").read_text())["data"]["heal"] == "self+text"
    assert main(_convert(models, tmp_path / "b", *heal, "--eval-text", "none")) == 0
    assert "second_text" not in json.loads((tmp_path / "b" / "fidelity.json").read_text())
    a, b = ((tmp_path / d / "model.safetensors").read_bytes() for d in "ab")
    assert a == b  # the same healed weights either way


def test_a_missing_second_text_fails_before_any_work(models, tmp_path, capsys):
    assert main(_convert(models, tmp_path / "o", "--eval-text", tmp_path / "nope.txt")) == 2
    assert "--eval-text" in capsys.readouterr().err and not (tmp_path / "o").exists()


def test_calibration_on_the_models_own_samples_fits_on_them_and_is_measured_on_the_text(models, tmp_path, capsys):
    """``--calibrate-on self``: the sites are fitted on the first sequences of the original's samples (the set the
    heal's ``self`` stream reads), not on the text, and the text's held-out end still measures."""
    from normlab.conversion.convert import convert_norms
    from normlab.conversion.data.models import load_model
    from normlab.conversion.export.saving import load_converted

    sets = ("--set", "data.samples=16")
    assert main(_convert(models, tmp_path / "own", "--calibrate-on", "self", *sets)) == 0
    out = capsys.readouterr().out
    assert "calibrated on 4 sequences of the original's own samples" in out, out
    assert main(_convert(models, tmp_path / "text")) == 0
    assert "calibrated on 4 sequences from the text's start" in capsys.readouterr().out
    net, tok = load_model(str(models["m"]))
    cfg = resolve_convert_config(
        ["data.samples=16", "data.calibrate=self"], model=str(models["m"]), seq_len=16, sequences=4
    )
    calib = calibration_samples(net, cfg.data, 16, 4, starts=sample_starts(tok))
    assert sum(len(b) for b in calib) == 4
    convert_norms(net, "dyisru", calibrate=calib, progress=False)
    own = load_converted(tmp_path / "own")[0].state_dict()
    text = load_converted(tmp_path / "text")[0].state_dict()
    fitted = [k for k in own if "layernorm" in k or k.startswith("model.norm")]
    assert fitted and all(torch.equal(own[k], net.state_dict()[k]) for k in fitted)  # fitted on those samples
    assert any(not torch.equal(own[k], text[k]) for k in fitted)  # and not on the text
    fids = [json.loads((tmp_path / d / "fidelity.json").read_text()) for d in ("own", "text")]
    assert fids[0]["ce_original"] == fids[1]["ce_original"]  # the text's held-out end measures both
    assert json.loads((tmp_path / "own" / "convert_config.json").read_text())["data"]["calibrate"] == "self"


@pytest.mark.parametrize("calibrate_on", ["text", "self"])
def test_a_walk_on_the_models_own_samples_selects_on_the_samples_after_calibrations(
    models, tmp_path, capsys, calibrate_on
):
    """``--set data.walk=self``: the budget walk selects on ``sequences`` of the original's own samples, the first
    ones when calibration reads the text and the next ones when it reads the samples too; the saved model's KL to the
    original on exactly those is the one the walk recorded, and the printed walk and ``fidelity.json`` say so."""
    from normlab.conversion.data.models import load_model
    from normlab.conversion.export.saving import load_converted
    from normlab.conversion.measure.fidelity import ReferenceKL

    sets = ("budget.metric=kl", "data.walk=self", "budget.precision=float32", "data.samples=16")
    out = tmp_path / calibrate_on
    assert main(_convert(models, out, "--budget-nats", "0.5", "--calibrate-on", calibrate_on, "--set", *sets)) == 0
    printed = capsys.readouterr().out
    assert "(KL to the original on the 4 of the original's own samples that select them 0.000 ->" in printed, printed
    walk = json.loads((out / "fidelity.json").read_text())["budget_walk"]
    assert walk["text"] == "self" and walk["selection_sequences"] == 4 and 0 < walk["ce_converted"] <= 0.5
    net, tok = load_model(str(models["m"]))
    own = own_samples(net, DataConfig(samples=16), 16, starts=sample_starts(tok))  # the run's, cached
    at = 4 if calibrate_on == "self" else 0
    kl = ReferenceKL()
    kl(net, [own[at : at + 4]])
    assert kl(load_converted(out)[0], [own[at : at + 4]]) == pytest.approx(walk["ce_converted"], rel=1e-3)
    other = 4 - at  # the other four: not what the walk measured
    kl = ReferenceKL()
    kl(net, [own[other : other + 4]])
    assert kl(load_converted(out)[0], [own[other : other + 4]]) != pytest.approx(walk["ce_converted"], rel=1e-3)


@pytest.mark.parametrize(
    ("sets", "error"),
    [
        (["data.walk=self"], "--set data.walk applies only with --budget-nats"),
        (["data.walk=book"], "--set data.walk must be 'text' or 'self', got 'book'"),
        (["budget.nats=0.1", "data.walk=self", "data.calibrate=self", "data.samples=8", "sequences=4"],
         "--calibrate-on and --set data.walk self read --sequences (4) each of the original's 8 samples, of which 7"),
    ],
)  # fmt: skip
def test_a_walk_on_samples_that_are_too_few_or_have_no_budget_is_refused_before_any_work(sets, error, models):
    with pytest.raises(ValueError, match=re.escape(error)):
        resolve_convert_config(sets, model=str(models["m"]), seq_len=16)


@pytest.mark.parametrize("family", ["Llama", "Qwen3", "Gemma3"])
def test_the_decode_steps_attention_gives_sdpas_logits_and_is_put_back(family):
    """issue 48: `_fast_decode` replaces SDPA by two grouped matmuls for a one-token step that sees every key; each
    step's logits equal SDPA's (GQA: 4 heads on 2 key-value heads; Gemma3's sliding window, 6 tokens here, hides
    keys from step 7 on, where SDPA answers), and the model's attention is SDPA again after."""
    from conftest import tiny_lm
    from normlab.conversion.batches import cache_kwarg
    from normlab.conversion.data.samples import _fast_decode

    model = tiny_lm(family, layers=2, sliding_window=6) if family == "Gemma3" else tiny_lm(family, layers=2)
    model.set_attn_implementation("sdpa")
    key = cache_kwarg(model)

    def decode(steps=10):
        step, cache, out = torch.full((3, 1), 1), None, []
        with torch.no_grad():
            for i in range(steps):
                o = model(input_ids=step, use_cache=True, **{key: cache})
                cache, logits = o[key], o.logits[:, -1]
                out.append(logits)
                step = torch.tensor([[(7 * i + r) % 100] for r in range(3)])
        return torch.stack(out)

    plain = decode()
    with _fast_decode(model):
        assert model.config._attn_implementation == "normlab_decode"
        fast = decode()
    assert model.config._attn_implementation == "sdpa"
    torch.testing.assert_close(fast, plain, atol=1e-5, rtol=1e-5)
    assert not torch.equal(fast[1:6], plain[1:6])  # the matmuls ran: equal up to rounding, not bit for bit


def test_the_gumbel_max_draw_follows_the_softmax_and_never_draws_a_masked_token():
    """`_draw_tokens`: 40,000 draws from one row's softmax(logits / T) land on each token at its probability (within
    five standard errors), and a -inf token (a masked end-of-sequence) is never drawn."""
    from normlab.conversion.data.samples import _draw_tokens

    logits = torch.tensor([0.0, 1.0, -torch.inf, 2.0, -1.0])
    n, temperature = 40_000, 1.5
    got = _draw_tokens(logits.expand(n, -1).clone(), temperature, torch.Generator().manual_seed(0))
    assert got.shape == (n, 1)
    freq = torch.bincount(got[:, 0], minlength=5).double() / n
    p = torch.softmax(logits.double() / temperature, -1)
    assert freq[2] == 0 and (freq - p).abs().max() < 5 * (p * (1 - p) / n).sqrt().max()


def test_a_near_tie_is_decided_by_the_model_in_float64(model, monkeypatch):
    """issue 99: a draw whose two best tokens are within `TIE` is decided again by a float64 copy of the model over
    the whole prefix, with the same uniforms. With every draw called a tie, the float32 model's samples are the
    float64 model's own (drawn with no tie-break) token for token; the model itself stays float32."""
    from normlab.conversion.data import samples

    which = SampleSet("f", 6, 12, Starts(1, varied=False), seed=0, batch_size=4)
    wide = samples._draw(copy.deepcopy(model).double(), which, False)
    monkeypatch.setattr(samples, "TIE", float("inf"))
    decided, exact = [], samples._Decoder._exact

    def spy(self, prefix, u, masked):
        decided.append(len(prefix))
        return exact(self, prefix, u, masked)

    monkeypatch.setattr(samples._Decoder, "_exact", spy)
    assert torch.equal(samples._draw(model, which, False), wide)
    assert sum(decided) == 6 * 11  # every draw after BOS went to float64
    assert next(model.parameters()).dtype == torch.float32


def test_the_sample_precision_names_the_set_and_bad_values_are_refused(model, tmp_path):
    """data.precision: bf16 samples are another set (another cache file) than float32 ones; a bad value is
    refused naming the field."""
    a = SampleSet("f", 6, 8, Starts(1)).identity()
    assert a["precision"] == "float32" and SampleSet("f", 6, 8, Starts(1), precision="bf16").identity() != a
    with pytest.raises(ValueError, match="data.precision"):
        resolve_convert_config(["data.precision=fp16"])


def test_varied_samples_hold_chats_through_the_template_and_other_starts(model, tmp_path):
    """issue 64: `data.starts = "varied"`. Half the samples open with the chat template's system turn and a user
    header; each time such a row draws the end-of-turn token, the template's next header follows token for token
    (the assistant's after a user turn, the user's after an answer). A quarter start at BOS, a quarter at a uniform
    token; the end-of-sequence token is masked outside the chats. "bos" starts every sample at BOS."""
    tok = tiny_tokenizer()
    model.generation_config.eos_token_id = tok.eos_token_id
    starts = sample_starts(tok)
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert list(starts.chat) == tok(rendered[: rendered.index("hi")], add_special_tokens=False)["input_ids"]
    assert [tok.decode(t) for t in starts.turns] == ["</s>\n<s>assistant\n", "</s>\n<s>user\n"]
    n, seq_len, end = 32, 4 * len(starts.chat), tok.eos_token_id
    assert starts.shares(seq_len) == {"chat": 0.5, "bos": 0.25, "free": 0.25}
    # a temperature of 50 draws nearly uniformly, so the end-of-turn token comes up often in 32 rows
    got = self_samples(model, SampleSet("f", n, seq_len, starts, temperature=50.0, batch_size=8), cache=tmp_path)
    chat = [r for r in got.tolist() if r[: len(starts.chat)] == list(starts.chat)]
    first = [r[0] for r in got.tolist()]
    assert len(chat) == n // 2 and first.count(tok.bos_token_id) >= n // 2 + n // 4  # a uniform first token may be BOS
    assert sum(t != tok.bos_token_id for t in first) >= n // 8  # the free quarter starts elsewhere
    turns = 0
    for row in chat:
        i, k = len(starts.chat), 0
        while i < seq_len:
            if row[i] == end:
                header = list(starts.turns[k % 2][1:])
                assert row[i + 1 : i + 1 + len(header)] == header[: seq_len - i - 1], (row, i)
                i, k, turns = i + 1 + len(header), k + 1, turns + 1
            else:
                i += 1
    assert turns >= 4, "too few turn ends to check the headers"
    others = [r for r in got.tolist() if r not in chat]
    assert all(end not in r for r in others)  # outside a chat the end-of-sequence token is never drawn
    assert got[: n // 2, 0].unique().numel() > 1  # the kinds are shuffled together
    plain = sample_starts(tok, varied=False)
    assert plain.shares(seq_len) == {"bos": 1.0}
    assert SampleSet("f", n, seq_len, plain).identity() != SampleSet("f", n, seq_len, starts).identity()
    short = self_samples(model, SampleSet("f", 4, 8, plain), cache=tmp_path)
    assert (short[:, 0] == tok.bos_token_id).all()
    assert sample_starts(None).shares(16) == {"free": 1.0} and not sample_starts(None).chat
    always = Starts(tok.bos_token_id, always_bos=True)  # a tokenizer that starts every text with BOS (issue 66)
    rows = self_samples(model, SampleSet("f", 8, 8, always, temperature=50.0), cache=tmp_path)
    assert (rows[:, 0] == tok.bos_token_id).all() and rows[:, 1].unique().numel() > 1


def test_a_free_row_never_starts_at_an_end_of_sequence_token(model, tmp_path):
    """A "free" row starts at a token drawn uniformly from the vocabulary but its end-of-sequence tokens (a CI run
    drew the tiny tokenizer's EOS, 1 in 100, as a free row's first token). With every id but 0 and 99 an end, every
    first token is one of those two, and both come up."""
    vocab = model.get_input_embeddings().num_embeddings
    model.generation_config.eos_token_id = list(range(1, vocab - 1))
    got = self_samples(model, SampleSet("f", 16, 2, Starts(None, varied=False), seed=3), cache=tmp_path)
    assert set(got[:, 0].tolist()) == {0, vocab - 1}
    assert all(t in (0, vocab - 1) for t in got[:, 1].tolist())  # the end tokens stay masked after the start


def test_a_walk_then_a_heal_keeps_the_walks_record_beside_the_heals(models, tmp_path):
    """``fidelity.json`` of a budget walk followed by a heal records both: the walk (``budget_walk``, as without a
    heal) and the heal, with the measurement before it."""
    out = tmp_path / "both"
    heal = ("--heal-tokens", 256, "--heal-text", "self", "--set", "data.samples=16")
    assert main(_convert(models, out, "--budget-nats", "0.5", *heal)) == 0
    fid = json.loads((out / "fidelity.json").read_text())
    assert fid["budget_walk"]["budget_nats"] == 0.5 and fid["budget_walk"]["converted"] == len(fid["sites"])
    assert fid["heal"]["tokens"] >= 256 and "ce_converted" in fid["before_heal"]


def test_a_cached_set_from_another_vocabulary_is_named_and_drawn_again(model, tmp_path, capsys):
    """issue 85: a held-over cache whose ids lie outside the model's vocabulary failed later as "calibration batch
    0 could not be run", after the measurement, naming no file. It is now named and drawn again at once."""
    a = _samples(model, tmp_path)
    (cached,) = tmp_path.glob("samples-*.pt")
    saved = torch.load(cached, weights_only=True)
    vocab = model.get_input_embeddings().num_embeddings
    torch.save({**saved, "tokens": saved["tokens"] + vocab}, cached)  # the same identity, ids past the vocabulary
    capsys.readouterr()
    assert torch.equal(a, _samples(model, tmp_path))
    err = capsys.readouterr().err
    assert f"the cached samples {cached} hold ids outside the model's vocabulary of {vocab}" in err, err
