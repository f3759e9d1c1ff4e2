"""Writes src/normlab/experiments/scaling.toml: the scaling study's grid (cells in decisive order, each norm's
learning-rate grid, the grids widened where a first pass found the best rate at an edge). Edit here, run
`python scripts/scaling_grid.py`, and commit both; run ids are hashes of the configs, so finished runs keep theirs."""

from pathlib import Path

NORMS = {
    "rms": ("RMSNorm", '"model.norm" = "rms_norm"'),
    "dyt_m": ("DyT, match_rms", '"model.norm" = "dyt", "model.norm_init" = "match_rms"'),
    "derf_m": ("Derf, match_rms", '"model.norm" = "derf", "model.norm_init" = "match_rms"'),
    "dyisru_m": ("DyISRU, match_rms", '"model.norm" = "dyisru", "model.norm_init" = "match_rms"'),
    "dyt": ("DyT, default init", '"model.norm" = "dyt"'),
    "ls_m": (
        "layer_scale (no normalization), match_rms",
        '"model.norm" = "layer_scale", "model.norm_init" = "match_rms"',
    ),
}
ALL = list(NORMS)
TWO = ["rms", "dyt_m"]
ADAM = {64: [1e-3, 2e-3, 4e-3], 128: [5e-4, 1e-3, 2e-3, 4e-3], 256: [5e-4, 1e-3, 2e-3]}
MUON = {"rms": [0.01, 0.02, 0.04], "dyt_m": [0.0025, 0.005, 0.01]}  # around each one's best in the pilot
# (width, budget, block, optimizer, depth, norms): the decisive cells first
CELLS = [
    (64, 1, "gpt2", "adamw", 4, ALL),
    (128, 1, "gpt2", "adamw", 4, ALL),
    (64, 4, "gpt2", "adamw", 4, ["rms", "dyt_m", "ls_m"]),
    (256, 1, "gpt2", "adamw", 4, TWO),
    (64, 1, "llama", "adamw", 4, TWO),
    (64, 1, "gpt2", "muon", 4, TWO),
    (64, 1, "llama", "muon", 4, TWO),
    (128, 4, "gpt2", "adamw", 4, TWO),
    (64, 16, "gpt2", "adamw", 4, TWO),
    (128, 1, "llama", "adamw", 4, TWO),
    (128, 1, "gpt2", "muon", 4, TWO),
    (128, 1, "llama", "muon", 4, TWO),
    (128, 1, "gpt2", "adamw", 8, TWO),
]
# grids widened where the first pass found the best rate at an edge (the report flags it)
WIDEN = {
    ("w64_x4_gpt2_adamw", "rms"): [8e-3],
    ("w64_x4_gpt2_adamw", "dyt_m"): [5e-4],
    ("w64_x4_gpt2_adamw", "ls_m"): [5e-4],
    ("w256_x1_gpt2_adamw", "dyt_m"): [2.5e-4],
    ("w64_x1_llama_adamw", "rms"): [8e-3],
    ("w64_x1_llama_muon", "rms"): [0.08, 0.16],
    ("w64_x1_gpt2_adamw", "dyt"): [8e-3, 1.6e-2],
    ("w128_x4_gpt2_adamw", "rms"): [2.5e-4],
    ("w128_x4_gpt2_adamw", "dyt_m"): [2.5e-4],
    ("w64_x16_gpt2_adamw", "rms"): [8e-3],
    ("w64_x16_gpt2_adamw", "dyt_m"): [5e-4],
    ("w128_x1_llama_adamw", "dyt_m"): [2.5e-4],
    ("w128_x1_gpt2_muon", "rms"): [0.08],
    ("w128_x1_llama_muon", "rms"): [0.08],
}
out = []
w = out.append
w("""# Is the one-batch gamma init (model.norm_init = "match_rms") a real win over RMSNorm, or a small-scale artifact?
# Each norm at its best learning rate of a grid (lrs), two seeds, at widths 64 / 128 / 256, budgets 1x / 4x / 16x the
# small preset's tokens, the GPT-2 and the LLaMA block, AdamW and Muon. The cells that decide a verdict come first.
# The grids were set from single-seed pilots at width 64 (docs/results.md, the scaling study); a best rate at
# a grid's edge is flagged by the report. Run with `python scripts/scaling_study.py` (resumable; results in
# bench/scaling.jsonl), not in `make demo`. Written by scripts/scaling_grid.py: edit the grid there.
name = "scaling"
title = "Matched DyT against RMSNorm at tuned learning rates: width, tokens, block, optimizer"
source = "normlab's own question (docs/results.md); published anchors: the DyISRU paper's GPT-2 runs, the Derf paper"
claim = "published comparisons at GPT-2 size put RMSNorm/LayerNorm ahead of DyT; at 4 x 64 matched DyT was ahead"
seeds = [0, 1]
profiles = ["scaling"]
baseline = "w64_x1_gpt2_adamw_rms"
guard = false
figures = ["lr", "gap_trend"]

[[checks]]
kind = "lr_sweeps"
""")
pairs, names = [], []
for width, budget, block, opt, depth, norms in CELLS:
    cid = f"w{width}_x{budget}_{block}_{opt}" + (f"_d{depth}" if depth != 4 else "")
    cell = f"w{width} x{budget} {block} {opt}" + (f" depth {depth}" if depth != 4 else "")
    for n in norms:
        if n != "rms":
            pairs.append((f"{cid}_{n}", f"{cid}_rms"))
            names.append(f"{cell} ({n})")
w('[[checks]]\nkind = "gap_trend"\n')
compare = []
for w_, ref in ((64, "w64_x1_gpt2_adamw"), (128, "w128_x1_gpt2_adamw")):
    for other, what in (
        (f"w{w_}_x1_llama_adamw", "the LLaMA block"),
        (f"w{w_}_x1_gpt2_muon", "Muon"),
        (f"w{w_}_x1_llama_muon", "the LLaMA block with Muon"),
    ):
        compare.append(
            f'[["{other}_dyt_m", "{other}_rms"], ["{ref}_dyt_m", "{ref}_rms"], "{what} at width {w_}", '
            f'"GPT-2 with AdamW"]'
        )
w('[[checks]]\nkind = "verdicts_agree"\nwhat = "matched DyT against RMSNorm"')
w("compare = [" + ", ".join(compare) + "]\n")
abl = [(f"{c}_ls_m", f"{c}_dyt_m") for c in ("w64_x1_gpt2_adamw", "w128_x1_gpt2_adamw", "w64_x4_gpt2_adamw")]
w('[[checks]]\nkind = "gap"\nwhat = "no normalization (layer_scale, match_rms) against matched DyT"')
w("pairs = [" + ", ".join(f'["{a}", "{b}"]' for a, b in abl) + "]")
w("names = [" + ", ".join(f'"{a.rsplit("_ls_m")[0]}"' for a, _ in abl) + "]\n")
w('[[checks]]\nkind = "gap"\nwhat = "gap to RMSNorm"')
w("pairs = [" + ", ".join(f'["{a}", "{b}"]' for a, b in pairs) + "]")
w("names = [" + ", ".join(f'"{n}"' for n in names) + "]\n")
for width, budget, block, opt, depth, norms in CELLS:
    cid = f"w{width}_x{budget}_{block}_{opt}" + (f"_d{depth}" if depth != 4 else "")
    cell = f"w{width} x{budget} {block} {opt}" + (f" depth {depth}" if depth != 4 else "")
    w(f"# {cell}")
    for n in norms:
        label, setn = NORMS[n]
        extra = f'"model.width" = {width}, "model.depth" = {depth}, "model.heads" = 4, "model.block" = "{block}"'
        if opt == "muon":
            extra += ', "optimizer" = "muon", "lr" = 2e-3'
        lrs = sorted((MUON[n] if opt == "muon" else ADAM[width]) + WIDEN.get((cid, n), []))
        w("[[runs]]")
        w(f'name = "{cid}_{n}"')
        w(f'label = "{cell}, {label}"')
        w(f"set = {{ {setn}, {extra} }}")
        w("lrs = [" + ", ".join(f"{v:g}" for v in lrs) + "]")
        if opt == "muon":
            w('lr_field = "muon_lr"')
        if budget != 1:
            w(f"budget = {budget}")
        w(f'cell = "{cell}"\nseries = "{n}"\nwidth = {width}\nblock = "{block}"\nopt = "{opt}"\ndepth = {depth}\n')
(Path(__file__).resolve().parents[1] / "src/normlab/experiments/scaling.toml").write_text("\n".join(out))
