"""Does a converted SmolLM2-135M take static per-tensor int8 activations better than the original? One run, one row
per model and scheme in bench/quant_real.csv.

    normlab convert --model smollm2 --to dyisru --per channel --budget-nats 0.02 --set budget.metric=kl \\
        data.walk=self --out runs/smollm2-recommended                      # the README's recommended conversion
    python scripts/bench_quant_real.py --folders runs/smollm2-recommended

The models: SmolLM2-135M-Instruct as shipped; each converted folder given; and every one of its 61 sites converted
to DyT (calibrated on the first 32 Shakespeare sequences, no heal) then folded (`normlab.fold`: each site's gamma
moved into the layers that read it, so their inputs are tanh(alpha x), within [-1, 1]). Each is fake-quantized at
its reader layers (q, k, v, gate, up: the layers whose input is a norm's output; `normlab.quantize.quantized`):
``w8a8``, weights int8 per output channel and inputs int8 with one static per-tensor scale, max |x| over the 32
calibration sequences; and ``w8``, the weights alone. Each is judged by the conversion judge on the 32 held-out
Shakespeare sequences (`normlab.conversion.measure.judge.judge_tokens`: same top-1, mean and p99 KL) twice:
against the same model in float (what quantization alone costs it) and against the float original (the total).
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import torch

import normlab
from _study import stamp  # scripts/ is on the path when a script runs
from normlab.conversion.data.models import TextCut, load_model, smollm2, text_batches
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


def measure(name: str, model, original, calib: list[torch.Tensor], items: list) -> list[dict]:
    """Rows for ``model``: float against the original, then each scheme against the model in float and against the
    float original."""
    rows = [{"model": name, "scheme": "float", **_stats(judge_tokens(original, model, items))}]
    layers = readers(model)
    amax = input_ranges(layers, lambda: [model(b) for b in calib])
    reference = copy.deepcopy(model)  # the same model in float, beside the quantized one
    for scheme, a_bits in (("w8a8", 8), ("w8", None)):
        with quantized(layers, 8, a_bits, amax):
            own, total = judge_tokens(reference, model, items), judge_tokens(original, model, items)
        own = {f"own_{k}": v for k, v in _stats(own).items()}
        tops = sorted(amax.values())
        ranges = {"input_amax_max": round(tops[-1], 2), "input_amax_median": round(tops[len(tops) // 2], 2)}
        rows.append({"model": name, "scheme": scheme, **_stats(total), **own, **ranges})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--folders", nargs="*", default=[], type=Path, help="converted folders of SmolLM2 to judge too")
    p.add_argument("--csv", type=Path, default=ROOT / "bench" / "quant_real.csv")
    args = p.parse_args()
    torch.manual_seed(0)
    original, tokenizer = load_model(smollm2(), progress=False)
    calib, held = text_batches(fetch_shakespeare(), tokenizer, original.config.vocab_size, TextCut())
    items = [(row, 0) for batch in held for row in batch]
    models = {"original": copy.deepcopy(original)}
    for folder in args.folders:
        models[folder.name] = normlab.load_converted(folder)[0].eval()
    folded = copy.deepcopy(original)
    normlab.convert_norms(folded, "dyt", calibrate=calib, progress=False)
    normlab.fold(folded)
    models["dyt_all_folded"] = folded.eval()
    with torch.no_grad():
        for name, model in models.items():
            rows = measure(name, model, original, calib, items)
            append_csv(args.csv, rows, stamp=stamp())
            for r in rows:
                print(r, flush=True)


if __name__ == "__main__":
    main()
