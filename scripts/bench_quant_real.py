"""Does a converted SmolLM2-135M take static per-tensor int8 activations better than the original? One run, one row
per model, scheme and scope in bench/quant_real.csv.

    normlab convert --model smollm2 --to dyisru --per channel --budget-nats 0.02 --set budget.metric=kl \\
        data.walk=self --out runs/smollm2-recommended                      # the README's recommended conversion
    python scripts/bench_quant_real.py --folders runs/smollm2-recommended

The models: SmolLM2-135M-Instruct as shipped; each converted folder given, as saved and folded (`normlab.fold`: each
converted site's gamma moved into the layers that read it, whose inputs are then the bounded f(x) alone); with
``--all-dyt``, every one of the 61 sites converted to DyT (calibrated on the first 32 Shakespeare sequences, no heal)
and folded. Each is fake-quantized at its reader layers (q, k, v, gate, up: the layers whose input is a norm's
output; `normlab.quantize.quantized`): ``w8a8``, weights int8 per output channel and inputs int8 with one static
per-tensor scale, max |x| over the 32 calibration sequences; and ``w8``, the weights alone. Two scopes: every
reader layer, and only the readers of the first folder's converted sites (the same layers in every model). Each is
judged by the conversion judge on the 32 held-out Shakespeare sequences (same top-1, mean and p99 KL) against the
same model in float (``own_``: what quantization alone costs it) and against the float original.
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import torch

import normlab
from _study import stamp  # scripts/ is on the path when a script runs
from normlab.conversion.data.fixtures import smollm2
from normlab.conversion.data.models import load_model
from normlab.conversion.data.texts import TextCut, text_batches
from normlab.conversion.measure.judge import judge_tokens
from normlab.corpus import fetch_shakespeare
from normlab.quantize import input_ranges, quantized
from normlab.table import append_csv

ROOT = Path(__file__).resolve().parent.parent
READERS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")


def readers(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    """The linear layers that read a norm's output, by name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.endswith(READERS)}


def _stats(result: dict) -> dict:
    return {"same_top1": round(result["same_top1"], 4), "kld_mean": round(result["kld"]["mean"], 4),
            "kld_p99": round(result["kld"]["p99"], 3)}  # fmt: skip


def site_readers(sites: list[str]) -> tuple[str, ...]:
    """The reader layers' names of Llama norm sites: q, k, v after an input norm, gate and up after the other."""
    out = []
    for site in sites:
        block = site.rsplit(".", 1)[0]
        kind = ("self_attn", ("q_proj", "k_proj", "v_proj")) if site.endswith("input_layernorm") else None
        kind = kind or (("mlp", ("gate_proj", "up_proj")) if site.endswith("post_attention_layernorm") else None)
        out += [f"{block}.{kind[0]}.{n}" for n in kind[1]] if kind else []
    return tuple(out)


def measure(name: str, model, original, calib: list[torch.Tensor], items: list, scopes: dict) -> list[dict]:
    """Rows for ``model``: float against the original, then each scheme in each scope (name -> the reader layers'
    names, None: every reader) against the model in float and against the float original."""
    rows = [{"model": name, "scheme": "float", **_stats(judge_tokens(original, model, items))}]
    reference = copy.deepcopy(model)  # the same model in float, beside the quantized one
    for scope, names in scopes.items():
        layers = {n: m for n, m in readers(model).items() if names is None or n in names}
        amax = input_ranges(layers, lambda: [model(b) for b in calib])
        tops = sorted(amax.values())
        ranges = {"layers": len(layers), "input_amax_max": round(tops[-1], 2),
                  "input_amax_median": round(tops[len(tops) // 2], 2)}  # fmt: skip
        for scheme, a_bits in (("w8a8", 8), ("w8", None)):
            with quantized(layers, 8, a_bits, amax):
                own, total = judge_tokens(reference, model, items), judge_tokens(original, model, items)
            own = {f"own_{k}": v for k, v in _stats(own).items()}
            rows.append({"model": name, "scheme": scheme, "scope": scope, **_stats(total), **own, **ranges})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--folders", nargs="*", default=[], type=Path, help="converted folders of SmolLM2 to judge too")
    p.add_argument("--all-dyt", action="store_true", help="also every site converted to DyT, no heal, folded")
    p.add_argument("--csv", type=Path, default=ROOT / "bench" / "quant_real.csv")
    args = p.parse_args()
    torch.manual_seed(0)
    original, tokenizer = load_model(smollm2(), progress=False)
    calib, held = text_batches(fetch_shakespeare(), tokenizer, original.config.vocab_size, TextCut())
    items = [(row, 0) for batch in held for row in batch]
    models, scopes = {"original": copy.deepcopy(original)}, {"all readers": None}
    for folder in args.folders:
        model, record = normlab.load_converted(folder)
        models[folder.name] = model.eval()
        models[f"{folder.name}, folded"] = copy.deepcopy(model)
        normlab.fold(models[f"{folder.name}, folded"])
        scopes.setdefault("readers of the converted sites", site_readers([s.name for s in record.sites]))
    if args.all_dyt:
        folded = copy.deepcopy(original)
        normlab.convert_norms(folded, "dyt", calibrate=calib, progress=False)
        normlab.fold(folded)
        models["dyt_all_folded"] = folded.eval()
    with torch.no_grad():
        for name, model in models.items():
            rows = measure(name, model, original, calib, items, scopes)
            append_csv(args.csv, rows, stamp=stamp())
            for r in rows:
                print(r, flush=True)


if __name__ == "__main__":
    main()
