"""A sink prefix, measured before it is built (issue 87, item 2): a fixed token put in front of every input, with
the original model's keys and values for it, judged exactly as a conversion is
(`normlab.conversion.measure.usage.usage_report`: same top-1, KL, the worst sequence, the chat score).

    python scripts/bench_sink_prefix.py                                  # the original itself, each prefix
    python scripts/bench_sink_prefix.py --converted runs/pc37 runs/rec   # and converted folders, with and without

The question it answers first: what does the prefix cost the *original* model? The judge compares a conversion
against the original on the user's own input, so a prefix that changes the original's predictions puts a ceiling on
every recipe that uses it. Then, for each converted folder, the same judge with and without the prefix says whether
the prefix gains a conversion more than it costs.

How the prefix is put in front: the original runs the prefix once; its per-layer keys and values fill the KV cache
before the user's tokens (transformers' ``DynamicCache``), the attention mask gains the prefix's columns, and
position ids given from outside (``generate``'s) move by the prefix's length. Checked at start: the original with
its own prefix in the cache gives the logits of the original run on prefix + input, position for position. One row
per (model, prefix) goes to bench/sink_prefix.csv. A benchmark, not a test: nothing is asserted but that check.
"""

from __future__ import annotations

import argparse
import copy
import os
import time
from pathlib import Path

import torch
from torch import nn

from _study import judgement_row, stamp  # scripts/ is on the path when a script runs
from normlab.conversion.batches import cache_kwarg
from normlab.conversion.config import ConvertConfig
from normlab.conversion.data.fixtures import smollm2
from normlab.conversion.data.models import load_model
from normlab.conversion.data.texts import conversion_texts
from normlab.conversion.export.saving import load_converted
from normlab.conversion.measure.usage import usage_lines, usage_report
from normlab.corpus import fetch_shakespeare
from normlab.table import append_csv

ROOT = Path(__file__).resolve().parent.parent
PREFIXES = ("<|endoftext|>", "<|im_start|>")  # SmolLM2's document separator (id 0) and the chat template's first token


def prefix_states(original: nn.Module, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The original's keys and values for ``ids`` (1, P), per layer (1, heads, P, head_dim)."""
    key = cache_kwarg(original)
    with torch.no_grad():
        cache = original(ids, use_cache=True)[key]
    return [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]


def put_in_front(model: nn.Module, states: list) -> torch.utils.hooks.RemovableHandle:
    """Make every forward of ``model`` (and so its ``generate``) run after the prefix whose ``states`` are given:
    an empty or absent cache is filled with them first, a 2-D attention mask gains their columns, and position ids
    or cache positions given from outside move by their length. Returns the hook's handle (``.remove()`` undoes it).
    """
    from transformers.cache_utils import DynamicCache

    key, p = cache_kwarg(model), states[0][0].shape[-2]

    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        b = ids.shape[0] if ids is not None else kwargs["inputs_embeds"].shape[0]
        cache = kwargs.get(key)
        if cache is None:
            cache = DynamicCache(config=model.config)
        if cache.get_seq_length() == 0:
            for i, (k, v) in enumerate(states):
                cache.update(k.expand(b, -1, -1, -1).contiguous(), v.expand(b, -1, -1, -1).contiguous(), i)
        kwargs[key] = cache
        mask = kwargs.get("attention_mask")
        if mask is not None and mask.dim() == 2:
            q = ids.shape[1] if ids is not None else kwargs["inputs_embeds"].shape[1]
            missing = cache.get_seq_length() + q - mask.shape[1]
            if missing > 0:
                kwargs["attention_mask"] = torch.cat([mask.new_ones(mask.shape[0], missing), mask], 1)
        for name in ("position_ids", "cache_position"):  # given from outside, they count the user's tokens alone
            if kwargs.get(name) is not None:
                kwargs[name] = kwargs[name] + p
        return args, kwargs

    return model.register_forward_pre_hook(hook, with_kwargs=True)


def check_exact(original: nn.Module, states: list, prefix: torch.Tensor, ids: torch.Tensor) -> float:
    """The largest logit difference between the original behind the prefix (this script's way) and the original
    run on prefix + ``ids``, relative to the logits' scale; raises above 1e-4."""
    with torch.no_grad():
        whole = original(torch.cat([prefix.expand(ids.shape[0], -1), ids], 1), use_cache=False).logits[
            :, prefix.shape[1] :
        ]
        handle = put_in_front(original, states)
        try:
            behind = original(ids).logits
        finally:
            handle.remove()
    err = float((behind - whole).abs().max() / whole.abs().max())
    if err > 1e-4:
        raise SystemExit(f"the prefix in the cache is not the prefix in the input: relative difference {err:.2e}")
    return err


def _row(name: str, prefix: str, report: dict, minutes: float) -> dict:
    row = {"model": name, "prefix": prefix, "threads": os.environ.get("OMP_NUM_THREADS", str(os.cpu_count())),
           "minutes": round(minutes, 1)}  # fmt: skip
    return row | judgement_row(report)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--converted", nargs="*", type=Path, default=[], help="converted SmolLM2 folders to judge too")
    p.add_argument("--prefixes", nargs="+", default=list(PREFIXES), help="special tokens, one prefix each")
    p.add_argument("--csv", type=Path, default=ROOT / "bench" / "sink_prefix.csv")
    args = p.parse_args()
    for folder in args.converted:
        if not folder.is_dir():
            raise SystemExit(f"--converted {folder}: no such folder (a `normlab convert --out` folder)")
    original, tok = load_model(smollm2(), progress=False)
    text = fetch_shakespeare()
    vocab = original.get_input_embeddings().num_embeddings
    texts = conversion_texts(ConvertConfig(model="smollm2", to="dyisru"), text, tok, vocab)
    own = Path(text).read_text(errors="replace")
    bare = [("original", copy.deepcopy(original))]  # a copy: the judge's reference stays bare
    models = bare + [(str(f), load_converted(f)[0].eval()) for f in args.converted]
    for name, model in models:
        for prefix in ([] if name == "original" else ["none"]) + args.prefixes:
            t0 = time.perf_counter()
            handle = None
            if prefix != "none":
                ids = torch.tensor([[tok.convert_tokens_to_ids(prefix)]])
                states = prefix_states(original, ids)
                err = check_exact(original, states, ids, texts.held[0][:2])
                print(f"{prefix}: the cache holds the prefix (largest relative difference {err:.1e})", flush=True)
                handle = put_in_front(model, states)
            try:
                report = usage_report(original, model, tok, texts.judged(), own)
            finally:
                if handle is not None:
                    handle.remove()
            minutes = (time.perf_counter() - t0) / 60
            print(f"\n== {name}, prefix {prefix} ==\n{usage_lines(report)}", flush=True)
            append_csv(args.csv, [_row(name, prefix, report, minutes)], stamp=stamp())


if __name__ == "__main__":
    main()
