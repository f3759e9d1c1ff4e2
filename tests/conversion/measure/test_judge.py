"""The statistics a converted model is judged by (normlab.conversion.measure.judge) against a hand computation, and the
report of normlab.conversion.measure.usage on a tiny model with a tokenizer."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from normlab.conversion.measure.judge import BINS, TokenTally, kl_rows


def _hand(a: np.ndarray, b: np.ndarray, ids: np.ndarray, start: int):
    """KL, same top-1 and the per-position CE gap, written from their definitions with NumPy in float64."""
    pa = np.exp(a - a.max(-1, keepdims=True))
    pa /= pa.sum(-1, keepdims=True)
    pb = np.exp(b - b.max(-1, keepdims=True))
    pb /= pb.sum(-1, keepdims=True)
    rows = range(max(start - 1, 0), len(a))
    kl = [float(np.sum(pa[t] * (np.log(pa[t]) - np.log(pb[t])))) for t in rows]
    same = [int(np.argmax(a[t]) == np.argmax(b[t])) for t in rows]
    gap = [float(-np.log(pb[t, ids[t + 1]]) + np.log(pa[t, ids[t + 1]])) for t in rows if t + 1 < len(ids)]
    return kl, same, gap


def test_the_statistics_equal_a_hand_computation():
    g = torch.Generator().manual_seed(0)
    seqs = []
    for t, start in ((300, 0), (12, 5), (40, 0)):  # a sequence past the first position bin, a chat item, a short one
        a = torch.randn(t, 17, generator=g) * 3
        b = a + torch.randn(t, 17, generator=g) * (0.5 if t != 40 else 4.0)
        seqs.append((a, b, torch.randint(0, 17, (t,), generator=g), start))
    tally = TokenTally()
    kls, sames, gaps, by_pos = [], [], [], {}
    for a, b, ids, start in seqs:
        tally.add(a, b, ids, start)
        kl, same, gap = _hand(a.double().numpy(), b.double().numpy(), ids.numpy(), start)
        kls += kl
        sames += same
        gaps.append(float(np.mean(gap)))
        for pos, v in zip(range(max(start - 1, 0), len(ids) - 1), gap):
            by_pos.setdefault(max(x for x in BINS if x <= pos), []).append(v)
    r = tally.result()
    assert r["tokens"] == len(kls) == 300 + 8 + 40
    assert r["kld"]["mean"] == pytest.approx(np.mean(kls), rel=1e-5)
    assert r["kld"]["median"] == pytest.approx(np.sort(kls)[(len(kls) - 1) // 2], rel=1e-5)  # torch: the lower one
    assert r["kld"]["p99"] == pytest.approx(np.quantile(kls, 0.99), rel=1e-5)
    assert r["kld"]["max"] == pytest.approx(max(kls), rel=1e-5)
    assert r["same_top1"] == pytest.approx(np.mean(sames))
    assert r["sequences"] == 3 and r["gap"]["worst"] == pytest.approx(max(gaps), rel=1e-5)
    assert r["gap"]["median"] == pytest.approx(sorted(gaps)[1], rel=1e-5)
    assert r["gap"]["over_2"] == sum(x > 2 for x in gaps)
    assert list(r["by_position"]) == ["0-127", "128-255", "256-511"]
    for (key, value), b0 in zip(r["by_position"].items(), sorted(by_pos)):
        assert value == pytest.approx(np.mean(by_pos[b0]), rel=1e-5), key
    assert r["nonfinite"] == 0


def test_positions_whose_logits_overflowed_are_counted_and_said():
    """issue 87: the linear target on SmolLM2 printed "nan" for docutils' every statistic: an activation overflowed
    at some positions, and nothing said so. They are counted, and the judgement's lines say it."""
    from normlab.conversion.measure.usage import usage_lines

    g = torch.Generator().manual_seed(0)
    a = torch.randn(20, 9, generator=g)
    b = a.clone()
    b[3:6] = float("inf")  # three positions overflowed
    tally = TokenTally()
    tally.add(a, b, torch.randint(0, 9, (20,), generator=g))
    r = tally.result()
    assert r["nonfinite"] == 3 and r["tokens"] == 20
    report = {"texts": {"held-out": r}, "stress": {}, "consistency": {"padded": 0.0, "kv_chunks": 0.0},
              "blowups": {"line": 3.0, "over": []}, "config": {"words": 6}}  # fmt: skip
    said = usage_lines(report)
    assert "held-out: the converted model's logits are not finite at 3 of 20 positions" in said, said


def test_kl_of_identical_rows_is_zero_and_never_negative():
    a = torch.randn(64, 50)
    assert torch.allclose(kl_rows(a, a), torch.zeros(64), atol=1e-6)
    assert bool((kl_rows(a, torch.randn(64, 50)) > 0).all())
    assert math.isinf(float(kl_rows(torch.tensor([[0.0, 0.0]]), torch.tensor([[0.0, -math.inf]]))[0]))


@pytest.fixture(scope="module")
def lm():
    """A tiny Llama with sinks, its tokenizer, and its held-out batches of real text."""
    import copy

    import normlab
    from conftest import TEXT, sink_batches, tiny_lm, tiny_tokenizer, with_sinks
    from normlab.conversion.data.texts import token_chunks

    tok = tiny_tokenizer()
    model = with_sinks(tiny_lm(seed=2, max_position_embeddings=4096))
    held = list(token_chunks(TEXT[-6000:], tok, 100, 32)[-8:].split(4))
    conv = copy.deepcopy(model)
    normlab.convert_norms(conv, "dyisru", calibrate=sink_batches(2), per="channel", progress=False)
    return model, conv, tok, held


def test_the_original_judged_against_itself_is_perfect(lm, tmp_path):
    """Every statistic of the report at its ideal: the texts, the chat set, the long sequences, the stress inputs and
    the greedy answers agree."""
    from conftest import TEXT
    from normlab.conversion.measure.usage import UsageConfig, usage_lines, usage_report

    model, _, tok, held = lm
    cfg = UsageConfig(prompts=4, new_tokens=8, long_tokens=256, long_sequences=2)
    r = usage_report(model, model, tok, {"held-out": held}, TEXT * 3, cfg)
    assert set(r["texts"]) == {"held-out", "chat"} and r["long"]["tokens"] == 512
    assert set(r["stress"]) >= {"leading newlines", "repeated delimiters", "code", "digits", "BOS mid-sequence",
                                "mid-text starts"}  # fmt: skip
    assert r["stress"]["mid-text starts"]["sequences"] == 32
    for t in [*r["texts"].values(), r["long"], *r["stress"].values()]:
        assert t["same_top1"] == 1.0 and t["kld"]["max"] < 1e-5 and abs(t["gap"]["worst"]) < 1e-5
    assert r["generation"]["chat_score"] == 1.0 and r["generation"]["prompts"] == 4
    assert r["generation"]["parted"] == {"answers": 0}
    assert r["generation"]["chat_interval"] == pytest.approx(_wilson(4, 4), abs=1e-4)
    assert r["consistency"]["padded"] < 1e-4 and r["consistency"]["kv_chunks"] < 1e-4
    assert r["blowups"]["over"] == []
    assert r["generation"]["loops"] == r["generation"]["loops_original"]
    text = usage_lines(r)
    assert "same top-1" in text and "blow-ups" in text and "Q: What is the capital of France?" in text
    assert f"end in a loop (the original: {r['generation']['loops_original']})" in text
    assert "(95% interval over prompts like these: 51%-100%)" in text


@pytest.mark.parametrize(
    ("ids", "looped"),
    [
        (list(range(30)), False),  # nothing repeats
        ([5, 6, 7] * 10, True),  # a block of 3, ten times
        (list(range(10)) + [1, 2, 3, 4] * 6 + [1, 2], True),  # entered after 10 tokens, ends mid-block
        (list(range(10, 19)) + [1, 2, 3, 4] * 3 + [1, 2, 3], False),  # the last 24 reach back before the loop
        ([7] * 23, False),  # shorter than the span
        ([7] * 24, True),  # one token, 24 times
        (list(range(9)) * 3, False),  # a block of 9: longer than a loop
        (list(range(8)) * 3, True),  # a block of 8, three times
    ],
)
def test_an_answer_ends_in_a_loop_when_its_last_24_tokens_repeat_a_short_block(ids, looped):
    from normlab.conversion.measure.usage import loops

    assert loops(torch.tensor(ids)) is looped


def _wilson(k: int, n: int, z: float = 1.959963984540054) -> list[float]:
    """Wilson's score interval by its formula (Wilson 1927): the centre pulled toward 1/2 by z^2 / 2n."""
    p, d = k / n, 1 + z * z / n
    centre, half = (p + z * z / (2 * n)) / d, z / d * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return [centre - half, centre + half]


@pytest.mark.parametrize("kept", [0, 10, 12, 24])
def test_the_chat_scores_interval_is_wilsons_by_hand(kept):
    """10 of 24 answers kept, the recommended recipe's score, is 24-61% over prompts like these: 50% inside."""
    from normlab.conversion.measure.usage import chat_interval

    assert chat_interval(kept, 24) == pytest.approx(_wilson(kept, 24), abs=1e-4)
    lo, hi = chat_interval(10, 24)
    assert lo < 0.5 < hi


def test_an_answer_parts_at_its_first_other_token_by_the_originals_own_preference(lm):
    """`parting` against a hand computation: the first index where the answers differ, and the original's log
    probability of its token less that of the other answer's, from a full forward pass in float64; answers that never
    differ before one ends do not part. The summary's medians (the lower of two middles) and near ties, by hand."""
    from normlab.conversion.measure.usage import NEAR_TIE, _parted, parting

    model, *_ = lm
    prompt, a, b = torch.tensor([3, 1, 4, 1]), torch.tensor([5, 9, 2, 6]), torch.tensor([5, 9, 7])
    r = parting(model, prompt, a, b)
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([[3, 1, 4, 1, 5, 9]])).logits[0, -1].double(), -1)
    assert r["token"] == 2 and r["margin"] == pytest.approx(float(lp[2] - lp[7]), abs=1e-5)
    assert parting(model, prompt, a, a) is None and parting(model, prompt, a, a[:2]) is None
    parts = [{"token": 1, "margin": 0.2}, {"token": 7, "margin": 1.0}, {"token": 3, "margin": NEAR_TIE - 0.1},
             {"token": 4, "margin": 2.0}]  # fmt: skip
    assert _parted(parts) == {"answers": 4, "token_median": 3.0, "margin_median": 0.4, "near_ties": 2}
    assert _parted([]) == {"answers": 0}


def test_the_mid_text_starts_begin_at_as_many_tokens_of_the_held_out_text():
    """A position rule or a heal that only saw some first tokens breaks on others: the stress windows start at
    `STARTS` offsets of the held-out text's end, each a 64-token piece of it."""
    from conftest import TEXT, tiny_tokenizer
    from normlab.conversion.measure.usage import STARTS, stress_items

    tok = tiny_tokenizer()
    windows = stress_items(tok, TEXT * 3, 100)["mid-text starts"]
    assert len(windows) == STARTS and all(len(w) == 64 for w in windows)
    assert len({tuple(w[:2].tolist()) for w in windows}) > STARTS // 2  # many different starts
    run = tok(TEXT * 3, add_special_tokens=False)["input_ids"]
    text = " ".join(map(str, run))
    assert all(" ".join(map(str, w.tolist())) in text for w in windows[1:])  # pieces of the text as tokenized


def test_a_converted_model_is_judged_and_its_report_is_consistent(lm):
    from conftest import TEXT
    from normlab.conversion.measure.usage import UsageConfig, usage_report

    model, conv, tok, held = lm
    cfg = UsageConfig(prompts=3, new_tokens=6, long_tokens=128, long_sequences=2)
    r = usage_report(model, conv, tok, {"held-out": held}, TEXT * 3, cfg)
    t = r["texts"]["held-out"]
    assert 0 < t["kld"]["median"] <= t["kld"]["p99"] <= t["kld"]["max"] and 0 <= t["same_top1"] <= 1
    assert t["gap"]["median"] <= t["gap"]["worst"]
    assert r["consistency"]["padded"] < 1e-4 and r["consistency"]["kv_chunks"] < 1e-4  # massive copies included
    assert len(r["generation"]["answers"]) == 3


def test_a_heal_that_raises_the_worst_sequence_is_not_kept(models, tmp_path, monkeypatch, capsys):
    """A heal whose mean may fall while its tail rises is not kept: here the heal is followed by a harm (every
    norm's gain times 5), which raises the worst validation sequence; the saved model is the calibrated one."""
    import normlab
    import normlab.conversion.workflow as workflow

    real = workflow.heal

    def harmful(original, net, *args, **kwargs):
        rep = real(original, net, *args, **kwargs)
        with torch.no_grad():
            for m in net.modules():
                if isinstance(m, normlab.DyISRU):
                    m.weight.mul_(5.0)
        return rep

    monkeypatch.setattr(workflow, "heal", harmful)
    from normlab.cli import main

    out = tmp_path / "o"
    argv = [
        "convert",
        "--model",
        str(models["m"]),
        "--calibrate",
        str(models["text"]),
        "--seq-len",
        "16",
        "--sequences",
        "4",
        "--eval-text",
        "none",
        "--no-progress",
        "--heal-tokens",
        "200",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    assert "heal not kept" in capsys.readouterr().out
    fid = json.loads((out / "fidelity.json").read_text())
    guard = fid["heal"]["guard"]
    assert guard["kept"] is False and any("worst sequence" in r for r in guard["rose"])
    assert fid["ce_converted"] == pytest.approx(fid["before_heal"]["ce_converted"], rel=1e-6)


def test_a_heal_that_lowers_the_tails_is_kept():
    from normlab.conversion.measure.judge import heal_verdict

    before = {"gap": {"worst": 2.0}, "kld": {"p99": 1.0, "mean": 0.3}}
    assert heal_verdict(before, {"gap": {"worst": 1.5}, "kld": {"p99": 0.9, "mean": 0.2}})["kept"]
    worse_tail = heal_verdict(before, {"gap": {"worst": 1.5}, "kld": {"p99": 1.2, "mean": 0.1}})
    assert not worse_tail["kept"] and worse_tail["rose"] == ["p99 KLD 1 -> 1.2"]
    assert not heal_verdict(before, {"gap": {"worst": float("nan")}, "kld": {"p99": 0.5, "mean": 0.1}})["kept"]


@pytest.mark.parametrize("which", ["original", "converted"])
def test_greedy_answers_decoded_together_are_each_prompts_own_greedy_continuation(lm, which):
    """The prompts of several lengths are left-padded into one batch: every answer token is, within float noise,
    the argmax of the model on that prompt alone with the answer so far (the converted model's massive copies
    included), an answer stops at and keeps the end token, and one that never meets it has every new token."""
    from normlab.conversion.measure.usage import greedy_answers

    model, conv, _, _ = lm
    net = model if which == "original" else conv
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 100, (n,), generator=g) for n in (3, 9, 17, 6)]
    with torch.no_grad():
        eos = int(net(prompts[1].reshape(1, -1)).logits[0, -1].argmax())  # the second prompt's first answer
    answers = greedy_answers(net, prompts, 7, eos)
    assert answers[1].tolist() == [eos]
    for p, a in zip(prompts, answers, strict=True):
        assert len(a) == 7 or a[-1] == eos
        assert eos not in a[:-1].tolist()
        with torch.no_grad():
            logits = net(torch.cat([p, a]).reshape(1, -1)).logits[0, len(p) - 1 : -1]
        picked = logits.gather(1, a.reshape(-1, 1))[:, 0]
        assert (picked >= logits.max(-1).values - 1e-4 * logits.abs().max()).all(), (p, a)


def test_the_measurement_pass_fills_the_judgement_of_the_same_texts(lm):
    """`fidelity(..., tally=)` adds every sequence of its batches to a `TokenTally` from the logits it already has:
    the statistics equal `judge_tokens`' own pass, sequence by sequence, within float noise, and `usage_report`
    reads a filled tally in place of the batches."""
    from conftest import TEXT
    from normlab.conversion.measure.fidelity import fidelity
    from normlab.conversion.measure.judge import judge_tokens
    from normlab.conversion.measure.usage import UsageConfig, usage_report

    model, conv, tok, held = lm
    tally = TokenTally()
    fidelity(model, conv, held, tally=tally)
    got, want = tally.result(), judge_tokens(model, conv, [(s, 0) for b in held for s in b])
    assert got["tokens"] == want["tokens"] == sum(b.numel() for b in held)
    assert got["same_top1"] == pytest.approx(want["same_top1"], abs=1.5 / want["tokens"])
    for key in ("mean", "median", "p99", "max"):
        assert got["kld"][key] == pytest.approx(want["kld"][key], rel=1e-4, abs=1e-6)
    for key in ("mean", "median", "worst"):
        assert got["gap"][key] == pytest.approx(want["gap"][key], rel=1e-4, abs=1e-5)
    cfg = UsageConfig(prompts=2, new_tokens=4, long_tokens=128, long_sequences=1)
    r = usage_report(model, conv, tok, {"held-out": tally}, TEXT * 3, cfg)
    assert r["texts"]["held-out"] == got


def test_a_sequences_logits_are_made_a_chunk_at_a_time_where_they_equal_the_models_own():
    """At 2,048 tokens a 152k vocabulary's logits are 1.2 GB per model: the judge makes them from the hidden states
    the output layer gets, a chunk of positions at a time. Where a model does more after its output layer (here, it
    scales its logits), the check on the first positions sees it, and the model's whole logits are used."""
    from conftest import tiny_lm
    from normlab.conversion.measure.judge import _HeadLogits, judge_tokens, sequence_logits

    model = tiny_lm(initializer_range=0.5)
    x = torch.randint(0, 100, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(x, use_cache=False).logits[0]
        got = sequence_logits(model, x)
        assert isinstance(got, _HeadLogits) and got.shape == tuple(want.shape)
        torch.testing.assert_close(torch.cat([got[i : i + 16] for i in range(0, 40, 16)]), want, rtol=1e-5, atol=1e-5)

    class Scaled(torch.nn.Module):  # a model whose logits are not its output layer's alone
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def get_output_embeddings(self):
            return self.inner.get_output_embeddings()

        def forward(self, ids, use_cache=False):
            out = self.inner(ids, use_cache=use_cache)
            out.logits = out.logits * 3.0
            return out

    scaled = Scaled(tiny_lm(initializer_range=0.5))
    with torch.no_grad():
        got = sequence_logits(scaled, x)
        assert isinstance(got, torch.Tensor)
        torch.testing.assert_close(got, scaled(x).logits[0])
        other = tiny_lm(seed=1, initializer_range=0.5)
        items = [(x[0], 0), (x[0, :20], 5)]
        stats = judge_tokens(model, other, items)
        tally = TokenTally()
        for ids, start in items:
            tally.add(model(ids[None]).logits[0], other(ids[None]).logits[0], ids, start)
    assert stats["kld"]["mean"] == pytest.approx(tally.result()["kld"]["mean"], rel=1e-5)
    assert stats["same_top1"] == tally.result()["same_top1"]


def test_two_conversions_answers_are_compared_prompt_by_prompt_as_mcnemars_exact_test():
    """The prompts both keep or both lose drop out; the rest is a fair coin under the null: 6 to 0 is
    2 * 0.5^6 = 0.03125, 2 to 1 is 1. The kept rule is the chat score's: the first words agree."""
    from normlab.conversion.measure.usage import kept_answers, paired_chat

    answers = [{"original": "The capital is Paris.", "converted": c} for c in
               ("The capital is Paris. More.", "The capital is Lyon.", "The  capital\nis Paris.")]  # fmt: skip
    assert kept_answers(answers, 4) == [True, False, True]  # "Paris." against "Lyon." at the fourth word
    assert kept_answers(answers, 3) == [True, True, True]
    assert paired_chat([True] * 6 + [False] * 4, [False] * 10) == {"only_first": 6, "only_second": 0, "p": 0.0312}
    assert paired_chat([True, True, False, False, True], [False, True, True, False, False]) == {
        "only_first": 2, "only_second": 1, "p": 1.0}  # fmt: skip
    assert paired_chat([True, False], [True, False])["p"] == 1.0
    with pytest.raises(ValueError, match="same prompts"):
        paired_chat([True], [True, False])


def test_the_prompts_are_distinct_and_the_judgements_first_24_stay_first():
    """Every recorded chat score read the first 24 prompts; ``normlab evaluate --prompts 96`` reads them all."""
    from normlab.conversion.measure.prompts import PROMPTS
    from normlab.conversion.measure.usage import UsageConfig

    assert len(set(PROMPTS)) == len(PROMPTS) == 96 and UsageConfig().prompts == 24
    assert PROMPTS[0] == "What is the capital of France?" and PROMPTS[23] == "How does a rainbow form?"
