"""The judge's reference points: SmolLM2-135M-Instruct against itself with its weights rounded as quantizers round
them, judged exactly as a conversion is (`normlab.conversion.measure.usage.usage_report`: same top-1, KL tails, the
worst sequence, the chat score). They say what the numbers of a conversion mean: how much agreement a change that
users call harmless keeps, and so whether a target such as a chat score of 50% asks for more than that.

    python scripts/bench_reference_points.py                       # bf16, 8-, 6- and 4-bit weights
    python scripts/bench_reference_points.py --points int6         # between: 6 bits

The points: every weight of the blocks' linear layers rounded to bf16, or to 8, 6 or 4 bits round-to-nearest with one
absmax scale per group of 32 inputs (no calibration, no error feedback: cruder than llama.cpp's k-quants or
GPTQ). The embedding, the output layer and the norms stay float32, as most quantized files keep them at higher
precision. Texts and prompts are a conversion's defaults: the held-out end of the Shakespeare text, docutils'
documentation, the chat set, the long and stress inputs. One row per point goes to bench/reference_points.csv. A
benchmark, not a test: nothing is asserted.
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
from normlab.conversion.config import ConvertConfig
from normlab.conversion.data.fixtures import smollm2
from normlab.conversion.data.models import load_model
from normlab.conversion.data.texts import conversion_texts
from normlab.conversion.measure.usage import usage_lines, usage_report
from normlab.corpus import fetch_shakespeare
from normlab.table import append_csv

ROOT = Path(__file__).resolve().parent.parent
GROUP = 32  # inputs per absmax scale


def round_weight(w: torch.Tensor, point: str) -> torch.Tensor:
    """``w`` (out, in) rounded as ``point`` says: "bf16", or "int8"/"int6"/"int4" round-to-nearest per group of
    ``GROUP`` inputs, symmetric, one absmax scale a group."""
    if point == "bf16":
        return w.to(torch.bfloat16).to(w.dtype)
    bits = {"int8": 8, "int6": 6, "int4": 4}[point]
    top = 2 ** (bits - 1) - 1
    out, n = w.shape
    pad = (-n) % GROUP
    g = torch.nn.functional.pad(w, (0, pad)).reshape(out, -1, GROUP)
    scale = g.abs().amax(-1, keepdim=True).clamp_min(1e-12) / top
    q = (g / scale).round().clamp(-top - 1, top) * scale
    return q.reshape(out, -1)[:, :n]


def perturbed(model: nn.Module, point: str) -> nn.Module:
    """A copy of ``model`` whose blocks' linear layers hold rounded weights (the embedding and the head untouched)."""
    other = copy.deepcopy(model)
    blocks = other.get_decoder().layers
    with torch.no_grad():
        for m in blocks.modules():
            if isinstance(m, nn.Linear):
                m.weight.copy_(round_weight(m.weight, point))
    return other


def _row(point: str, report: dict, minutes: float) -> dict:
    row = {"point": point, "model": "smollm2", "group": GROUP if point != "bf16" else "",
           "threads": os.environ.get("OMP_NUM_THREADS", str(os.cpu_count())), "minutes": round(minutes, 1)}  # fmt: skip
    return row | judgement_row(report, p99=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--points", nargs="+", choices=["bf16", "int8", "int6", "int4"], default=["bf16", "int8", "int6", "int4"]
    )
    p.add_argument("--csv", type=Path, default=ROOT / "bench" / "reference_points.csv")
    args = p.parse_args()
    model, tok = load_model(smollm2(), progress=False)
    model.eval()
    text = fetch_shakespeare()
    cfg = ConvertConfig(model="smollm2", to="dyisru")  # a conversion's default texts
    texts = conversion_texts(cfg, text, tok, model.get_input_embeddings().num_embeddings)
    own = Path(text).read_text(errors="replace")
    for point in args.points:
        t0 = time.perf_counter()
        report = usage_report(model, perturbed(model, point), tok, texts.judged(), own)
        minutes = (time.perf_counter() - t0) / 60
        print(f"\n== {point} weights ==\n{usage_lines(report)}", flush=True)
        append_csv(args.csv, [_row(point, report, minutes)], stamp=stamp())
        print(f"{point}: {minutes:.1f} min -> {args.csv}", flush=True)


if __name__ == "__main__":
    main()
