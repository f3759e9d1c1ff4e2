"""A converted language model judged as its user will use it (`usage_report`), against its original:

* **texts**: the per-token and per-sequence statistics of `normlab.conversion.measure.judge` on the held-out split, on a
  second text no stage saw (docutils by default) and on a **chat set**: `PROMPTS` through the model's chat template,
  with the original's own greedy answers as the reference, scored on the answers;
* **long context**: sequences of ``long_tokens`` (1,024 by default) from the held-out end of the text, with the gap
  by position;
* **generation**: both models' greedy answers to `PROMPTS`; the **chat score** is the share of answers whose first
  ``words`` words (6) are the original's. An answer that repeats the chat template's system prompt is counted, as is
  one that ends in a loop (`loops`), and where each answer parts from the original's (`parting`): at which token,
  and how sure the original was there;
* **stress**: inputs that break a position rule or a short calibration (`stress_items`): leading and repeated
  delimiters, a BOS mid-sequence, code, digits, long words, 2,048 tokens, and windows of the held-out text cut at
  32 offsets, so that 32 different tokens come first (the first position carries a massive activation whatever
  its token: the heal's guard found windows 5-28 nats off on models no other input broke); and the same sequence
  alone, left-padded in a batch with an attention mask, and split across calls with a KV cache, which must agree.

A **blow-up** is a sequence (of any text or stress input) whose gap is more than ``blowup`` (3) nats above the
median gap of the held-out split.
"""

from __future__ import annotations

import inspect
from dataclasses import asdict, dataclass
from statistics import median_low

import torch
from torch import Tensor, nn

from normlab.conversion.batches import cache_kwarg
from normlab.conversion.data.models import leading_bos
from normlab.conversion.data.texts import token_chunks
from normlab.conversion.measure.judge import TokenTally, judge_tokens
from normlab.conversion.measure.prompts import PROMPTS, answer_tokens, chat_prompts, greedy_answers
from normlab.table import format_table

__all__ = ["PROMPTS", "UsageConfig", "usage_report", "usage_lines", "stress_items", "greedy_answers", "answer_tokens",
           "parting",
           "chat_interval", "kept_answers", "paired_chat", "loops",
           "chat_prompts"]  # fmt: skip


NEAR_TIE = 0.5  # nats: an answer that parts where the original preferred its token by less parts on a near tie
STARTS = 32  # windows of the held-out text among the stress inputs, each starting at its own offset


@dataclass(frozen=True)
class UsageConfig:
    """What `usage_report` measures; the defaults are what ``normlab convert`` and ``normlab evaluate`` run."""

    prompts: int = 24
    """How many of `PROMPTS` the generation and the chat set use."""
    new_tokens: int = 48
    """Greedy tokens per answer."""
    words: int = 6
    """An answer scores when its first ``words`` words are the original's."""
    long_tokens: int = 1024
    """The length of the long-context sequences (capped by the model's positions)."""
    long_sequences: int = 4
    """How many long sequences."""
    blowup: float = 3.0
    """Nats above the held-out median gap that make a sequence a blow-up."""
    shown: int = 3
    """Answers shown side by side."""


def parting(original: nn.Module, prompt: Tensor, a: Tensor, b: Tensor) -> dict | None:
    """Where the answer ``b`` leaves the original's greedy answer ``a`` to ``prompt``, and by how much the original
    preferred its own token there: ``{"token": k, "margin": log p(a[k]) - log p(b[k])}`` under the original, in nats
    (>= 0 up to float noise: ``a[k]`` is its argmax). None when neither answer leaves the other before one ends.

    Args:
        original: The model whose greedy answer ``a`` is.
        prompt: The prompt's token ids (T,).
        a: The original's answer ids.
        b: The other answer's ids.
    """
    n = min(len(a), len(b))
    k = next((i for i in range(n) if a[i] != b[i]), None)
    if k is None:
        return None
    device = next(original.parameters()).device
    with torch.no_grad():
        logits = original(torch.cat([prompt, a[:k]])[None].to(device)).logits[0, -1].float()
    lp = torch.log_softmax(logits, -1).cpu()
    return {"token": k, "margin": float(lp[a[k]] - lp[b[k]])}


def _parted(parts: list[dict]) -> dict:
    """The partings' summary: how many, their median token and margin (the lower middle of an even count), and how
    many are near ties."""
    if not parts:
        return {"answers": 0}
    return {
        "answers": len(parts),
        "token_median": float(median_low(p["token"] for p in parts)),
        "margin_median": median_low(p["margin"] for p in parts),
        "near_ties": sum(p["margin"] < NEAR_TIE for p in parts),
    }


def kept_answers(answers: list[dict], words: int) -> list[bool]:
    """Which answers count toward the chat score: those whose first ``words`` words are the original's.

    Args:
        answers: The judgement's answers (``generation.answers``: each with "original" and "converted").
        words: How many first words must agree (the judgement's ``words``, 6).
    """
    return [a["original"].split()[:words] == a["converted"].split()[:words] for a in answers]


def paired_chat(first: list[bool], second: list[bool]) -> dict:
    """Two conversions' chat answers to the same prompts, compared prompt by prompt (McNemar's exact test, scipy's
    ``binomtest`` on the prompts where they differ): how many answers only the first keeps, how many only the
    second, and the two-sided p-value that they keep as many. Prompts both keep or both lose say nothing about which
    is better, so this is sharper than comparing two scores and their intervals.

    Args:
        first: `kept_answers` of one conversion.
        second: `kept_answers` of the other, on the same prompts.
    """
    if len(first) != len(second):
        raise ValueError(f"paired_chat: {len(first)} answers against {len(second)}: judge both on the same prompts")
    from scipy.stats import binomtest

    only = [sum(a and not b for a, b in zip(first, second)), sum(b and not a for a, b in zip(first, second))]
    p = binomtest(min(only), sum(only), 0.5).pvalue if sum(only) else 1.0
    return {"only_first": only[0], "only_second": only[1], "p": round(float(p), 4)}


def chat_interval(kept: int, prompts: int, level: float = 0.95) -> list[float]:
    """The chat score's interval at ``level`` over prompts like these (Wilson's score interval, scipy's): 24 prompts
    are a sample of what a user asks, and one answer moves the score by 4 points, so a score of 42% (10 of 24) is
    24-61% at 95%. It does not count how a score varies from one heal to another (its course), only which prompts
    were asked.

    Args:
        kept: The answers whose first words are the original's.
        prompts: The answers judged.
        level: The confidence level.
    """
    from scipy.stats import binomtest

    ci = binomtest(kept, prompts).proportion_ci(confidence_level=level, method="wilson")
    return [round(float(ci.low), 4), round(float(ci.high), 4)]


def _echoes(answer: str, system: str, n: int = 5) -> bool:
    """Whether ``answer`` repeats ``n`` consecutive words of the system prompt."""
    words, sys_text = answer.split(), " ".join(system.split())
    return any(" ".join(words[i : i + n]) in sys_text for i in range(max(len(words) - n + 1, 0))) if words else False


def loops(ids: Tensor, span: int = 24, longest: int = 8) -> bool:
    """Whether an answer ends in a loop: its last ``span`` tokens repeat one block of at most ``longest`` tokens (at
    least three times in a row, at any phase). Greedy decoding that enters a loop stays in it to the last token.

    Args:
        ids: The answer's token ids, (T,).
        span: How many of its last tokens must repeat.
        longest: The longest block counted as a loop.
    """
    t = ids.tolist()
    if len(t) < span:
        return False
    tail = t[-span:]
    return any(all(tail[i] == tail[i - p] for i in range(p, span)) for p in range(1, longest + 1))


def _generation(original, converted, tokenizer: object, cfg: UsageConfig, max_positions: int | None = None):
    """Both models' answers to the chat prompts, within the model's positions: the chat score, the system-prompt
    echoes, the shown answers; and the chat set's items (prompt + the original's answer, scored on the answer). A
    model whose positions the prompts fill gets a note instead of answers."""
    chat = chat_prompts(tokenizer, PROMPTS[: cfg.prompts])
    if chat is None:
        return None
    prompts, system = chat
    new_tokens = answer_tokens(prompts, cfg.new_tokens, max_positions)
    if new_tokens < 1:
        longest = max(len(p) for p in prompts)
        return {"skipped": f"the chat prompts take up to {longest} tokens, the model has {max_positions} positions"}, []
    eos = getattr(tokenizer, "eos_token_id", None)
    ref = greedy_answers(original, prompts, new_tokens, eos)
    got = greedy_answers(converted, prompts, new_tokens, eos)
    text = [[tokenizer.decode(a, skip_special_tokens=True).strip() for a in side] for side in (ref, got)]
    answers = [{"prompt": p, "original": a, "converted": b} for p, a, b in zip(PROMPTS, *text)]
    same = kept_answers(answers, cfg.words)
    parts = [m for m in (parting(original, p, a, b) for p, a, b in zip(prompts, ref, got)) if m is not None]
    result = {
        "prompts": len(prompts),
        "new_tokens": new_tokens,
        "chat_score": sum(same) / len(same),
        "chat_interval": chat_interval(sum(same), len(same)),
        "system_echoes": sum(_echoes(b, system) for b in text[1]),
        "system_echoes_original": sum(_echoes(a, system) for a in text[0]),
        "loops": sum(loops(b) for b in got),
        "loops_original": sum(loops(a) for a in ref),
        "parted": _parted(parts),
        "answers": answers,
    }
    items = [(torch.cat([p, a]), len(p)) for p, a in zip(prompts, ref) if len(a) > 1]
    return result, items


def _long(text: str, tokenizer: object, vocab: int, cfg: UsageConfig, max_positions: int | None) -> list | None:
    length = min(cfg.long_tokens, max_positions or cfg.long_tokens)
    span = 8 * length * (cfg.long_sequences + 1)  # characters: ample for that many tokens
    chunks = token_chunks(text[-span:], tokenizer, vocab, length)[-cfg.long_sequences :]
    return [(c, 0) for c in chunks] if len(chunks) else None


def stress_items(
    tokenizer: object, text: str, vocab: int, max_positions: int | None = None
) -> dict[str, Tensor | list[Tensor]]:
    """The stress inputs as token ids, each (T,) or a list of those: real text from the end of ``text`` with
    delimiters, a BOS mid-way, normlab's own source code, digits, long words, 2,048 tokens of the text (capped by the
    model's positions), and `STARTS` windows of 64 tokens cut from it at as many offsets (after the BOS, for a model
    whose tokenizer starts every text with one).

    Args:
        tokenizer: The model's tokenizer.
        text: The held-out text (its end is used).
        vocab: The model's vocabulary size.
        max_positions: The model's largest position, or None.
    """
    import normlab.functional.pointwise as code

    def ids(s: str) -> Tensor:
        return torch.tensor(tokenizer(s, add_special_tokens=False)["input_ids"], dtype=torch.long) % vocab

    tail = text[-4000:]
    prose = tail[tail.find("\n") + 1 :][:600]
    out = {
        "leading newlines": ids("\n\n" + prose)[:128],
        "repeated delimiters": ids(prose[:200] + "\n\n\n\n---\n\n###\n\n" + prose[200:])[:128],
        "code": ids(inspect.getsource(code))[:128],
        "digits": ids(" ".join(f"{i * 7919 % 100003}.{i % 97:02d}" for i in range(1, 80)))[:128],
        "long words": ids(" ".join(w * 2 for w in prose.split() if len(w) > 5))[:128],
    }
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None:
        p = ids(prose)[:127]
        out["BOS mid-sequence"] = torch.cat([p[:64], torch.tensor([bos]), p[64:]])
    run = ids(tail)
    step = max((len(run) - 64) // STARTS, 1)
    lead = leading_bos(tokenizer)
    out["mid-text starts"] = [
        torch.cat([torch.tensor([lead]), w[:63]]) if lead is not None else w
        for w in (run[o : o + 64] for o in range(0, step * STARTS, step))
        if len(w) == 64
    ]
    n = min(2048, max_positions or 2048)
    long = token_chunks(text[-16 * n :], tokenizer, vocab, n)
    if len(long):
        out[f"{n} tokens"] = long[-1]
    # within the model's positions (a GPT-2 of 128 has no 129th); a short or plain text can leave an input with
    # fewer than 2 tokens (no words over 5 letters): nothing to judge there
    cut = slice(0, max_positions)
    out = {k: v[cut] if isinstance(v, Tensor) else [w[cut] for w in v if len(w) > 1] for k, v in out.items()}
    return {k: v for k, v in out.items() if (len(v) > 1 if isinstance(v, Tensor) else v)}


def _consistency(model: nn.Module, ids: Tensor, pad: int) -> dict:
    """The largest logit difference, relative to the logits' scale, of ``ids`` (T,) left-padded by 5 tokens in a
    batch with an attention mask (and positions counted from the first real token, as ``generate`` counts them), and
    split across calls with a KV cache (a chunk of 16, then one token per call for
    4 tokens, then the rest), against the sequence alone."""
    device = next(model.parameters()).device
    x = ids.reshape(1, -1).to(device)
    with torch.no_grad():
        alone = model(x, use_cache=False).logits
        padded_ids = torch.cat([torch.full((1, 5), pad, device=device), x], 1)
        batch = torch.cat([padded_ids, x[:, :1].repeat(1, padded_ids.shape[1])])
        mask = torch.ones_like(batch)
        mask[0, :5] = 0
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # as generate gives them: GPT-2's table is absolute
        try:
            padded = model(batch, attention_mask=mask, position_ids=positions).logits[:1, 5:]
        except TypeError:  # a forward without position_ids
            padded = model(batch, attention_mask=mask).logits[:1, 5:]
        cuts, parts, past, start, key = [16, 17, 18, 19, 20], [], None, 0, cache_kwarg(model)
        for end in [c for c in cuts if c < x.shape[1]] + [x.shape[1]]:
            o = model(x[:, start:end], use_cache=True, **{key: past})
            parts.append(o.logits)
            past, start = o[key], end
        split = torch.cat(parts, 1)
    scale = float(alone.abs().max())
    return {
        "padded": float((padded - alone).abs().max()) / scale,
        "kv_chunks": float((split - alone).abs().max()) / scale,
    }


def usage_report(
    original: nn.Module,
    converted: nn.Module,
    tokenizer: object,
    texts: dict[str, list | TokenTally],
    held_text: str,
    cfg: UsageConfig = UsageConfig(),  # noqa: B008  (frozen)
) -> dict:
    """Every measurement of the module docstring; ``texts``: name -> held-out batches (B, T) of that text, or the
    `TokenTally` a pass over them already filled (`normlab.conversion.measure.fidelity.fidelity`'s ``tally``); the
    first is the held-out split, whose median gap sets the blow-up line. ``held_text`` is the text the long sequences
    and the stress inputs come from (its end).

    Args:
        original: The model before conversion.
        converted: The converted model.
        tokenizer: Their tokenizer (a transformers tokenizer).
        texts: Text name -> its held-out batches, or their filled `TokenTally`.
        held_text: The held-out text's string.
        cfg: What to measure.
    """
    vocab = converted.get_input_embeddings().num_embeddings
    max_positions = getattr(getattr(converted, "config", None), "max_position_embeddings", None)
    report: dict = {"config": asdict(cfg), "texts": {}}
    for name, batches in texts.items():
        if isinstance(batches, TokenTally):
            report["texts"][name] = batches.result()
        else:
            report["texts"][name] = judge_tokens(original, converted, [(s, 0) for b in batches for s in b])
    gen = _generation(original, converted, tokenizer, cfg, max_positions)
    if gen is not None and "skipped" in gen[0]:
        report["generation_skipped"] = gen[0]["skipped"]
    elif gen is not None:
        report["generation"], items = gen
        if items:
            report["texts"]["chat"] = judge_tokens(original, converted, items)
    long = _long(held_text, tokenizer, vocab, cfg, max_positions)
    if long:
        report["long"] = judge_tokens(original, converted, long)
    stress = stress_items(tokenizer, held_text, vocab, max_positions)
    report["stress"] = {
        k: judge_tokens(original, converted, [(v, 0)] if isinstance(v, Tensor) else [(w, 0) for w in v])
        for k, v in stress.items()
    }
    pad = getattr(tokenizer, "pad_token_id", None)  # outside the model's vocabulary (a tokenizer saved with more ids
    pad = pad if isinstance(pad, int) and 0 <= pad < vocab else 0  # than the model has) it is no token of the model
    if "leading newlines" in stress:  # padded by 5 tokens: within the positions
        report["consistency"] = _consistency(converted, stress["leading newlines"][: (max_positions or 10**9) - 5], pad)
    report["blowups"] = _blowups(report, cfg.blowup)
    return report


def _blowups(report: dict, nats: float) -> dict:
    """The sequences more than ``nats`` above the held-out split's median gap, per text and stress input."""
    first = next(iter(report["texts"].values()))
    line = first["gap"]["median"] + nats
    worst = {name: t["gap"]["worst"] for name, t in report["texts"].items()}
    worst |= {f"stress: {k}": t["gap"]["worst"] for k, t in report["stress"].items()}
    if "long" in report:
        worst["long"] = report["long"]["gap"]["worst"]
    return {"line": line, "over": sorted(k for k, w in worst.items() if not w <= line), "worst": max(worst.values())}


def usage_lines(report: dict, markdown: bool = False) -> str:
    """The report as the tables ``normlab convert`` and ``normlab evaluate`` print.

    Args:
        report: A `usage_report`.
        markdown: Print the tables as Markdown.
    """
    rows = []
    named = list(report["texts"].items())
    if "long" in report:
        t = report["long"]
        named.append((f"long ({t['tokens'] // max(t['sequences'], 1)} tokens)", t))
    for name, t in named:
        g, k = t.get("gap", {}), t["kld"]
        rows.append(
            [
                name,
                t["tokens"],
                f"{t['same_top1']:.1%}",
                f"{k['mean']:.3f}",
                f"{k['median']:.3f}",
                f"{k['p99']:.3f}",
                f"{k['max']:.2f}",
                _n(g.get("median")),
                _n(g.get("worst")),
                g.get("over_2", "-"),
            ]
        )
    head = ["text", "tokens", "same top-1", "KLD mean", "median", "p99", "max", "gap median", "worst seq.", "> +2"]
    out = [
        "judged as used (KL divergence to the original per token, nats; gap: CE over the original's per sequence)",
        format_table(head, rows, markdown),
    ]
    for name, t in named:
        if t.get("nonfinite"):
            out.append(
                f"{name}: the converted model's logits are not finite at {t['nonfinite']} of {t['tokens']} positions "
                "(an activation overflowed), so its statistics on this text read nan"
            )
    if "long" in report:
        out.append("gap by position: " + ", ".join(f"{k} {_n(v)}" for k, v in report["long"]["by_position"].items()))
    stress = ", ".join(f"{k} {_n(t['gap']['worst'])}" for k, t in report["stress"].items())
    c = report.get("consistency")
    both = f"; left-padded / KV-cache chunks vs alone: {c['padded']:.1e} / {c['kv_chunks']:.1e}" if c else ""
    out.append(f"stress inputs (gap): {stress}{both}" + (" of the logits' scale" if c else ""))
    b = report["blowups"]
    out.append(f"blow-ups (a sequence > {_n(b['line'])} nats): " + (", ".join(b["over"]) if b["over"] else "none"))
    if "generation_skipped" in report:
        out.append(f"generation: not judged ({report['generation_skipped']})")
    g = report.get("generation")
    if g:
        out.append(
            f"generation: {g['chat_score']:.0%} of {g['prompts']} greedy answers start with the original's "
            f"first {report['config']['words']} words{_interval(g)}; {g['system_echoes']} repeat the system prompt "
            f"(the original: {g['system_echoes_original']})"
            + (f"; {g['loops']} end in a loop (the original: {g['loops_original']})" if "loops" in g else "")
        )
        p = g.get("parted", {"answers": 0})
        if p["answers"]:
            out.append(
                f"  {p['answers']} of {g['prompts']} answers part from the original's within "
                f"{g.get('new_tokens', report['config']['new_tokens'])} tokens, at a median token "
                f"{p['token_median']:.0f}; there the "
                f"original preferred its token by a median {p['margin_median']:.2f} nats, by less than {NEAR_TIE} "
                f"in {p['near_ties']} (near ties)"
            )
        for a in g["answers"][: report["config"]["shown"]]:
            out.append(
                f"  Q: {a['prompt']}\n    original:  {_one_line(a['original'])}\n"
                f"    converted: {_one_line(a['converted'])}"
            )
    return "\n".join(out)


def _interval(g: dict) -> str:
    if "chat_interval" not in g:  # an evaluation.json written before 0.4.8
        return ""
    lo, hi = g["chat_interval"]
    return f" (95% interval over prompts like these: {lo:.0%}-{hi:.0%})"


def _n(v) -> str:
    return "-" if v is None else f"{v:+.2f}"


def _one_line(s: str, n: int = 110) -> str:
    s = " ".join(s.split())
    return s if len(s) <= n else s[: n - 3] + "..."
