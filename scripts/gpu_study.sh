#!/usr/bin/env bash
# The scaling study's GPU check: matched DyT (model.norm_init=match_rms) against RMSNorm at GPT-2 small
# (12 x 768, context 1024, bf16, torch.compile), in the GPT-2 block and the LLaMA block, on one GPU.
# Four runs of 1000 steps x 32 x 1024 tokens; about 30 minutes on one H100 (not measured here: no GPU).
#
#   bash scripts/gpu_study.sh                       # on a GPU machine, from the repository (after `make setup`)
#   DATA=big.txt bash scripts/gpu_study.sh          # your own text: 33M tokens is ~7 passes over Shakespeare
#   LR=1e-3 bash scripts/gpu_study.sh               # one rate for every run (not tuned per norm: see the README)
#
# PRESET, SET (extra --set pairs) and OUT change the rest; the test suite runs it on the CPU with PRESET=tiny.
# It prints one table (final validation loss per norm and block) and leaves the runs in $OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
NORMLAB=${NORMLAB:-.venv/bin/normlab}
PRESET=${PRESET:-gpt2-small}
OUT=${OUT:-runs/gpu_study}
LR=${LR:-6e-4}
SET=${SET:-}
DATA_ARGS=()
if [ -n "${DATA:-}" ]; then DATA_ARGS=(--data "$DATA"); fi

for block in gpt2 llama; do
  for norm in rms_norm dyt; do
    init=default
    if [ "$norm" = dyt ]; then init=match_rms; fi
    # shellcheck disable=SC2086  # SET holds several key=value pairs
    "$NORMLAB" train --preset "$PRESET" --norm "$norm" --out "$OUT/$block-$norm" --no-progress "${DATA_ARGS[@]}" \
      --set "model.block=$block" "model.norm_init=$init" "lr=$LR" $SET
  done
done

"${PYTHON:-.venv/bin/python}" - "$OUT" <<'PY'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
print(f"\n{'block':8} {'RMSNorm':>9} {'DyT (match_rms)':>16} {'gap':>8}")
for block in ("gpt2", "llama"):
    loss = {n: json.loads((out / f"{block}-{n}" / "summary.json").read_text()).get("final_val_loss")
            for n in ("rms_norm", "dyt")}
    gap = loss["dyt"] - loss["rms_norm"] if None not in loss.values() else float("nan")
    print(f"{block:8} {loss['rms_norm']:9.4f} {loss['dyt']:16.4f} {gap:+8.4f}")
PY
