"""How much a model's massive tokens vary in size, and what that costs an element-wise copy: at every norm site,
over the rows of ``[t, t]`` for random tokens ``t`` (the first positions, where the attention sink forms), the
massive rows' RMS spread (coefficient of variation) and the relative error of the best per-channel linear map to
the norm's output, of the raw rows and of the rows rescaled as `MassiveTokens` rescales them (one L2 norm over the
4 channels that carry the activation).

    python scripts/massive_spread.py --model qwen-coder      # or smollm2, or a path

A measurement, not a test: it prints a table and asserts nothing. A row is massive when its RMS is above 30x the
median row's RMS of random text at that site.
"""

from __future__ import annotations

import argparse

import torch

from normlab.conversion.batches import run_hooked
from normlab.conversion.calibrate.massive import MassiveTokens, early_rows
from normlab.conversion.data.fixtures import fixture_path
from normlab.conversion.data.models import load_model
from normlab.table import format_table


def _linear_error(x: torch.Tensor, y: torch.Tensor) -> float:
    """The relative error of the best map ``a_c * x_c`` per channel from rows ``x`` to rows ``y``."""
    a = (x * y).sum(0) / x.pow(2).sum(0).clamp_min(1e-30)
    return float((a * x - y).norm() / y.norm())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen-coder", help="a fixture's name (smollm2, qwen-coder) or a model path")
    p.add_argument("--tokens", type=int, default=768, help="random tokens put first")
    p.add_argument("--ratio", type=float, default=30.0, help="the RMS over the median that makes a row massive")
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    model, _ = load_model(fixture_path(args.model))
    model.eval()
    vocab = model.get_input_embeddings().num_embeddings
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (args.tokens,), generator=g)
    norms = {n: m for n, m in model.named_modules() if type(m).__name__.endswith("RMSNorm")}
    rows = early_rows(model, list(tokens[:, None].repeat(1, 2).split(256)), dict.fromkeys(norms, -1), "in")
    medians = {}

    def median_hook(name):
        def grab(module, args):
            x = args[0][:, 16:].float().reshape(-1, args[0].shape[-1])  # past the first positions
            medians[name] = float(x.pow(2).mean(-1).sqrt().median())

        return grab

    text = torch.randint(0, vocab, (2, 128), generator=g)
    run_hooked(model, text, 0, {n: median_hook(n) for n in norms}, "pre")
    table = []
    for name, x in rows.items():
        rms = x.pow(2).mean(-1).sqrt()
        heavy = rms > args.ratio * medians[name]
        if int(heavy.sum()) < 4:
            continue
        xb, r = x[heavy], rms[heavy]
        channels = xb.abs().mean(0).topk(4).indices.sort().values.tolist()
        y = xb / r[:, None] * norms[name].weight.float()
        pair = MassiveTokens(torch.nn.Identity(), torch.nn.Identity(), channels, 0.0, 1.0)
        scaled = pair.rescaled(xb, xb[:, channels], torch.ones(len(xb), 1, dtype=torch.bool))
        cv = float(r.std() / r.mean())
        table.append([name, f"{int(heavy.sum())}/{len(x)}", f"{cv:.3f}", f"{_linear_error(xb, y):.3f}",
                      f"{_linear_error(scaled, y):.4f}"])  # fmt: skip
    print(f"{args.model}: {args.tokens} random first tokens, rows of [t, t]; massive = RMS > {args.ratio}x median")
    print(format_table(["site", "massive rows", "RMS spread (cv)", "best map, raw", "best map, rescaled"], table))


if __name__ == "__main__":
    main()
