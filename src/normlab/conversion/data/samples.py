"""A heal stream that needs no corpus: sequences sampled from the original model itself.

Distilling on a user's text teaches the converted model to behave like the original *on that text*; distilling on
the original's own samples teaches it to behave like the original wherever the original puts its probability.
`self_samples` draws them (ancestral sampling at temperature 1 by default, no top-k, no top-p, by a decode loop
over the model's forward with its KV cache, `SAMPLE_BATCH` sequences at a time: ``data.precision``). Each token is
a Gumbel-max draw, and a draw whose two best tokens are within `TIE` is decided again in float64, so a CPU's
rounding chooses no token: float32 samples are the same on every CPU (AVX2, AVX-512, none). How they begin is
`Starts`: by default (``data.starts = "varied"``) half are conversations through the model's chat template, a
quarter start at BOS and a quarter at a token drawn uniformly from the vocabulary, so the heal sees the model as a
user meets it and not only after BOS. They are cached on disk under their identity (the model's fingerprint, the
count, the length, the seed, the temperature, the starts, the batch, the precision), so a second heal of the same
model reads them back, and a changed setting samples afresh.

`normlab.conversion.data.streams` makes them the heal's, the walk's and the calibration's data.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import inspect
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from normlab.conversion.batches import cache_kwarg, model_device
from normlab.conversion.data.models import leading_bos
from normlab.corpus import cache_dir
from normlab.owner import hold

__all__ = [
    "self_samples",
    "sample_path",
    "SampleSet",
    "Starts",
    "sample_starts",
    "weights_fingerprint",
    "SAMPLES_VERSION",
]

SAMPLES_VERSION = 7  # bump when the sampling procedure changes, so old caches are not read as new (2: own decode loop,
# batches of SAMPLE_BATCH, one generator for the whole set; 3: inverse-CDF draws, the decode step's attention as two
# matmuls, the precision in the identity; 4: `Starts`, the kinds drawn apart and shuffled together; 5: a chat
# row's header follows only a drawn end of turn: 4 wrote headers back to back once the first one ended; 6: a free
# row's first token is never an end-of-sequence token; 7: Gumbel-max draws, a near tie decided in float64, so the
# tokens are the same on every CPU)
SAMPLE_BATCH = 256  # sequences decoded together (SmolLM2, bf16, 2 cores: 850 tokens/s at 256, 785 at 128)


def weights_fingerprint(model: nn.Module) -> str:
    """A content hash of every parameter and buffer (by name): samples are the model's, so any changed weight,
    a fine-tune that froze the embedding included, is another model.

    Args:
        model: The model hashed.
    """
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class Starts:
    """How the samples begin, by kind of row:

    * "chat": the chat template's opening (its system turn and a user header). The model writes the user's words;
      each time it ends a turn (draws ``turns[i][0]``, the end-of-turn token) the rest of the template's next header
      follows, the assistant's after a user turn and the user's after an assistant turn, so it answers its own
      question and goes on to a next one.
    * "bos": the BOS token, then free text (the model's end-of-sequence tokens masked, as for "free").
    * "free": one token drawn uniformly from the vocabulary but its end-of-sequence tokens, no BOS: as a chunk cut
      from the middle of a text starts (after BOS for a model whose tokenizer starts every text with it,
      ``always_bos``).

    ``shares`` gives each kind's part of a set.
    """

    bos: int | None
    chat: tuple[int, ...] = ()
    turns: tuple[tuple[int, ...], ...] = ()  # (a user turn's end + the assistant header, an answer's end + user header)
    varied: bool = True
    always_bos: bool = False

    def shares(self, seq_len: int) -> dict[str, float]:
        """Each kind's part of a set of ``seq_len``-token samples: "varied" gives half to "chat" (when the template's
        opening leaves at least half the length to write), and splits the rest between "bos" and "free"; otherwise
        every sample starts at BOS, or, without one, at a uniform token."""
        if not self.varied:
            return {"bos": 1.0} if self.bos is not None else {"free": 1.0}
        kinds = [k for k, ok in (("bos", self.bos is not None), ("free", True)) if ok]
        chat = 0.5 if self.chat and len(self.chat) <= seq_len // 2 else 0.0
        return ({"chat": chat} if chat else {}) | {k: (1 - chat) / len(kinds) for k in kinds}

    def identity(self) -> dict:
        return {"bos": self.bos, "chat": list(self.chat), "turns": [list(t) for t in self.turns],
                "varied": self.varied, "always_bos": self.always_bos}  # fmt: skip


def _chat_opening(tokenizer: object) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """The chat template's tokens up to a user's first words, and its two turn changes (a user turn's end and the
    assistant's header; an answer's end and the user's header), read by rendering a three-turn conversation with
    marker words. ((), ()) when the tokenizer has no template, or its turns do not end on one token."""
    if not getattr(tokenizer, "chat_template", None):
        return (), ()
    marks = ("NLMARKA", "NLMARKB", "NLMARKC")
    try:
        text = tokenizer.apply_chat_template(
            [{"role": r, "content": m} for r, m in zip(("user", "assistant", "user"), marks)], tokenize=False
        )
    except Exception:  # noqa: BLE001  (a template that wants other roles: no chat samples)
        return (), ()
    cut = [text.find(m) for m in marks]
    if min(cut) < 0 or cut != sorted(cut):
        return (), ()
    ids = [
        tuple(tokenizer(t, add_special_tokens=False)["input_ids"])
        for t in (text[: cut[0]], text[cut[0] + len(marks[0]) : cut[1]], text[cut[1] + len(marks[1]) : cut[2]])
    ]
    opening, *turns = ids
    if not opening or any(len(t) < 2 for t in turns) or turns[0][0] != turns[1][0]:
        return (), ()
    return opening, tuple(turns)


def sample_starts(tokenizer: object | None, varied: bool = True) -> Starts:
    """The `Starts` of a model's samples, read from its tokenizer (its BOS token and chat template).

    Args:
        tokenizer: The model's tokenizer, or None (uniform first tokens).
        varied: Mix the kinds (``data.starts = "varied"``); False starts every sample at BOS (``"bos"``).
    """
    bos = getattr(tokenizer, "bos_token_id", None) if tokenizer is not None else None
    chat, turns = _chat_opening(tokenizer) if varied and tokenizer is not None else ((), ())
    return Starts(bos, chat, turns, varied, always_bos=leading_bos(tokenizer) is not None)


@dataclass(frozen=True)
class SampleSet:
    """Which sample set: everything that changes the tokens drawn (the batch size too: one generator draws a whole
    batch per step). ``fingerprint`` names the model (its `weights_fingerprint`); ``starts`` says how sequences
    begin (`Starts`)."""

    fingerprint: str
    n: int
    seq_len: int
    starts: Starts
    seed: int = 0
    temperature: float = 1.0
    batch_size: int = SAMPLE_BATCH
    precision: Literal["float32", "bf16"] = "float32"  # the decode's arithmetic: bf16 autocasts the model's forward

    def identity(self) -> dict:
        """The cache's identity of the set (its file name is this dictionary's hash)."""
        return {"model_fingerprint": self.fingerprint, "n": self.n, "seq_len": self.seq_len, "seed": self.seed,
                "temperature": self.temperature, "starts": self.starts.identity(),
                "batch": self.batch_size or SAMPLE_BATCH, "precision": self.precision,
                "version": SAMPLES_VERSION}  # fmt: skip


def _sees_all(mask) -> bool:
    """Whether an attention mask lets every query see every key: a boolean one all True, an additive one all 0."""
    return bool(mask.all()) if mask.dtype == torch.bool else bool((mask == 0).all())


def _decode_attention(module, query, key, value, attention_mask, **kwargs):
    """Attention for one query position that sees every key (a decode step without padding), as two matmuls with the
    query heads grouped by their key/value head: SDPA's answer, faster on the CPU (bf16 SDPA spent 5.8 ms a layer at
    128 keys where this takes 0.4). Anything else (a prompt, a mask that hides keys, a soft cap, sinks) is SDPA's."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    b, h, q, d = query.shape
    kv = key.shape[1]
    extras = any(kwargs.get(k) is not None for k in ("softcap", "s_aux", "sinks", "position_bias"))
    if (
        q != 1
        or kwargs.get("dropout")
        or h % kv
        or extras
        or (attention_mask is not None and not _sees_all(attention_mask))
    ):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    scale = d**-0.5 if kwargs.get("scaling") is None else kwargs["scaling"]
    wide = torch.promote_types(query.dtype, torch.float32)  # bf16 scores in float32, float64 ones as they are
    w = torch.softmax((query.reshape(b, kv, h // kv, d) @ key.transpose(-1, -2)).to(wide) * scale, -1)
    out = (w.to(value.dtype) @ value).reshape(b, h, 1, value.shape[-1])
    return out.transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def _fast_decode(model: nn.Module):
    """``model`` with `_decode_attention` in place of SDPA while it decodes (a model on another attention, or one
    that cannot switch, is left as it is)."""
    was = getattr(getattr(model, "config", None), "_attn_implementation", None)
    switched = False
    if was == "sdpa" and hasattr(model, "set_attn_implementation"):
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

        AttentionInterface.register("normlab_decode", _decode_attention)
        AttentionMaskInterface.register("normlab_decode", ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
        try:
            model.set_attn_implementation("normlab_decode")
            switched = True
        except (ValueError, TypeError, AttributeError):
            pass
    try:
        yield model
    finally:
        if switched:
            model.set_attn_implementation(was)


TIE = 1e-3  # nats: a draw whose winner leads the runner-up by less is decided again in float64 (`_Decoder._exact`).
# SmolLM2's float32 logits differ between instruction sets (AVX2 and none, measured) by at most 1.9e-4 nats at a token
# of probability > 1e-5 (24 x 128 positions; median 1.7e-5), its float64 ones by at most 4.1e-6 (docs/healing.md)


def _gumbel(shape: tuple[int, int], gen: torch.Generator) -> torch.Tensor:
    """Uniforms for one Gumbel-max draw per row, (rows, vocabulary), float32 from ``gen``: the same numbers on every
    CPU (the generator's stream is serial)."""
    return torch.rand(shape, generator=gen)


def _pick(logits: torch.Tensor, u: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The token of each row by Gumbel-max, argmax(logits / temperature - log(-log u)), in ``logits``' dtype, and
    how far the winner leads the runner-up (nats; (rows,)). A draw from softmax(logits / temperature); unlike an
    inverse CDF, whose boundaries sum every earlier token's rounding, a token changes only where two tokens' own
    scores are within their rounding of each other, so the lead says which draws a last-bit difference can change."""
    scores = u.to(logits.dtype).log().neg_().log_().neg_()  # -log(-log u), in place: a 262k vocabulary's rows
    scores += logits if temperature == 1 else logits / temperature  # are 1 MB each (the same bits as a - b)
    top = scores.topk(2, -1)
    return top.indices[:, :1], top.values[:, 0] - top.values[:, 1]


def _draw_tokens(logits: torch.Tensor, temperature: float, gen: torch.Generator) -> torch.Tensor:
    """One token per row from softmax(logits / temperature) (`_pick` on fresh uniforms); a -inf token (a masked
    end-of-sequence) is never drawn.

    Args:
        logits: (rows, vocabulary).
        temperature: Of the softmax.
        gen: The generator the uniforms come from.
    """
    return _pick(logits, _gumbel(tuple(logits.shape), gen), temperature)[0]


class _Decoder:
    """Batches of one kind of `Starts` row, drawn by a plain decode loop: the model's forward with its KV cache,
    one token per step for the whole batch, from softmax(logits / temperature) by one generator (`_draw_tokens`; no
    top-k, no top-p). The model's end-of-sequence tokens are masked, as ``generate``'s ``min_new_tokens`` masks
    them, except a chat row's end-of-turn token, after which the template's next header is written in."""

    def __init__(self, model: nn.Module, which: SampleSet, gen: torch.Generator, bar) -> None:
        self.model, self.which, self.gen, self.bar = model, which, gen, bar
        self.vocab = model.get_input_embeddings().num_embeddings
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        eos = eos if isinstance(eos, (list, tuple)) else [eos]
        self.eos = [e for e in eos if isinstance(e, int) and 0 <= e < self.vocab]
        self.device, self.key = model_device(model), cache_kwarg(model)
        # the output layer on the last position alone: a chat opening's other positions cost a 262k vocabulary
        # 2.7x the pass (the stand-in, 16 rows x 40 tokens)
        self.last = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
        self.exact: nn.Module | None = None  # the float64 copy that decides near ties (`_exact`), made at the first
        self.exact_draws = 0

    def _opening(self, kind: str, b: int) -> torch.Tensor:
        starts = self.which.starts
        if kind == "chat":
            return torch.tensor(starts.chat, dtype=torch.long).expand(b, -1)[:, : self.which.seq_len]
        if kind == "bos":
            return torch.full((b, 1), starts.bos, dtype=torch.long)
        free = self._uniform(b)
        return torch.cat([torch.full((b, 1), starts.bos), free], 1) if starts.always_bos else free

    def _uniform(self, b: int) -> torch.Tensor:
        """``b`` tokens drawn uniformly from the vocabulary without its end-of-sequence tokens, (b, 1): a free row
        starts mid-text, never at an end."""
        allowed = torch.ones(self.vocab, dtype=torch.bool)
        allowed[self.eos] = False
        ids = allowed.nonzero()[:, 0]
        return ids[torch.randint(0, len(ids), (b, 1), generator=self.gen)]

    def _exact(self, prefix: torch.Tensor, u: torch.Tensor, masked: list[int]) -> torch.Tensor:
        """The tokens of the rows whose draw was within `TIE`: the same uniforms against the last logits of a
        float64 copy of the model over each row's whole prefix (no cache, no autocast), so that the rounding of
        one CPU's float32 arithmetic cannot choose them."""
        if self.exact is None:
            self.exact = copy.deepcopy(self.model)._apply(lambda t: t.double() if t.is_floating_point() else t)
        kind = self.device.type if self.device is not None else "cpu"
        with torch.autocast(kind, enabled=False):
            o = self.exact(input_ids=prefix.to(self.device), use_cache=False, **self.last)
        logits = o.logits[:, -1, : self.vocab].double().cpu()
        if masked:
            logits[:, masked] = -torch.inf
        self.exact_draws += len(prefix)
        self.bar.set_postfix(float64=self.exact_draws, refresh=False)
        return _pick(logits, u, self.which.temperature)[0]

    def batch(self, kind: str, b: int) -> torch.Tensor:
        """``b`` sequences of ``kind``, (b, seq_len)."""
        turns = self.which.starts.turns if kind == "chat" else ()
        end = turns[0][0] if turns else None
        masked = [e for e in self.eos if e != end]
        step = self._opening(kind, b)
        rows, cache, pending, turn = [step], None, {}, {}
        self.bar.update(step.numel())
        for _ in range(self.which.seq_len - step.shape[1]):
            o = self.model(input_ids=step.to(self.device), use_cache=True, **{self.key: cache}, **self.last)
            cache, logits = o[self.key], o.logits[:, -1, : self.vocab].float().cpu()  # drawn on the CPU: one generator
            if masked:
                logits[:, masked] = -torch.inf
            u = _gumbel(tuple(logits.shape), self.gen)
            step, lead = _pick(logits, u, self.which.temperature)
            if len(near := (lead < TIE).nonzero()[:, 0]):
                step[near] = self._exact(torch.cat(rows, 1)[near], u[near], masked)
            if end is not None:
                for r in sorted(set(pending) | set((step[:, 0] == end).nonzero()[:, 0].tolist())):
                    if r in pending:  # the template's header after a turn's end, token by token
                        step[r, 0] = pending[r].pop(0)
                        if not pending[r]:
                            del pending[r]
                    else:  # a turn ends: the next role's header follows
                        pending[r], turn[r] = list(turns[turn.get(r, 0) % 2][1:]), turn.get(r, 0) + 1
            rows.append(step)
            self.bar.update(b)
        return torch.cat(rows, 1)


def _kind_counts(starts: Starts, n: int, seq_len: int) -> list[tuple[str, int]]:
    """How many of ``n`` samples each kind of row gets (`Starts.shares`, rounded; the last kind takes the rest)."""
    shares, out, left = list(starts.shares(seq_len).items()), [], n
    for i, (kind, share) in enumerate(shares):
        count = left if i == len(shares) - 1 else min(left, round(n * share))
        out.append((kind, count))
        left -= count
    return [(k, c) for k, c in out if c]


def _draw(model: nn.Module, which: SampleSet, progress: bool) -> torch.Tensor:
    """Every kind's rows (`_kind_counts`), ``which.batch_size`` at a time by `_Decoder`, autocast to bf16 with
    ``which.precision``, then shuffled together by the same generator (so a validation tail holds every kind)."""
    if not hasattr(model, "generate"):
        raise ValueError(
            "data.heal=self samples from the original model's causal-LM forward with a KV cache; "
            f"{type(model).__name__} is not a Hugging Face causal LM: heal on a text instead (data.heal=text)"
        )
    gen = torch.Generator().manual_seed(which.seed)
    device = model_device(model)
    from tqdm.auto import tqdm

    bar = tqdm(
        total=which.n * which.seq_len,
        desc="sampling the original",
        unit="tok",
        unit_scale=True,
        disable=not progress,
        leave=False,
    )
    was = model.training
    model.eval()
    cast = torch.autocast(
        device.type if device is not None else "cpu", dtype=torch.bfloat16, enabled=which.precision == "bf16"
    )
    out, batch = [], which.batch_size or SAMPLE_BATCH
    try:
        with torch.no_grad(), _fast_decode(model), cast:
            decoder = _Decoder(model, which, gen, bar)
            for kind, count in _kind_counts(which.starts, which.n, which.seq_len):
                out += [decoder.batch(kind, min(batch, count - i)) for i in range(0, count, batch)]
    finally:
        model.train(was)
        bar.close()
    tokens = torch.cat(out)
    return tokens[torch.randperm(len(tokens), generator=gen)]


def sample_path(which: SampleSet, cache: Path | None = None) -> Path:
    """The cache file of a sample set (present once drawn).

    Args:
        which: The set.
        cache: The cache folder (default ``<normlab cache>/samples``).
    """
    key = hashlib.sha256(json.dumps(which.identity(), sort_keys=True).encode()).hexdigest()[:16]
    return (Path(cache) if cache is not None else cache_dir() / "samples") / f"samples-{key}.pt"


def self_samples(
    model: nn.Module, which: SampleSet, *, cache: Path | None = None, progress: bool = False
) -> torch.Tensor:
    """Sequences sampled from ``model``, read from the cache when a set with the same identity is there.

    The cache file is owned (locked) while it is written and replaced atomically; a second process that asks for
    the same set meanwhile waits for it and reads it, rather than failing after its own calibration or drawing it
    twice.

    Args:
        model: a Hugging Face causal LM (its forward with a KV cache draws the tokens).
        which: the set: the model's fingerprint, the count, the length, the starts, the seed, the
            temperature and the batch (`SampleSet`); its ``identity()`` names the cache file.
        cache: the cache folder (default ``<normlab cache>/samples``).
        progress: a progress bar, and a line with the tokens/s once drawn.

    Returns:
        The token ids, (n, seq_len).
    """
    ident = which.identity()
    n, seq_len = which.n, which.seq_len
    path = sample_path(which, cache)
    path.parent.mkdir(parents=True, exist_ok=True)
    with hold(path, "the sample cache", wait=True):  # another process drawing this set: wait, then read it
        if path.is_file():
            try:
                saved = torch.load(path, map_location="cpu", weights_only=True)
                if saved.get("identity") == ident and tuple(saved["tokens"].shape) == (n, seq_len):
                    tokens, vocab = saved["tokens"], model.get_input_embeddings().num_embeddings
                    if tokens.numel() == 0 or (int(tokens.min()) >= 0 and int(tokens.max()) < vocab):
                        return tokens  # else held over from another vocabulary: said, with the file, and drawn again
                    print(
                        f"the cached samples {path} hold ids outside the model's vocabulary of {vocab}: drawing "
                        "them again",
                        file=sys.stderr,
                    )
            except Exception:  # noqa: BLE001  (a damaged cache is drawn again)
                pass
        t0 = time.perf_counter()
        tokens = _draw(model, which, progress)
        seconds = time.perf_counter() - t0
        if progress:
            print(
                f"sampled {n:,} sequences of {seq_len} tokens from the original in {seconds / 60:.1f} min "
                f"({n * seq_len / seconds:.0f} tokens/s, {which.precision}); cached as {path}"
            )
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        torch.save({"identity": ident, "tokens": tokens}, tmp)
        os.replace(tmp, path)
    return tokens
