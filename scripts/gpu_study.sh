#!/usr/bin/env bash
# The scaling study's GPU check: matched DyT (model.norm_init=match_rms) against RMSNorm at GPT-2 small
# (12 x 768, context 1024, bf16, torch.compile), in the GPT-2 block and the LLaMA block, on one GPU.
# Four runs of 1000 steps x 32 x 1024 tokens; about 30 minutes on one H100 (not measured here: no GPU).
#
#   bash scripts/gpu_study.sh                       # on a GPU machine, from the repository (after `make setup`)
#   DATA=big.txt bash scripts/gpu_study.sh          # your own text: 33M tokens is ~7 passes over Shakespeare
#   LR=1e-3 bash scripts/gpu_study.sh               # one rate for every run (not tuned per norm: see the README)
#
# The quantization study's GPU preset (docs/results.md): four norms, the GPT-2 block, 250 steps each, about 10
# minutes on one H100 (estimated from the four runs of 1000 steps above, not measured here):
#
#   BLOCKS=gpt2 NORMS="rms_norm dyt dyisru layer_scale" SET="steps=250" bash scripts/gpu_study.sh
#
# BLOCKS, NORMS, PRESET, SET (extra --set pairs) and OUT change the rest; the test suite runs it on the CPU at tiny
# shapes. It prints one table (per block and norm: final validation loss, its gap to RMSNorm, the kurtosis of the
# norm readers' inputs and the held-out loss gap under W8A8 and W4 fake quantization) and leaves the runs in $OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
NORMLAB=${NORMLAB:-.venv/bin/normlab}
PRESET=${PRESET:-gpt2-small}
OUT=${OUT:-runs/gpu_study}
LR=${LR:-6e-4}
SET=${SET:-}
BLOCKS=${BLOCKS:-gpt2 llama}
NORMS=${NORMS:-rms_norm dyt}
DATA_ARGS=()
if [ -n "${DATA:-}" ]; then DATA_ARGS=(--data "$DATA"); fi

for block in $BLOCKS; do
  for norm in $NORMS; do
    init=default
    if [ "$norm" != rms_norm ]; then init=match_rms; fi
    # shellcheck disable=SC2086  # SET holds several key=value pairs
    "$NORMLAB" train --preset "$PRESET" --norm "$norm" --out "$OUT/$block-$norm" --no-progress "${DATA_ARGS[@]}" \
      --set "model.block=$block" "model.norm_init=$init" "lr=$LR" $SET
  done
done

"${PYTHON:-.venv/bin/python}" - "$OUT" "$BLOCKS" "$NORMS" <<'PY'
import json, sys
from pathlib import Path

out, blocks, norms = Path(sys.argv[1]), sys.argv[2].split(), sys.argv[3].split()
print(f"\n{'block':8} {'norm':12} {'val loss':>9} {'gap':>8} {'kurt readers':>13} {'W8A8 gap':>9} {'W4 gap':>8}")
for block in blocks:
    s = {n: json.loads((out / f"{block}-{n}" / "summary.json").read_text()) for n in norms}
    for n in norms:
        loss, ref = s[n].get("final_val_loss"), s.get("rms_norm", {}).get("final_val_loss")
        gap = loss - ref if None not in (loss, ref) else float("nan")
        cols = [s[n].get(k, float("nan")) for k in ("kurt_readers", "qgap_w8a8", "qgap_w4")]
        print(f"{block:8} {n:12} {loss:9.4f} {gap:+8.4f} {cols[0]:13.2f} {cols[1]:+9.4f} {cols[2]:+8.4f}")
PY
