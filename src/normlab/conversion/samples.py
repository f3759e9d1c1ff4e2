"""A heal stream that needs no corpus: sequences sampled from the original model itself.

Distilling on a user's text teaches the converted model to behave like the original *on that text*; distilling on
the original's own samples teaches it to behave like the original wherever the original puts its probability.
`self_samples` draws them (ancestral sampling at temperature 1 by default, no top-k, no top-p, by a decode loop
over the model's forward with its KV cache, `SAMPLE_BATCH` sequences at a time, in bf16 where the device runs it
natively: ``heal.sample_precision``), each sequence started from the model's BOS token, or, for a model without
one, from a token drawn uniformly from the vocabulary. They are cached on disk under their identity (the model's
fingerprint, the count, the length, the seed, the temperature, the start token, the batch, the precision), so a
second heal of the same model reads them back, and a changed setting samples afresh.

`MixedStream` draws a fixed fraction of every batch from the samples and the rest from the user's text
(``heal.text = "self+text"``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from normlab.conversion.batches import autocast_dtype, cache_kwarg, model_device
from normlab.conversion.config import HealConfig
from normlab.conversion.hf import TextSplits, TokenStream
from normlab.corpus import cache_dir
from normlab.owner import hold

__all__ = ["self_samples", "own_samples", "calibration_samples", "SampleSet", "weights_fingerprint",
           "MixedStream", "heal_splits", "SAMPLES_VERSION"]  # fmt: skip

SAMPLES_VERSION = 3  # bump when the sampling procedure changes, so old caches are not read as new (2: own decode loop,
# batches of SAMPLE_BATCH, one generator for the whole set; 3: inverse-CDF draws, the decode step's attention as two
# matmuls, the precision in the identity)
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
class SampleSet:
    """Which sample set: everything that changes the tokens drawn (the batch size too: one generator draws a whole
    batch per step). ``fingerprint`` names the model (its `weights_fingerprint`); ``start`` is the first token of
    every sequence (the BOS id), or None for a uniformly drawn one."""

    fingerprint: str
    n: int
    seq_len: int
    start: int | None
    seed: int = 0
    temperature: float = 1.0
    batch_size: int = SAMPLE_BATCH
    precision: Literal["float32", "bf16"] = "float32"  # the decode's arithmetic: bf16 autocasts the model's forward

    def identity(self) -> dict:
        """The cache's identity of the set (its file name is this dictionary's hash)."""
        return {"model_fingerprint": self.fingerprint, "n": self.n, "seq_len": self.seq_len, "seed": self.seed,
                "temperature": self.temperature, "start": self.start, "batch": self.batch_size or SAMPLE_BATCH,
                "precision": self.precision, "version": SAMPLES_VERSION}  # fmt: skip


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
    w = torch.softmax((query.reshape(b, kv, h // kv, d) @ key.transpose(-1, -2)).float() * scale, -1)
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


def _draw_tokens(logits: torch.Tensor, temperature: float, gen: torch.Generator) -> torch.Tensor:
    """One token per row from softmax(logits / temperature), by inverse CDF: one uniform per row against the
    cumulative probabilities in float64 (a zero-probability token is never drawn). ``torch.multinomial`` draws from
    the same distribution but took 100 ms a step for 128 x 49,152 logits; this takes about 25."""
    cdf = torch.softmax(logits.double() / temperature, -1).cumsum(-1)
    u = torch.rand(len(cdf), 1, generator=gen, dtype=torch.float64) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).clamp_max(cdf.shape[-1] - 1)


def _draw(model: nn.Module, which: SampleSet, progress: bool) -> torch.Tensor:
    """Ancestral sampling by a plain decode loop: the model's forward with its KV cache (`_fast_decode`, autocast to
    bf16 with ``which.precision``), one token per step for a whole batch, drawn from softmax(logits / temperature)
    by this function's own generator (`_draw_tokens`; no top-k, no top-p, the end-of-sequence tokens masked as
    ``generate``'s ``min_new_tokens`` masks them)."""
    if not hasattr(model, "generate"):
        raise ValueError(
            "heal.text=self samples from the original model's causal-LM forward with a KV cache; "
            f"{type(model).__name__} is not a Hugging Face causal LM: heal on a text instead (heal.text=text)"
        )
    vocab = model.get_input_embeddings().num_embeddings
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    eos = [e for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if isinstance(e, int) and 0 <= e < vocab]
    n, seq_len, start, batch_size = which.n, which.seq_len, which.start, which.batch_size
    device = model_device(model)
    gen = torch.Generator().manual_seed(which.seed)
    key = cache_kwarg(model)
    out = []
    from tqdm.auto import tqdm

    bar = tqdm(total=n * seq_len, desc="sampling the original", unit="tok", unit_scale=True, disable=not progress,
               leave=False)  # fmt: skip
    was = model.training
    model.eval()
    cast = torch.autocast(device.type if device is not None else "cpu", dtype=torch.bfloat16,
                          enabled=which.precision == "bf16")  # fmt: skip
    try:
        with torch.no_grad(), _fast_decode(model), cast:
            for i in range(0, n, batch_size):
                b = min(batch_size, n - i)
                ids = (torch.full((b, 1), start, dtype=torch.long) if start is not None
                       else torch.randint(0, vocab, (b, 1), generator=gen))  # fmt: skip
                step, cache, rows = ids, None, [ids]
                for _ in range(seq_len - 1):
                    o = model(input_ids=step.to(device), use_cache=True, **{key: cache})
                    cache, logits = o[key], o.logits[:, -1, :vocab].float().cpu()  # drawn on the CPU: one generator
                    if eos:
                        logits[:, eos] = -torch.inf
                    step = _draw_tokens(logits, which.temperature, gen)
                    rows.append(step)
                    bar.update(b)
                bar.update(b)
                out.append(torch.cat(rows, 1))
    finally:
        model.train(was)
        bar.close()
    return torch.cat(out)


def self_samples(
    model: nn.Module, which: SampleSet, *, cache: Path | None = None, progress: bool = False
) -> torch.Tensor:
    """Sequences sampled from ``model``, read from the cache when a set with the same identity is there.

    The cache file is owned (locked) while it is written and replaced atomically; a second process that asks for
    the same set meanwhile waits for it and reads it, rather than failing after its own calibration or drawing it
    twice.

    Args:
        model: a Hugging Face causal LM (its forward with a KV cache draws the tokens).
        which: the set: the model's fingerprint, the count, the length, the start token, the seed, the
            temperature and the batch (`SampleSet`); its ``identity()`` names the cache file.
        cache: the cache folder (default ``<normlab cache>/samples``).
        progress: a progress bar, and a line with the tokens/s once drawn.

    Returns:
        The token ids, (n, seq_len).
    """
    ident = which.identity()
    n, seq_len = which.n, which.seq_len
    key = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
    folder = Path(cache) if cache is not None else cache_dir() / "samples"
    path = folder / f"samples-{key}.pt"
    folder.mkdir(parents=True, exist_ok=True)
    with hold(path, "the sample cache", wait=True):  # another process drawing this set: wait, then read it
        if path.is_file():
            try:
                saved = torch.load(path, map_location="cpu", weights_only=True)
                if saved.get("identity") == ident and tuple(saved["tokens"].shape) == (n, seq_len):
                    return saved["tokens"]
            except Exception:  # noqa: BLE001  (a damaged cache is drawn again)
                pass
        t0 = time.perf_counter()
        tokens = _draw(model, which, progress)
        seconds = time.perf_counter() - t0
        if progress:
            print(f"sampled {n:,} sequences of {seq_len} tokens from the original in {seconds / 60:.1f} min "
                  f"({n * seq_len / seconds:.0f} tokens/s, {which.precision}); cached as {path}")  # fmt: skip
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        torch.save({"identity": ident, "tokens": tokens}, tmp)
        os.replace(tmp, path)
    return tokens


class MixedStream:
    """Two token streams as one: ``fraction`` of every draw (rounded) from ``first``, the rest from ``second``.
    It has a TokenStream's interface (``next``, ``state``/``load_state``, ``chunks``, ``seq_len``, ``drawn``).

    Args:
        first: The stream ``fraction`` of each batch comes from.
        second: The stream of the rest.
        fraction: The share of ``first``, in [0, 1].
    """

    def __init__(self, first: TokenStream, second: TokenStream, fraction: float) -> None:
        if first.seq_len != second.seq_len:
            raise ValueError(f"MixedStream: sequence lengths differ ({first.seq_len} vs {second.seq_len})")
        if not 0.0 < fraction < 1.0:
            raise ValueError(f"MixedStream: fraction must be in (0, 1), got {fraction!r}")
        self.first, self.second, self.fraction = first, second, fraction
        self.chunks = torch.cat([first.chunks, second.chunks])

    def __len__(self) -> int:
        return len(self.chunks)

    @property
    def seq_len(self) -> int:
        return self.first.seq_len

    @property
    def drawn(self) -> int:
        return self.first.drawn + self.second.drawn

    def next(self, n: int) -> torch.Tensor:
        k = round(n * self.fraction)
        parts = [self.first.next(k)] if k else []
        if n - k:
            parts.append(self.second.next(n - k))
        return torch.cat(parts)

    def state(self) -> dict:
        return {"first": self.first.state(), "second": self.second.state(), "fraction": self.fraction}

    def load_state(self, state: dict) -> None:
        if state.get("fraction") != self.fraction or "first" not in state:
            raise ValueError(
                f"MixedStream: the saved stream mixed {state.get('fraction')!r} of samples, this one "
                f"{self.fraction!r}; resume with the same heal.self_fraction"
            )
        self.first.load_state(state["first"])
        self.second.load_state(state["second"])


def own_samples(
    original: nn.Module, cfg: HealConfig, seq_len: int, *, start: int | None, progress: bool = False
) -> torch.Tensor:
    """The original's sample set that ``cfg`` (a `normlab.conversion.config.HealConfig`) names: its
    ``self_sequences`` count, seed and temperature, cached under the original's `weights_fingerprint`. The heal's
    ``self`` stream and ``calibrate.source = "self"`` read the same set.

    Args:
        original: The unconverted model, which samples.
        cfg: The heal's config, a `normlab.conversion.config.HealConfig`.
        seq_len: Tokens per sample.
        start: The token each sample starts from (the BOS token); None draws a uniform random first token.
        progress: Show a progress bar while it samples.
    """
    dtype, _ = autocast_dtype(cfg.sample_precision, original, "heal.sample_precision")
    which = SampleSet(weights_fingerprint(original), cfg.self_sequences, seq_len, start, cfg.seed, cfg.temperature,
                      precision="bf16" if dtype is not None else "float32")  # fmt: skip
    return self_samples(original, which, progress=progress)


def calibration_samples(original: nn.Module, cfg: HealConfig, seq_len: int, n: int, *, start: int | None,
                        progress: bool = False) -> list[torch.Tensor]:  # fmt: skip
    """The first ``n`` of the original's own samples (`own_samples`) as calibration batches of 8, (8, seq_len):
    calibration that needs no text. They are drawn before the heal's validation part, which they never reach.

    Args:
        original: The unconverted model, which samples.
        cfg: The heal's config, a `normlab.conversion.config.HealConfig`.
        seq_len: Tokens per sample.
        n: How many samples.
        start: The token each sample starts from (the BOS token); None draws a uniform random first token.
        progress: Show a progress bar while it samples.
    """
    return list(own_samples(original, cfg, seq_len, start=start, progress=progress)[:n].split(8))


def heal_splits(splits: TextSplits, original: nn.Module, cfg: HealConfig, *, start: int | None, progress: bool = False):
    """The heal's data for ``cfg.text`` (a `normlab.conversion.config.HealConfig`): ``splits`` itself for
    "text"; for "self", the original's samples (the last eighth, at most 8, validate; the rest is the stream),
    with the calibration and held-out parts of ``splits`` unchanged; for "self+text", a `MixedStream` of
    both, validated on both. The samples are cached under the original's `weights_fingerprint`.

    Args:
        splits: The conversion text's calibration, held-out and stream parts.
        original: The unconverted model, which samples.
        cfg: The heal's config, a `normlab.conversion.config.HealConfig`.
        start: The token each sample starts from (the BOS token); None draws a uniform random first token.
        progress: Show a progress bar while it samples.
    """
    from normlab.conversion.hf import TextSplits

    if cfg.text == "text":
        return splits
    samples = own_samples(original, cfg, splits.stream.seq_len, start=start, progress=progress)
    n_val = min(8, max(1, len(samples) // 8))
    own = TokenStream(samples[:-n_val], cfg.seed)
    own_val = list(samples[-n_val:].split(8))
    if cfg.text == "self":
        return TextSplits(splits.calib, splits.held, own_val, own)
    return TextSplits(
        splits.calib, splits.held, [*splits.val, *own_val], MixedStream(own, splits.stream, cfg.self_fraction)
    )
