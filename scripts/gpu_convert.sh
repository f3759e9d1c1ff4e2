#!/usr/bin/env bash
# Issue 48's conversion stages on one GPU, in one command: per-channel calibration, the budget walk, and the self
# heal's recipe, each timed stage by stage (load, samples, calibration or walk, heal, measurement) from its
# fidelity.json. Not measured here: no GPU. Run it on a GPU machine from the repository (after `make setup`):
#
#   bash scripts/gpu_convert.sh                              # SmolLM2-135M on cuda
#   MODEL=path/to/hf-folder bash scripts/gpu_convert.sh      # your model (a folder or a .gguf)
#   HEAL_MINUTES=30 bash scripts/gpu_convert.sh              # a longer heal (default 10)
#
# DEVICE (default cuda), OUT (default runs/gpu_convert) and EXTRA (more convert flags) change the rest; the test
# suite runs it on the CPU with DEVICE=cpu on a tiny model.
set -euo pipefail
cd "$(dirname "$0")/.."
NORMLAB=${NORMLAB:-.venv/bin/normlab}
MODEL=${MODEL:-smollm2}
DEVICE=${DEVICE:-cuda}
OUT=${OUT:-runs/gpu_convert}
HEAL_MINUTES=${HEAL_MINUTES:-10}
HEAL=${HEAL:-"--heal-minutes $HEAL_MINUTES"}
EXTRA=${EXTRA:-}

run() {  # NAME FLAGS...: one conversion into $OUT/NAME
  local name=$1
  shift
  # shellcheck disable=SC2086  # EXTRA and HEAL hold several flags
  "$NORMLAB" convert --model "$MODEL" --to dyisru --per channel --device "$DEVICE" --out "$OUT/$name" --overwrite \
    --no-progress $EXTRA "$@"
}

run per-channel
run budget-walk --budget-nats 0.4
# shellcheck disable=SC2086
run self-recipe --heal-text self --set heal.schedule=cooldown heal.teacher_top_k=1024 $HEAL

"${PYTHON:-.venv/bin/python}" - "$OUT" "$DEVICE" <<'PY'
import json, sys
from pathlib import Path

out, device = Path(sys.argv[1]), sys.argv[2]
print(f"\nconvert stages on {device}, seconds (each run's fidelity.json):")
for name in ("per-channel", "budget-walk", "self-recipe"):
    fid = json.loads((out / name / "fidelity.json").read_text())
    stages = ", ".join(f"{k} {v:.1f}" for k, v in fid["stages"].items())
    rise = fid["ce_converted"] - fid["ce_original"]
    print(f"{name:12} held-out CE +{rise:.3f}; {stages}")
PY
