"""A stand-in for today's small models with big vocabularies: a causal LM built from a config at the shape of a
270M model with a 262,144-token vocabulary (Gemma 3's: width 640, 18 blocks, 4 heads of 256 over one key-value head,
MLP 2,048), random weights, and a byte-level BPE tokenizer whose ids cover the whole vocabulary. Nobody trained it:
it times the stages of a conversion (``scripts/bench_convert.py --model standin-262k``) and tests the plumbing of the
measurements whose cost grows with the vocabulary, never the fidelity of a conversion.

    from normlab.conversion.data.standin import standin
    standin(262_144)                      # the folder, built once and cached under $NORMLAB_CACHE
    standin(49_152)                       # the same shape with SmolLM2's vocabulary: the comparison
    standin(262_144, width=64, blocks=2)  # a small one for a test

``normlab convert --model standin-262k`` (or ``standin-49k``) names them (`normlab.conversion.data.fixtures`).
"""

from __future__ import annotations

import json
import os
import shutil
import string
from pathlib import Path

__all__ = ["STANDIN_SHAPE", "standin", "standin_tokenizer"]

# Gemma 3 270M's published shape (its config.json); the vocabulary is standin()'s argument.
STANDIN_SHAPE = {
    "hidden_size": 640,
    "num_hidden_layers": 18,
    "intermediate_size": 2048,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
}
SPECIALS = ("<pad>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>")
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
STANDIN_VERSION = 1  # bump when what standin() builds changes: the cached folder is built again


def standin_tokenizer(vocab: int):
    """A byte-level BPE tokenizer of exactly ``vocab`` ids (261 to 271,176): `SPECIALS`, the 256 byte symbols, pairs
    of them (letters, a space and common punctuation first), then triples of those, in a fixed order (no training,
    so the same ids on every machine). Text becomes tokens of one to three bytes, ids across the whole vocabulary.

    Args:
        vocab: The vocabulary size.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    # 59 symbols, whose 205,379 triples fill a 262,144 vocabulary: English words of three letters become one token
    printable = [*string.ascii_lowercase, "\u0120", *string.ascii_uppercase, *".,'!?-"]  # \u0120: a space before
    first = [(a, b) for a in printable for b in printable]  # then every other pair, then triples of printables
    pairs = first + sorted(set((a, b) for a in alphabet for b in alphabet) - set(first))
    floor, most = len(SPECIALS) + len(alphabet), len(SPECIALS) + len(alphabet) + len(pairs) + len(printable) ** 3
    if not floor <= vocab <= most:
        raise ValueError(f"standin_tokenizer: a vocabulary of {floor:,} to {most:,} ids, got {vocab:,}")
    triples = ((a + b, c) for a in printable for b in printable for c in printable)
    merges = (pairs + [next(triples) for _ in range(max(0, vocab - floor - len(pairs)))])[: vocab - floor]
    ids = {t: i for i, t in enumerate([*SPECIALS, *alphabet])}
    for a, b in merges:
        ids[a + b] = len(ids)
    tok = Tokenizer(models.BPE(vocab=ids, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", chat_template=TEMPLATE
    )


def standin(vocab: int = 262_144, *, width: int | None = None, blocks: int | None = None, cache: Path | None = None):
    """The stand-in's folder (config.json, model.safetensors, tokenizer, generation config), built from a config
    the first time and cached: ``cache/standin-<vocab>[-w<width>-b<blocks>]``. Weights drawn after
    ``torch.manual_seed(0)`` by transformers' own initialisation.

    Args:
        vocab: The vocabulary size.
        width: The hidden size; None: `STANDIN_SHAPE`'s (640). Another width scales the MLP (x3.2) with it.
        blocks: The number of blocks; None: `STANDIN_SHAPE`'s (18).
        cache: The cache folder; None: ``NORMLAB_CACHE`` or ``~/.cache/normlab``.
    """
    from normlab.corpus import cache_dir

    shape = dict(STANDIN_SHAPE)
    if width is not None:
        shape.update(hidden_size=width, intermediate_size=width * 16 // 5, head_dim=max(width // 4, 8))
    if blocks is not None:
        shape["num_hidden_layers"] = blocks
    name = f"standin-{vocab}" + ("" if width is None and blocks is None else f"-w{width}-b{blocks}")
    target = (cache or cache_dir()) / name
    mark = target / "standin.json"
    identity = {"version": STANDIN_VERSION, "vocab": vocab, **shape}
    try:
        if json.loads(mark.read_text()) == identity:
            return target
    except (OSError, ValueError):
        pass
    part = target.with_name(f"{name}.{os.getpid()}.part")
    shutil.rmtree(part, ignore_errors=True)
    _build(part, vocab, shape)
    (part / "standin.json").write_text(json.dumps(identity))
    shutil.rmtree(target, ignore_errors=True)
    os.replace(part, target)
    return target


def _build(folder: Path, vocab: int, shape: dict) -> None:
    """Write the model, its tokenizer and generation config to ``folder``."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, GenerationConfig

    tok = standin_tokenizer(vocab)
    specials = {t: tok.convert_tokens_to_ids(t) for t in SPECIALS}
    cfg = Gemma3TextConfig(
        vocab_size=vocab,
        **shape,
        max_position_embeddings=32_768,
        sliding_window=512,
        pad_token_id=specials["<pad>"],
        bos_token_id=specials["<bos>"],
        eos_token_id=[specials["<eos>"], specials["<end_of_turn>"]],
    )
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(cfg).eval()
    model.save_pretrained(folder)
    GenerationConfig(
        bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id
    ).save_pretrained(folder)
    tok.save_pretrained(folder)
